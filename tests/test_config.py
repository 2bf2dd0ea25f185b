"""Config loading and validation: every problem reported at once, with key and fix."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from zerolab.config import ConfigError, SFTConfig, load_config
from zerolab.config_reference import reference_markdown, reference_rows

REPO = Path(__file__).resolve().parents[1]


def problems(overrides: list[str]) -> list[str]:
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    return err.value.problems


def test_embedded_default_is_valid_and_round_trips():
    cfg = load_config(None, [])
    assert cfg.model.name_or_path == "builtin:tiny-qwen2"
    assert cfg.deepspeed.stage == 2 and cfg.scaling.num_workers == 2 and not cfg.scaling.use_gpu
    assert SFTConfig.from_dict(cfg.to_dict()) == cfg


def test_overrides_are_typed_from_yaml():
    cfg = load_config(None, ["adapter.r=16", "deepspeed.stage=3", "adapter.target_modules=[q_proj,v_proj]", "train.lr=3e-4"])
    assert cfg.adapter.r == 16 and cfg.deepspeed.stage == 3
    assert cfg.adapter.target_modules == ("q_proj", "v_proj")
    assert cfg.train.lr == pytest.approx(3e-4)  # YAML 1.1 reads 3e-4 as a string


def test_every_problem_is_reported_together_with_key_and_fix():
    found = problems([
        "adapter.rank=4",            # unknown key
        "adapter.method=qlora",      # bad enum
        "train.micro_batch_size=0",  # bad number
        "train.lr=fast",             # wrong type
        "deepspeed.stage=0",
        "deepspeed.offload_optimizer=true",  # stage 0 cannot offload
        "deepspeed.offload_param=true",      # needs stage 3
    ])
    text = "\n".join(found)
    assert len(found) >= 5, text
    assert "adapter.rank: unknown key; did you mean 'adapter.r'?" in text
    assert "adapter.method: 'qlora' is not one of 'full', 'lora', 'dora', 'rslora', 'adalora'" in text
    assert "train.lr: 'fast' is not a finite number" in text


def test_typed_replacement_is_the_config_the_same_overrides_load_and_lists_every_problem():
    base = load_config(None, ["train.lr=3e-4"])
    values = {"adapter.r": 32, "deepspeed.stage": 3, "adapter.target_modules": ["q_proj", "v_proj"], "run.name": "x"}
    assert base.with_values(values) == load_config(None, ["train.lr=3e-4", "adapter.r=32", "deepspeed.stage=3",
                                                          "adapter.target_modules=[q_proj,v_proj]", "run.name=x"])
    with pytest.raises(ConfigError) as err:
        base.with_values({"adapter.rank": 4, "trian.lr": 1.0, "train.lr": "fast", "deepspeed.stage": 0, "deepspeed.offload_optimizer": True})
    text = "\n".join(err.value.problems)
    assert len(err.value.problems) == 4, text
    assert "adapter.rank: unknown key; did you mean 'adapter.r'?" in text and "trian.lr: not a section.key" in text
    assert "train.lr: 'fast' is not a finite number" in text and "deepspeed.offload_optimizer: ZeRO stage 0" in text


def test_cross_field_problems_come_together():
    found = problems(["train.micro_batch_size=0", "deepspeed.stage=0", "deepspeed.offload_optimizer=true", "deepspeed.offload_param=true"])
    keys = {p.split(":")[0] for p in found}
    assert {"train.micro_batch_size", "deepspeed.offload_optimizer", "deepspeed.offload_param"} <= keys


def test_adalora_rejects_partitioned_stages():
    found = problems(["adapter.method=adalora", "deepspeed.stage=2"])
    assert any(p.startswith("adapter.method: adalora with deepspeed.stage=2") for p in found)
    load_config(None, ["adapter.method=adalora", "deepspeed.stage=0"])


def test_training_in_the_driver_needs_one_worker_and_no_retries():
    found = problems(["scaling.launch=driver", "scaling.num_workers=2", "run.max_failures=1"])
    assert sum(p.startswith("scaling.launch: driver") for p in found) == 2
    assert any("scaling.num_workers=2" in p for p in found) and any("run.max_failures=1" in p for p in found)
    load_config(None, ["scaling.launch=driver", "scaling.num_workers=1"])
    load_config(None, ["scaling.launch=auto", "scaling.num_workers=2", "run.max_failures=1"])  # auto picks the worker group


def test_fp8_needs_frozen_unpartitioned_bf16_weights_on_a_gpu():
    found = problems(["model.fp8=true", "adapter.method=full", "deepspeed.stage=3", "model.compile=true", "scaling.use_gpu=true",
                      "train.precision=fp16"])
    assert sum(p.startswith("model.fp8: ") for p in found) == 4, found
    assert {w for w in ("adapter.method=full", "ZeRO-3", "train.precision=bf16", "model.compile") if any(w in p for p in found)} == {
        "adapter.method=full", "ZeRO-3", "train.precision=bf16", "model.compile"}
    assert any(p.startswith("model.fp8: needs a GPU") for p in problems(["model.fp8=true"]))
    load_config(None, ["model.fp8=true", "scaling.use_gpu=true", "deepspeed.stage=2", "adapter.method=dora"])


def test_a_memory_snapshot_records_the_cuda_allocator_so_it_needs_a_gpu():
    assert problems(["train.memory_snapshot_dir=/tmp/snapshots"]) == [
        "train.memory_snapshot_dir: records the CUDA allocator; set scaling.use_gpu=true or leave it empty"]
    load_config(None, ["train.memory_snapshot_dir=/tmp/snapshots", "scaling.use_gpu=true"])
    assert problems(["train.memory_snapshot_dir=s3://bucket/snapshots", "scaling.use_gpu=true"]) == [
        "train.memory_snapshot_dir: 's3://bucket/snapshots' is a URI; each worker writes its file to a local folder of its node: "
        "give a path"]


def test_missing_paths_and_custom_task():
    found = problems(["data.task=custom", "data.eval_path=/nonexistent/eval.jsonl"])
    assert any(p.startswith("data.train_path: required when data.task=custom") for p in found)
    assert any(p.startswith("data.eval_path: no such file") for p in found)


def test_workers_rebuild_the_config_without_touching_the_file_system():
    """A data file that exists only on the driver: the driver checks it, the workers' copy of the
    config (``from_dict``) does not look for it."""
    from zerolab.config import SFTConfig

    assert problems(["data.train_path=/nonexistent/train.jsonl"]) == [
        "data.train_path: no such file or folder '/nonexistent/train.jsonl'; check the path (relative paths start at the working directory)"]
    rebuilt = SFTConfig.from_dict({"data": {"train_path": "/nonexistent/train.jsonl"}})
    assert rebuilt.data.train_path == "/nonexistent/train.jsonl"


def test_nan_and_inf_are_refused_at_load():
    found = problems(["train.lr=.nan", "train.max_grad_norm=.inf", "train.warmup_ratio=-.inf", "run.max_wall_time_s=nan"])
    assert {p.split(":")[0] for p in found} == {"train.lr", "train.max_grad_norm", "train.warmup_ratio", "run.max_wall_time_s"}, found
    assert all("is not a finite number" in p for p in found), found


def test_cpu_only_settings():
    found = problems(["train.precision=fp16", "model.attn_implementation=flash_attention_2"])
    assert {p.split(":")[0] for p in found} == {"train.precision", "model.attn_implementation"}


def test_max_seq_length_is_a_number_of_tokens_or_auto():
    cfg = load_config(None, ["data.max_seq_length=auto"])
    assert cfg.data.max_seq_length == "auto" and SFTConfig.from_dict(cfg.to_dict()) == cfg
    assert load_config(None, ["data.max_seq_length=512"]).data.max_seq_length == 512
    assert problems(["data.max_seq_length=long"]) == ["data.max_seq_length: 'long' is not an integer or 'auto'; use an integer or 'auto'"]
    assert problems(["data.max_seq_length=4"]) == [
        "data.max_seq_length: 4 is too short for a chat-formatted sample; use at least 8, or auto"]
    assert problems(["data.max_seq_length=1.5"])[0].startswith("data.max_seq_length: 1.5 is not an integer or 'auto'")


def test_unknown_section_and_bad_override_syntax():
    assert problems(["trainer.lr=1"])[0].startswith("trainer: unknown key")
    with pytest.raises(ConfigError, match="expected section.key=value"):
        load_config(None, ["lr"])


def test_every_shipped_job_config_loads():
    files = sorted((REPO / "jobs" / "configs").rglob("*.yaml"))
    assert files, "no job configs shipped"
    import yaml

    from zerolab.sweep import load_sweep

    for f in files:
        first = f.read_text().splitlines()[0]
        assert first.startswith("# ") and f"jobs/configs/{f.name}" in first, f"{f.name} must open with the command that runs it"
        if "space" in yaml.safe_load(f.read_text()):  # a sweep file for jobs/tune.py --space
            assert load_sweep(f, set(load_config(None).flat())).space
            continue
        assert load_config(f).data.task


def test_reference_documents_every_field_and_the_docs_match():
    rows = reference_rows()
    assert len(rows) == len(SFTConfig().flat())
    assert all(doc for _, _, doc in rows), [key for key, _, doc in rows if not doc]
    assert reference_markdown() in (REPO / "docs" / "configuration.md").read_text(encoding="utf-8"), (
        "docs/configuration.md's config reference is stale; regenerate it with zerolab.config_reference.reference_markdown()")


def test_bad_config_exits_2_with_message_and_no_traceback():
    proc = subprocess.run(
        [sys.executable, str(REPO / "jobs" / "sft.py"), "--set", "deepspeed.stage=5", "--set", "adapter.r=-1"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "deepspeed.stage: 5 is not one of 0, 1, 2, 3" in proc.stderr
    assert "adapter.r: -1 is not allowed" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
