"""The GPU tier: every adapter method on ZeRO 0/2/3 as a real zerolab job on 1 and 2 GPUs.

    pytest -m gpu -n 4 --junitxml=gpu.xml; python bench/gpu_report.py gpu.xml --out docs/gpu_tests.md

Each case is a zerolab job through Ray Train (``run_sft`` with ``scaling.use_gpu=true``: NCCL,
bf16, and Liger's kernels and the fused LoRA forward wherever zerolab applies them) on a
random-init Qwen2 of ``GPU_SHAPE`` (conftest) for six steps, recorded in a temp MLflow store.
The matrix: lora, dora, rslora and full on ZeRO 0, 2 and 3; LoRA once more on ZeRO-2 with the
optimizer offloaded and on ZeRO-3 with optimizer and parameters offloaded; AdaLoRA where zerolab
allows it (ZeRO-0, fp32); ZeRO-2 LoRA packed with the varlen attention kernel. Each on one GPU
and on two (skipped with fewer). Long rows' settings (checkpoint offload, the tiled MLP) train as
checkpointing alone does, on one GPU; their checks against the plain path model by model, pinned
host copies included, are in ``test_long_rows.py`` (its ``cuda`` cases). The fused kernels' own checks against the plain path are in
``test_kernels.py`` (its ``cuda`` cases); inside a one-GPU job at the benchmark's setting, zerolab's kernels
train as Hugging Face's modules and peft's own LoRA forward do.

What "gives the training-time logits" is checked against: the training-time model is rebuilt
from the DeepSpeed checkpoint the job wrote beside the adapter, not from the adapter itself.
Under ZeRO 0-2 that is rank 0's module state, the 16-bit weights the training forward ran with;
under ZeRO-3 the fp32 master partitions of every rank consolidated by DeepSpeed's zero_to_fp32
and rounded to the training dtype (the 16-bit parameters are exactly that rounding). The engine
writes that state by its own path (ZeRO-3: from the optimizer's partitions), independent of
zerolab's adapter gathering and saving. Loaded onto the base model with zerolab's adapter code,
it gives the reference logits of a fixed probe batch, in fp32 on the GPU. A fresh Python process
(no zerolab, nothing from training) then loads the saved folder the documented way, peft's
``PeftModel.from_pretrained`` on the base model (full fine-tuning: transformers'
``AutoModelForCausalLM.from_pretrained``), and computes the probe's logits in fp32 and in bf16:
fp32 must match the reference to float rounding (the same weights, bit for bit), bf16 within
bf16's. Logits recorded inside the training step itself would need a hook in the trainer that
only tests use, and would differ from any reload by dropout and by the fused kernels' rounding.
"""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from conftest import tiny_overrides, trained_state
from zerolab import adapters
from zerolab.config import ModelSpec, SFTConfig, load_config
from zerolab.engine import DTYPES
from zerolab.models import load_model

if TYPE_CHECKING:
    from zerolab.run import RunResult

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

pytestmark = [pytest.mark.gpu, pytest.mark.ray, pytest.mark.skipif(GPUS == 0, reason="needs a CUDA GPU")]

STEPS = 6

PROBE = torch.tensor([[3, 17, 250, 99, 5, 61, 400, 12, 870, 44, 1000, 9, 300, 2, 77, 512],
                      [7, 7, 100, 200, 300, 1, 2, 3, 640, 33, 21, 900, 15, 6, 250, 128]])

CASES: dict[str, list[str]] = {
    **{f"{method}-zero{stage}": [f"adapter.method={method}", f"deepspeed.stage={stage}"]
       for method in ("lora", "dora", "rslora") for stage in (0, 2, 3)},
    **{f"full-zero{stage}": ["adapter.method=full", f"deepspeed.stage={stage}", "train.lr=1e-3"] for stage in (0, 2, 3)},
    "lora-zero2-offload": ["deepspeed.stage=2", "deepspeed.offload_optimizer=true"],
    "lora-zero3-offload": ["deepspeed.stage=3", "deepspeed.offload_optimizer=true", "deepspeed.offload_param=true"],
    # zerolab's validation allows AdaLoRA on ZeRO-0 in fp32 only (config.validate).
    "adalora-zero0-fp32": ["adapter.method=adalora", "deepspeed.stage=0", "train.precision=fp32", "adapter.r=4",
                           "adapter.adalora_init_r=8"],
    "lora-zero2-fp8": ["deepspeed.stage=2", "model.fp8=true", "model.fp8_min_features=16", "data.packing=true",
                       "train.micro_batch_size=2"],
    "lora-zero2-packed-varlen": ["deepspeed.stage=2", "data.packing=true", "model.attn_implementation=varlen",
                                 "train.micro_batch_size=2"],
}
"""Overrides of each case on top of ``case_config``'s."""

BF16_LOGITS_TOL = 3e-2
"""Relative (Frobenius) error allowed for bf16 logits against fp32 ones on the same weights (the base
model of ``GPU_SHAPE``: 6e-3 on CPU)."""

RELOAD = r"""
import sys, torch
from transformers import AutoModelForCausalLM
base, saved, kind, probe_file, out_file, device = sys.argv[1:]
probe = torch.load(probe_file).to(device)
out = {}
for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
    if kind == "adapter":
        from peft import PeftModel
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=dtype), saved)
    else:
        model = AutoModelForCausalLM.from_pretrained(saved, dtype=dtype)
    model.to(device).eval()
    with torch.no_grad():
        out[name] = model(input_ids=probe, use_cache=False).logits.float().cpu()
torch.save(out, out_file)
"""
"""What a user runs to load a result (docs/running.md, "Using the result"), in a process of its own."""


def case_config(tmp_path: Path, model_path: str, overrides: list[str], num_workers: int, *, use_gpu: bool = True) -> SFTConfig:
    # A worker group even for one GPU: each case in a fresh process with DeepSpeed's CUDA accelerator.
    # In this process DeepSpeed may run on the CPU tier's (DS_ACCELERATOR=cpu): a ZeRO-3 case trained
    # here failed with a CPU tensor in an NCCL collective.
    values = {"model.name_or_path": model_path, "scaling.use_gpu": str(use_gpu).lower(), "scaling.num_workers": num_workers,
              "scaling.launch": "workers", "data.num_train_rows": 128, "data.num_eval_rows": 16, "train.max_steps": STEPS}
    values.update(o.split("=", 1) for o in overrides)
    if importlib.util.find_spec("sqlalchemy") is None:  # mlflow-skinny (the GPU hosts): a file store
        values.update({"tracking.uri": f"file://{tmp_path / 'mlruns'}", "tracking.register": "false"})
    return load_config(None, tiny_overrides(tmp_path, **values))


def reference_model(cfg: SFTConfig, checkpoint: Path, device: torch.device) -> torch.nn.Module:
    """The base model with the DeepSpeed checkpoint's weights rounded to the training dtype, in fp32."""
    state = {k: v.to(DTYPES[cfg.precision()]).float() for k, v in trained_state(checkpoint, cfg.deepspeed.stage).items()}
    base = load_model(ModelSpec(name_or_path=cfg.model.name_or_path), torch.float32)
    if cfg.adapter.is_peft():
        base_state = base.state_dict()
        for key, value in state.items():  # the frozen weights the state holds are the base model's
            if "lora_" not in key and "ranknum" not in key:
                assert torch.equal(value, base_state[key.replace("base_model.model.", "").replace(".base_layer", "")]), key
        model = adapters.apply_adapter(base, cfg.adapter, total_steps=cfg.train.max_steps)
    else:
        model = base
    result = model.load_state_dict(state, strict=False)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert not result.unexpected_keys and not trained & set(result.missing_keys), (result.unexpected_keys, trained & set(result.missing_keys))
    return model.to(device)


def probe_logits(model: torch.nn.Module, device: torch.device) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=PROBE.to(device), use_cache=False).logits.float().cpu()


def reloaded_logits(cfg: SFTConfig, saved: str, tmp_path: Path, device: torch.device) -> dict[str, torch.Tensor]:
    """The probe's logits from ``saved`` loaded by peft / transformers in a fresh process, fp32 and bf16."""
    torch.save(PROBE, tmp_path / "probe.pt")
    kind = "adapter" if cfg.adapter.is_peft() else "model"
    proc = subprocess.run([sys.executable, "-c", RELOAD, cfg.model.name_or_path, saved, kind, str(tmp_path / "probe.pt"),
                           str(tmp_path / "reloaded.pt"), str(device)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(tmp_path / "reloaded.pt")


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def check_case(tmp_path: Path, model_path: str, overrides: list[str], num_workers: int, *, use_gpu: bool = True) -> RunResult:
    """Train one case and check its record, its checkpoint and its reload (see the module docstring)."""
    from mlflow import MlflowClient

    from zerolab.run import run_sft

    cfg = case_config(tmp_path, model_path, overrides, num_workers, use_gpu=use_gpu)
    result = run_sft(cfg)

    client = MlflowClient(result.tracking_uri)
    run = client.get_run(result.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["derived.world_size"] == str(num_workers)
    assert (int(run.data.params["derived.fp8_layers"]) > 0) == cfg.model.fp8
    assert run.data.params["derived.precision"] == cfg.precision() == ("fp32" if cfg.adapter.method == "adalora" or not use_gpu else "bf16")
    losses = [m.value for m in sorted(client.get_metric_history(result.run_id, "train/loss"), key=lambda m: m.step)]
    assert len(losses) == STEPS // cfg.train.log_every_n_steps and all(map(math.isfinite, losses)), losses
    assert losses[-1] < losses[0], losses
    assert math.isfinite(run.data.metrics["eval/loss"])
    if use_gpu:
        assert result.metrics["mem/gpu_peak_allocated_gib"] > 0, result.metrics

    device = torch.device("cuda" if use_gpu else "cpu")
    reference = probe_logits(reference_model(cfg, Path(result.checkpoint_path), device), device)
    base = probe_logits(load_model(ModelSpec(name_or_path=model_path), torch.float32).to(device), device)
    assert relative_error(reference, base) > 1e-3, "training left the probe's logits as they were"
    reloaded = reloaded_logits(cfg, result.adapter_path, tmp_path, device)
    torch.testing.assert_close(reloaded["fp32"], reference, rtol=1e-4, atol=1e-4)
    assert relative_error(reloaded["bf16"], reference) < BF16_LOGITS_TOL
    return result


def matrix(cases: dict[str, list[str]]) -> list:
    """Each case on one GPU and on two (skipped with fewer)."""
    return [pytest.param(n, overrides, id=f"{n}gpu-{name}",
                         marks=[pytest.mark.skipif(GPUS < n, reason=f"needs {n} GPUs, {GPUS} found")] if n > 1 else [])
            for n in (1, 2) for name, overrides in cases.items()]


@pytest.mark.parametrize(("num_gpus", "overrides"), matrix(CASES))
def test_method_and_zero_stage_on_gpus(gpu_ray, tmp_path, gpu_model_path, num_gpus, overrides):
    check_case(tmp_path, gpu_model_path, overrides, num_gpus)


def test_a_one_gpu_job_without_ray_evaluates_after_training_on_its_gpu(tmp_path, gpu_model_path):
    """One GPU, one worker: the job trains in its own process without starting Ray, and the eval
    section after training generates there too, on the same GPU (it once asked Ray's state API, not
    started, and the run ended FAILED after training)."""
    import json
    import os

    from mlflow import MlflowClient

    from conftest import REPO

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(DS_ACCELERATOR="cuda", MLFLOW_ALLOW_FILE_STORE="true")
    uri = f"file://{tmp_path / 'mlruns'}"
    values = {"model.name_or_path": gpu_model_path, "scaling.use_gpu": "true", "scaling.num_workers": 1, "scaling.launch": "auto",
              "run.name": "one-gpu-eval", "run.max_failures": 0, "data.num_train_rows": 128, "data.num_eval_rows": 16,
              "train.max_steps": STEPS, "eval.enabled": "true", "eval.num_examples": 16, "eval.max_new_tokens": 8,
              "tracking.uri": uri, "tracking.register": "false"}
    cmd = [sys.executable, str(REPO / "jobs" / "sft.py")]
    for item in tiny_overrides(tmp_path, **values):
        cmd += ["--set", item]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert "it trains in this process, without starting Ray" in output and "Started a local Ray instance" not in output
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("tests").experiment_id], "tags.`zerolab.run_name` = 'one-gpu-eval'")
    assert run.info.status == "FINISHED" and run.data.params["derived.launch"] == "driver"
    assert {"eval/tuned/format_ok", "eval/base/format_ok"} <= set(run.data.metrics)
    assert run.data.metrics["eval/tuned/gpu_peak_generate_gib"] > 0
    summary = json.loads(Path(client.download_artifacts(run.info.run_id, "eval/summary.json", str(tmp_path))).read_text())
    assert summary["options"]["device"] == "cuda" and summary["options"]["merge"] is False


LONG_ROWS_BASE = ["deepspeed.stage=2", "model.gradient_checkpointing=true", "adapter.dropout=0", "data.packing=true",
                  "model.attn_implementation=varlen", "train.micro_batch_size=2"]
"""Packed rows through the varlen kernel, Liger's kernels where installed, checkpointing: the long-row setting."""


def test_long_row_settings_train_as_the_plain_path_on_a_gpu(gpu_ray, tmp_path, gpu_model_path):
    """Checkpoint offload (pinned host copies, side-stream copies), the tiled MLP and both, each a
    six-step job on one GPU: the same losses as checkpointing alone, to bf16's rounding, and the
    run's record says what the workers applied."""
    from mlflow import MlflowClient

    from zerolab.run import run_sft

    variants = {"plain": [], "offload": ["model.offload_checkpoints=true"], "tiled": ["model.tiled_mlp=3"],
                "both": ["model.offload_checkpoints=true", "model.tiled_mlp=3"]}
    runs = {}
    for name, overrides in variants.items():
        cfg = case_config(tmp_path / name, gpu_model_path, [*LONG_ROWS_BASE, *overrides], 1)
        result = run_sft(cfg)
        client = MlflowClient(result.tracking_uri)
        run = client.get_run(result.run_id)
        assert run.info.status == "FINISHED", name
        losses = [m.value for m in sorted(client.get_metric_history(result.run_id, "train/loss"), key=lambda m: m.step)]
        runs[name] = (losses, run.data.metrics["eval/loss"], run.data.params)
    plain_losses, plain_eval, params = runs["plain"]
    assert params["derived.offloaded_checkpoint_layers"] == params["derived.tiled_mlps"] == "0"
    for name in ("offload", "tiled", "both"):
        losses, eval_loss, params = runs[name]
        assert losses == pytest.approx(plain_losses, rel=2e-2), name
        assert eval_loss == pytest.approx(plain_eval, rel=2e-2), name
        assert params["derived.offloaded_checkpoint_layers"] == ("3" if name in ("offload", "both") else "0"), name
        assert params["derived.tiled_mlps"] == ("4" if name in ("tiled", "both") else "0"), name


def test_the_lora_nodes_train_as_peft_in_a_one_gpu_job(gpu_ray, tmp_path, gpu_model_path):
    """The benchmark's 7B setting at the tier's shape (ZeRO-2, two packed rows per micro-batch through the
    varlen kernel, no checkpointing, every step logged) with zerolab's kernels (Liger's and the LoRA
    nodes) and with ``model.kernels=none`` (Hugging Face's modules, peft's own LoRA forward): the same
    losses and gradient norms to bf16's rounding. ``test_kernels.py`` holds the nodes to peft's forward
    layer by layer; this holds them there inside the engine on a GPU, the one place where two formulations
    of them that agreed everywhere else parted in loss (docs/benchmark.md, h200-106 to h200-110)."""
    from zerolab.run import run_sft

    base = ["deepspeed.stage=2", "model.gradient_checkpointing=false", "adapter.dropout=0", "adapter.r=16", "adapter.alpha=32",
            "data.packing=true", "model.attn_implementation=varlen", "train.micro_batch_size=2", "train.log_every_n_steps=1"]
    runs = {kernels: run_sft(case_config(tmp_path / kernels, gpu_model_path, [*base, f"model.kernels={kernels}"], 1))
            for kernels in ("auto", "none")}
    for metric in ("train/loss", "train/grad_norm"):
        got, expected = history(runs["auto"], metric), history(runs["none"], metric)
        assert len(got) == STEPS and got == pytest.approx(expected, rel=2e-2), metric


def test_a_memory_snapshot_records_each_ranks_allocator_history(gpu_ray, tmp_path, gpu_model_path):
    """``train.memory_snapshot_dir`` on a ZeRO-3 job: the rank's file holds the history from before
    the model loaded to the end of training, and ``bench/memory_trace.py`` reads it."""
    import pickle

    from conftest import REPO
    from zerolab.run import run_sft

    sys.path.insert(0, str(REPO))
    from bench.memory_trace import peak_breakdown, segment_report

    cfg = case_config(tmp_path, gpu_model_path, ["deepspeed.stage=3", f"train.memory_snapshot_dir={tmp_path / 'snapshots'}"], 1)
    run_sft(cfg)
    snapshot = pickle.loads((tmp_path / "snapshots" / "rank0.pickle").read_bytes())
    device = next(i for i, trace in enumerate(snapshot["device_traces"]) if trace)
    actions = {ev["action"] for ev in snapshot["device_traces"][device]}
    assert {"alloc", "free_completed", "segment_map"} <= actions  # expandable segments map; the model's weights are allocated
    breakdown = peak_breakdown(snapshot, 0, device)
    assert breakdown["peak"] > 0 and any("zerolab" in site for site, _, _ in breakdown["groups"])
    assert "replayed: reserved peak" in segment_report(snapshot, device)


def history(result: RunResult, metric: str) -> list[float]:
    from mlflow import MlflowClient

    client = MlflowClient(result.tracking_uri)
    return [m.value for m in sorted(client.get_metric_history(result.run_id, metric), key=lambda m: m.step)]


@pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("stage", [2, 3])
def test_sequence_parallel_over_two_gpus_trains_as_one_gpu(gpu_ray, tmp_path, gpu_model_path, stage):
    """Each packed row split over two GPUs (``scaling.sequence_parallel_size=2``: NCCL all-to-alls
    around the varlen kernel, which attends over the whole row with half the heads), under ZeRO-2
    and ZeRO-3 with checkpointing: the same losses and gradient norms as the same rows on one GPU,
    to bf16's rounding (under Adam and clipping the losses alone would not show gradients off by a
    constant factor), and every check of a tier case (record, checkpoint, the adapter reloaded in a
    fresh process)."""
    from zerolab.run import run_sft

    overrides = [*LONG_ROWS_BASE, f"deepspeed.stage={stage}"]
    (tmp_path / "split").mkdir()
    one = run_sft(case_config(tmp_path / "one", gpu_model_path, overrides, 1))
    split = check_case(tmp_path / "split", gpu_model_path, [*overrides, "scaling.sequence_parallel_size=2"], 2)
    for metric in ("train/loss", "train/grad_norm"):
        assert history(split, metric) == pytest.approx(history(one, metric), rel=2e-2), metric


@pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs")
def test_sequence_parallel_job_extended_from_its_checkpoint_on_two_gpus(gpu_ray, tmp_path, gpu_model_path):
    """Each row split over two GPUs under ZeRO-3 (DeepSpeed names the checkpoint's files by the
    sequence-parallel rank, and each rank reads its own back): three steps, then the finished run
    extended to six from its checkpoint, ends with the adapter of six steps run at once (a constant
    learning rate), to bf16's rounding. The slow CPU tier checks the same with gloo, ZeRO-2 and ZeRO-3."""
    from safetensors.torch import load_file

    from zerolab.run import run_sft

    overrides = [*LONG_ROWS_BASE, "deepspeed.stage=3", "scaling.sequence_parallel_size=2", "train.lr_scheduler=constant",
                 "train.warmup_ratio=0", "train.checkpoint_every_n_steps=3", "train.max_steps=6", "run.name=sp"]
    whole = run_sft(case_config(tmp_path / "whole", gpu_model_path, overrides, 2))
    short = case_config(tmp_path / "parts", gpu_model_path, [*overrides, "train.max_steps=3"], 2)
    run_sft(short)
    extended = run_sft(short.with_values({"train.max_steps": 6}))

    assert history(extended, "train/resumed_from_step") == [3]
    expected, got = (load_file(f"{r.adapter_path}/adapter_model.safetensors") for r in (whole, extended))
    assert expected.keys() == got.keys() and expected
    for key in expected:
        assert torch.count_nonzero(got[key]) > 0, key
        assert (got[key].float() - expected[key].float()).norm() <= 1e-2 * expected[key].float().norm(), key
