"""Ulysses sequence parallelism (``scaling.sequence_parallel_size``): the config's checks, each rank's
slice of a micro-batch, the model's head-count check, and on two gloo ranks (CPU, real DeepSpeed
with its ALST attention) one optimizer step with the sequence split over both ranks against the same
rows trained data-parallel: the same loss and the same LoRA update; and a whole job on two Ray workers
that resumes from its checkpoint as if it had run straight through."""

from __future__ import annotations

import os

import pytest
import torch

from conftest import on_two_ranks, rows_of, tiny_overrides

ACCUM = 2
LENGTHS = [6, 9, 14]
"""Rows per rank: micro-batches of 2 rows and 1 (the sequence-parallel attention follows the row
count), odd widths (padded to a multiple of the sequence-parallel size)."""


def test_config_checks_sequence_parallel_combinations():
    from zerolab.config import ConfigError, load_config

    load_config(None, ["scaling.num_workers=4", "scaling.sequence_parallel_size=2"])
    with pytest.raises(ConfigError) as exc:
        load_config(None, ["scaling.num_workers=3", "scaling.sequence_parallel_size=2", "model.attn_implementation=eager",
                           "data.packing=true", "adapter.method=adalora", "deepspeed.stage=0", "train.precision=fp32"])
    text = "\n".join(exc.value.problems)
    assert "scaling.sequence_parallel_size: 2 does not divide scaling.num_workers=3" in text
    assert "model.attn_implementation: eager attention needs the 4D mask" in text
    assert "data.packing: with scaling.sequence_parallel_size > 1" in text
    assert "adapter.method: adalora adds its orthogonality penalty" in text
    with pytest.raises(ConfigError, match="scaling.sequence_parallel_size: 0 is not allowed"):
        load_config(None, ["scaling.sequence_parallel_size=0"])


def test_batch_size_and_deepspeed_json_count_data_parallel_ranks():
    from zerolab import ds_config
    from zerolab.config import load_config

    cfg = load_config(None, ["scaling.num_workers=4", "scaling.sequence_parallel_size=2", "train.micro_batch_size=3",
                             "train.grad_accum_steps=5"])
    assert cfg.data_parallel_size() == 2 and cfg.global_batch_size() == 30
    resolved = ds_config.resolve(cfg, {"hidden_size": 128})
    assert resolved["train_batch_size"] == 30 and resolved["sequence_parallel_size"] == 2
    plain = ds_config.resolve(load_config(None, []), {"hidden_size": 128})
    assert "sequence_parallel_size" not in plain


def test_heads_must_split_over_the_group():
    from zerolab.sequence_parallel import head_problems

    shape = {"num_attention_heads": 28, "num_key_value_heads": 4}
    assert head_problems(2, shape, "m") == [] and head_problems(4, shape, "m") == [] and head_problems(1, shape, "m") == []
    (kv,) = head_problems(14, shape, "m")
    assert "14 and the 4 key/value heads of m divide neither way" in kv
    (problem,) = head_problems(8, shape, "m")
    assert problem.startswith("scaling.sequence_parallel_size: 8 does not divide the 28 attention heads of m")
    assert "use one of [2, 4, 28]" in problem


def test_slices_of_a_batch_hold_the_shifted_labels_and_every_target_once():
    from zerolab.batches import MicroBatches
    from zerolab.sequence_parallel import shard_batch

    rows = rows_of([5, 9, 12], seed=3)
    for packing in (False, True):
        (batch,) = MicroBatches(rows, micro_batch_size=3, max_seq_length=32, packing=packing, pad_id=0, seed=0,
                                width_multiple=4).sequential()[:1]
        width = batch.inputs["input_ids"].shape[1]
        assert width % 4 == 0
        slices = [shard_batch(batch, r, 4) for r in range(4)]
        joined = {k: torch.cat([s.inputs[k] for s in slices], dim=1) for k in ("input_ids", "labels", "position_ids")}
        assert torch.equal(joined["input_ids"], batch.inputs["input_ids"])
        shifted = torch.nn.functional.pad(batch.inputs["labels"], (0, 1), value=-100)[:, 1:]
        assert torch.equal(joined["labels"], shifted)
        assert all(s.inputs["shift_labels"] is s.inputs["labels"] for s in slices)
        assert sum(s.num_targets for s in slices) == batch.num_targets
        assert sum(s.num_tokens for s in slices) == batch.num_tokens
        assert "attention_mask" not in slices[0].inputs
        if not packing:
            assert torch.equal(joined["position_ids"][0], torch.arange(width))


# --- two gloo ranks ------------------------------------------------------------------------------


def step_batches(rank: int, sp: int) -> list:
    """This rank's micro-batches: data parallel (sp 1), each rank its own rows; sequence parallel
    (sp 2, one data-parallel group), both ranks every row of both, each micro-batch sliced."""
    from zerolab.batches import MicroBatches

    def of(r: int) -> list:
        return MicroBatches(rows_of(LENGTHS, seed=100 + r), micro_batch_size=2, max_seq_length=64, packing=False, pad_id=0,
                            seed=0, width_multiple=sp).sequential()

    return of(rank) if sp == 1 else of(0) + of(1)


def sp_worker(rank: int, sp: int, stage: int, extra: tuple[str, ...], port: int, results: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                      DS_ACCELERATOR="cpu")
    import deepspeed
    import torch.distributed as dist

    from zerolab.config import load_config
    from zerolab.ds_runtime import init_distributed
    from zerolab.engine import Zero3Loading, build_model
    from zerolab.sequence_parallel import UlyssesAttention
    from zerolab.train import optimizer_step

    init_distributed("gloo")
    import deepspeed.runtime.sequence_parallel.ulysses_sp as ulysses_sp

    exchanges = []
    all_to_all = ulysses_sp._dim_zero_all_to_all
    ulysses_sp._dim_zero_all_to_all = lambda group, x: exchanges.append(x.shape) or all_to_all(group, x)
    cfg = load_config(None, ["adapter.dropout=0", "scaling.num_workers=2", f"scaling.sequence_parallel_size={sp}",
                             f"deepspeed.stage={stage}", *extra])
    ulysses = UlyssesAttention()
    torch.manual_seed(0)
    model = build_model(cfg, {}, total_steps=10, zero3=Zero3Loading(), ulysses=ulysses)
    gen = torch.Generator().manual_seed(1)
    for name, p in model.named_parameters():  # peft starts B at zero, which would leave A without a gradient
        if "lora_B" in name:
            p.data.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    batches = [ulysses.shard(b) for b in step_batches(rank, sp)]
    dp = 2 // sp
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": len(batches),
              "train_batch_size": 2 * len(batches) * dp, "gradient_clipping": 0.0, "zero_optimization": {"stage": stage},
              "zero_allow_untested_optimizer": True, **({"sequence_parallel_size": sp} if sp > 1 else {})}
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(trainable, lr=1.0), config=config,
                                      mpu=ulysses.mpu, dist_init_required=False)
    engine.train()  # as the worker's loop does (gradient checkpointing runs in training mode only)

    def trained() -> dict:  # whole, also where ZeRO-3 partitions them (a no-op for other stages' parameters)
        named = [(k, p) for k, p in engine.module.named_parameters() if p.requires_grad]
        with deepspeed.zero.GatheredParameters([p for _, p in named]):
            return {k: p.detach().clone() for k, p in named}

    before = trained()
    loss, _ = optimizer_step(engine, batches, torch.device("cpu"))
    dist.all_reduce(loss)  # each rank's share times dp: the ranks sum to dp × the step's token mean
    after = trained()
    if rank == 0:
        results["loss"] = loss.item() / dp
        results["exchanges"] = len(exchanges)
        results["widths"] = [b.inputs["input_ids"].shape[1] for b in batches]
        results["applied"] = {k: before[k] - after[k] for k in before}
    ulysses.close()


def run_two_ranks(sp: int, stage: int, extra: tuple[str, ...] = ()) -> dict:
    return on_two_ranks(sp_worker, sp, stage, extra)


@pytest.mark.parametrize("stage", [pytest.param(0, marks=pytest.mark.slow), 2, 3])
def test_sequence_parallel_step_matches_data_parallel_step(stage):
    plain, split = run_two_ranks(1, stage), run_two_ranks(2, stage)
    assert plain["exchanges"] == 0
    assert split["exchanges"] == 4 * len(split["widths"]) * 4  # q, k, v and the output, per layer, per micro-batch
    assert split["widths"] == [5, 7, 5, 7]  # half of each micro-batch's (even) width
    print(f"loss plain {plain['loss']:.8f}, sequence parallel {split['loss']:.8f}; largest update difference "
          f"{max((split['applied'][k] - u).abs().max().item() for k, u in plain['applied'].items()):.2e}")
    assert split["loss"] == pytest.approx(plain["loss"], rel=1e-5)
    assert plain["applied"].keys() == split["applied"].keys() and plain["applied"]
    for key, update in plain["applied"].items():
        assert update.abs().max() > 0, key
        torch.testing.assert_close(split["applied"][key], update, rtol=1e-4, atol=1e-6, msg=key)


LONG_ROWS = ("model.gradient_checkpointing=true", "model.offload_checkpoints=true", "model.tiled_mlp=2")


@pytest.mark.slow
def test_long_row_settings_under_sequence_parallelism_match_data_parallel_step():
    """Checkpoint offload and the tiled MLP on each rank's slice of the row, with the sequence-parallel
    attention recomputed in the backward pass: the loss and update of the plain data-parallel step."""
    plain, split = run_two_ranks(1, 2), run_two_ranks(2, 2, LONG_ROWS)
    # The all-to-alls of every layer's forward, then again of its recomputation.
    assert split["exchanges"] == 2 * 4 * len(split["widths"]) * 4
    assert split["loss"] == pytest.approx(plain["loss"], rel=1e-5)
    assert plain["applied"].keys() == split["applied"].keys() and plain["applied"]
    for key, update in plain["applied"].items():
        torch.testing.assert_close(split["applied"][key], update, rtol=1e-4, atol=1e-6, msg=key)


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.parametrize("stage", [2, 3])
def test_a_sequence_parallel_job_extended_from_its_checkpoint_ends_as_one_run_straight_through(ray_cluster, tmp_path, tiny_model_path,
                                                                                             stage):
    """The whole job (Ray workers, DeepSpeed, MLflow) with each row split over two workers: three steps,
    then the finished run extended to six from its checkpoint, ends with the adapter of six steps run at
    once (a constant learning rate, so the longer schedule changes nothing before step 3). Under ZeRO-3
    each rank's partition files carry its sequence-parallel rank as their model-parallel rank."""
    from mlflow import MlflowClient
    from safetensors.torch import load_file

    from zerolab.config import load_config
    from zerolab.run import run_sft

    common = {"scaling.num_workers": 2, "scaling.sequence_parallel_size": 2, "data.packing": "false", "train.max_steps": 6,
              "deepspeed.stage": stage,
              "train.lr_scheduler": "constant", "train.warmup_ratio": 0, "train.checkpoint_every_n_steps": 3, "run.name": "sp"}
    whole = run_sft(load_config(None, tiny_overrides(tmp_path / "whole", **common)))
    short = load_config(None, tiny_overrides(tmp_path / "parts", **{**common, "train.max_steps": 3}))
    run_sft(short)
    extended = run_sft(short.with_values({"train.max_steps": 6}))

    history = MlflowClient(extended.tracking_uri).get_metric_history(extended.run_id, "train/resumed_from_step")
    assert [m.value for m in history] == [3]
    expected, got = (load_file(f"{r.adapter_path}/adapter_model.safetensors") for r in (whole, extended))
    assert expected.keys() == got.keys() and expected
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-4, atol=1e-6, msg=key)
