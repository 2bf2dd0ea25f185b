"""DeepSpeed JSON resolution: every shipped file resolves, contradictions are all reported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zerolab import ds_config
from zerolab.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("path", sorted((REPO / "ds_configs").rglob("*.json")), ids=lambda p: p.name)
def test_every_shipped_file_resolves(path):
    raw = json.loads(path.read_text())
    stage = raw["zero_optimization"]["stage"]
    zero = raw["zero_optimization"]
    overrides = [f"deepspeed.stage={stage}", f"deepspeed.config={path}", "train.micro_batch_size=4", "train.grad_accum_steps=3"]
    if "offload_optimizer" in zero:
        overrides.append("deepspeed.offload_optimizer=true")
    if "offload_param" in zero:
        overrides.append("deepspeed.offload_param=true")
    resolved = ds_config.resolve(load_config(None, overrides), {"hidden_size": 64})
    assert resolved["train_batch_size"] == 4 * 3 * 2
    assert resolved["train_micro_batch_size_per_gpu"] == 4 and resolved["gradient_accumulation_steps"] == 3
    assert resolved["bf16"]["enabled"] is False and resolved["fp16"]["enabled"] is False  # CPU: fp32
    assert "auto" not in json.dumps(resolved)


def test_default_file_follows_stage_and_offload():
    assert ds_config.config_path(load_config(None, ["deepspeed.stage=3", "deepspeed.offload_param=true"])).name == "zero3_offload.json"
    assert ds_config.config_path(load_config(None, ["deepspeed.stage=1", "deepspeed.offload_optimizer=true"])).name == "zero1.json"
    cfg = load_config(None, ["deepspeed.stage=1", "deepspeed.offload_optimizer=true"])
    assert ds_config.resolve(cfg, {"hidden_size": 64})["zero_optimization"]["offload_optimizer"]["device"] == "cpu"


def test_contradictions_are_reported_together(tmp_path):
    bad = {"train_batch_size": 64, "gradient_clipping": 5.0, "optimizer": {"type": "Adam"},
           "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(bad))
    cfg = load_config(None, ["deepspeed.stage=2", f"deepspeed.config={path}", "train.micro_batch_size=8"])
    with pytest.raises(ConfigError) as err:
        ds_config.resolve(cfg, {"hidden_size": 64})
    text = "\n".join(err.value.problems)
    assert "train_batch_size=64 but train.micro_batch_size × train.grad_accum_steps × scaling.num_workers = 8 × 1 × 2 gives 16" in text
    assert "gradient_clipping=5.0" in text and "'optimizer' section" in text
    assert "zero_optimization.stage=3 but deepspeed.stage gives 2" in text
    assert "offloads offload_param to cpu but deepspeed.offload_param=false" in text
    assert len(err.value.problems) == 5


def test_stage3_with_only_the_optimizer_offloaded_uses_the_shipped_file_without_param_offload(tmp_path):
    cfg = load_config(None, ["deepspeed.stage=3", "deepspeed.offload_optimizer=true"])
    zero = ds_config.resolve(cfg, {"hidden_size": 128})["zero_optimization"]
    assert zero["offload_optimizer"]["device"] == "cpu" and "offload_param" not in zero
    # A file the user gives is theirs: the same contradiction there is an error to fix.
    own = tmp_path / "own.json"
    own.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}))
    with pytest.raises(ConfigError, match="offloads offload_param to cpu but deepspeed.offload_param=false"):
        ds_config.resolve(load_config(None, ["deepspeed.stage=3", f"deepspeed.config={own}"]), {"hidden_size": 128})


@pytest.mark.parametrize("offload", [False, True], ids=["zero3", "zero3-offload"])
@pytest.mark.parametrize("model", ["Qwen/Qwen2.5-0.5B", "Qwen/Qwen2.5-7B", "Qwen/Qwen2.5-72B"])
def test_zero3_adapter_prefetch_is_not_cut_short_by_the_live_parameter_cap(model, offload):
    """DeepSpeed prefetches only up to stage3_max_live_parameters minus what is gathered. Under LoRA
    the output head stays gathered (the fused loss reads it) beside the embeddings and the layer in
    use; with Hugging Face's cap of 1e9 (the shipped files' value before) a 7B step's next layer did
    not fit beside them, and its weights were gathered a few at a time. The cap derived from the
    model leaves room for them and the full prefetch bucket on every known shape, and no more than
    three layers beside the embeddings and the head (uncapped, every layer stayed gathered)."""
    from zerolab.models import KNOWN_CONFIGS

    shape = KNOWN_CONFIGS[model]
    h, vocab = shape["hidden_size"], shape["vocab_size"]
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    layer = 2 * h * h + 2 * h * kv + 3 * h * shape["intermediate_size"]  # a decoder layer's weights
    outer = vocab * h * (1 if shape.get("tie_word_embeddings") else 2)  # the embeddings and the head
    cfg = load_config(None, ["deepspeed.stage=3", f"deepspeed.offload_param={str(offload).lower()}", "adapter.method=lora"])
    zero = ds_config.resolve(cfg, shape)["zero_optimization"]
    assert zero["stage3_max_live_parameters"] == outer + 3 * layer
    assert zero["stage3_max_live_parameters"] - (outer + layer) >= zero["stage3_prefetch_bucket_size"] >= layer


def test_mixture_of_experts_and_unknown_models_stay_uncapped():
    """The cap counts a dense layer; a mixture-of-experts layer holds many (a Mixtral layer alone is
    above the cap its dense shape would give), and a model the estimator cannot read has no shape:
    both keep DeepSpeed's prefetch uncapped rather than cut into single weights."""
    from zerolab.models import KNOWN_CONFIGS

    cfg = load_config(None, ["deepspeed.stage=3", "adapter.method=lora"])
    dense = dict(KNOWN_CONFIGS["Qwen/Qwen2.5-7B"])
    moe = {**dense, "model_type": "mixtral", "num_local_experts": 8}
    live = [ds_config.resolve(cfg, c)["zero_optimization"]["stage3_max_live_parameters"]
            for c in (dense, moe, {"model_type": "gpt2", "hidden_size": 768})]
    assert live[0] < 2e9 and live[1] == live[2] == ds_config.UNCAPPED


@pytest.mark.parametrize("overrides, persists", [
    (["scaling.num_workers=1"], True),
    (["scaling.num_workers=1", "adapter.method=full"], True),
    (["scaling.num_workers=1", "deepspeed.offload_optimizer=true"], True),
    (["scaling.num_workers=1", "deepspeed.offload_param=true"], False),
    (["scaling.num_workers=2"], False),
], ids=["one-rank", "one-rank-full", "one-rank-optimizer-offload", "one-rank-param-offload", "two-ranks"])
def test_zero3_keeps_every_parameter_gathered_on_one_rank_whose_parameters_stay_on_its_device(overrides, persists):
    """One rank holds each parameter's whole partition: every parameter persists there. Parameter
    offload moves them to the host, and with several ranks each holds a part: there the threshold
    is the adapter's or the hidden size's."""
    cfg = load_config(None, ["deepspeed.stage=3", *overrides])
    threshold = ds_config.resolve(cfg, {"hidden_size": 64})["zero_optimization"]["stage3_param_persistence_threshold"]
    assert (threshold == ds_config.UNCAPPED) is persists
    assert persists or threshold < 10**7
