"""The benchmark harness behind ``jobs/benchmark.py``: runs, measurement, the results table.

Each run is a fresh process started from here, timed from its launch:

- ``zerolab``: ``bench/zerolab_run.py`` → ``zerolab.run.run_sft`` (Ray Train + DeepSpeed), the
  figures from the run's own last logging window (``perf/*``, ``mem/*``);
- ``zerolab-torchrun``: zerolab's training step and engine under torchrun, without Ray;
- ``seeds``: the seeds' Hugging Face Trainer recipe under torchrun, samples padded to the maximum;
- ``plain``: a hand-written PyTorch + peft loop under torchrun, padded per micro-batch;
- ``trl``: TRL's ``SFTTrainer`` as its documentation advises for speed (``bench/trl_sft.py``:
  padding-free best-fit-decreasing packing, Liger, its fused LM head, fused AdamW, the best attention
  the host has), without DeepSpeed; plain ``python`` on one GPU, torchrun on several.

Every run trains the same random-init model (a Qwen2.5 shape) with LoRA r=16 on all linear layers
(alpha 32, no dropout), bf16, on the same data mix (``bench/workload.py``) for the same number of
optimizer steps; throughput is non-padding tokens over the last ``window`` steps. Every system
reports the rows it trains on (``train_rows``, ``train_tokens``, ``train_target_tokens``: zerolab
from its data report, the others from the rows they were given, TRL from its packed dataset), the
same for all. zerolab runs also give a row of the memory calibration (estimate next to the measured peaks).
"""

from __future__ import annotations

import csv
import dataclasses
import importlib.metadata
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SYSTEMS = ("zerolab", "zerolab-torchrun", "seeds", "plain", "trl")
SHAPE_IDS = {"qwen2.5-0.5b": "Qwen/Qwen2.5-0.5B", "qwen2.5-7b": "Qwen/Qwen2.5-7B", "qwen2.5-14b": "Qwen/Qwen2.5-14B"}

COLUMNS = ["run", "system", "shape", "gpus", "stage", "offload", "variant", "micro_batch", "checkpointing", "attn", "quantization", "steps",
           "tokens_per_s_per_gpu", "step_s", "mfu", "mfu_attn", "row_tokens", "tokens_per_step", "gpu_peak_allocated_gib",
           "gpu_peak_reserved_gib", "host_rss_peak_gib", "node_used_peak_gib", "time_to_first_step_s", "wall_s", "train_rows", "train_tokens",
           "train_target_tokens", "train_loss", "status", "device", "command"]
"""``attn``: the attention the run asked for; a ``trl`` run's is the one it loaded (``--attn auto`` picks it).
``train_loss``: a zerolab run's last logged ``train/loss``, the mean over its last logging window: the
same for two trees only when they compute the same loss (empty for the other systems, which log theirs
differently)."""


@dataclass(frozen=True)
class Run:
    system: str
    shape: str
    gpus: int = 1
    stage: int = 0
    micro_batch: int = 1
    """Rows per micro-batch; 0: the largest the memory estimate allows on this machine (:func:`estimated_micro_batch`)."""
    steps: int = 20
    window: int = 10
    checkpointing: bool = False
    attn: str = "varlen"
    """zerolab: ``model.attn_implementation``; trl: ``auto`` or an implementation (``bench/trl_sft.py``)."""
    kernels: str = "auto"
    offload: str = "none"
    variant: str = ""
    """Short label of what differs from the system's default settings."""
    ds_settings: str = "tuned"
    """ZeRO-3 bucket settings: ``tuned`` (zerolab's), ``hf-defaults`` (Hugging Face's "auto" values) or
    ``live-<elements>`` (zerolab's with ``stage3_max_live_parameters`` at that many elements, or
    ``live-uncapped``)."""
    timeout_s: int = 420
    overrides: tuple[str, ...] = ()
    """Job config overrides of this run (``KEY=VALUE``), after the ones above."""
    profile_steps: int = 0
    """zerolab-torchrun and trl: profile this many steps after the measured ones (printed to runs.log)."""
    traces: tuple[str, ...] = ()
    """zerolab-torchrun: ``memory`` (the allocator's history at the steps' peak) and ``rss`` (the process's
    resident memory by phase), printed to runs.log. zerolab: ``memory`` (``train.memory_snapshot_dir``,
    written up by :func:`write_memory_traces`)."""
    max_seq_length: int = 4096
    row_tokens: int = 0
    """0: the benchmark's data mix (rows of 20 to ``max_seq_length`` tokens, packed). Else long rows
    (``bench/workload.long_rows``) of just under this many tokens, one per micro-batch row, with
    ``data.max_seq_length`` this and YaRN RoPE scaling past the shapes' 32K positions; -1: the
    longest row the memory estimate fits on this machine (:func:`estimated_row_tokens`)."""
    first_launch: bool = False
    """Run as a machine's first launch of the system: with a tokenized-data cache (``ZEROLAB_CACHE``) and
    a Triton kernel cache (``TRITON_CACHE_DIR``) of its own, both empty, so it tokenizes its rows and
    compiles its kernels as a first launch does, whatever ran before it (the kernel checks included)."""
    long_rows: int = 2
    """Rows of the long-row file: the longest runs take two steps; shorter ones go round them again, or
    take as many rows as steps where the curves are compared (a random model memorises two rows within
    a dozen steps, and its loss then stops telling two runs apart)."""

    def quantization(self) -> str:
        """The base's ``model.quantization`` among the overrides (``none`` without it)."""
        return next((o.split("=", 1)[1] for o in reversed(self.overrides) if o.startswith("model.quantization=")), "none")

    @property
    def name(self) -> str:
        parts = [self.system, self.shape, f"{self.gpus}gpu", f"z{self.stage}"]
        if self.offload != "none":
            parts.append(f"off{self.offload}")
        if self.variant:
            parts.append(self.variant)
        return "-".join(parts)


def _suite_ray_path(shape: str, **settings: Any) -> list[Run]:
    return [r for rep in (1, 2, 3) for r in (
        Run("zerolab", shape, variant=f"auto-{rep}", **settings),
        Run("zerolab", shape, variant=f"workers-{rep}", overrides=("scaling.launch=workers",), **settings),
        Run("zerolab-torchrun", shape, variant=f"rep{rep}", **settings))]


def _suite_single(shape: str, zero_mb: int, base_mb: int, plain_ckpt: bool, steps: int, timeout_s: int) -> list[Run]:
    w, t = steps // 2, timeout_s
    return [
        Run("zerolab", shape, micro_batch=zero_mb, steps=steps, window=w, timeout_s=t),
        Run("zerolab-torchrun", shape, micro_batch=zero_mb, steps=steps, window=w, timeout_s=t, profile_steps=3),
        Run("seeds", shape, micro_batch=base_mb, steps=steps, window=w, checkpointing=True, attn="sdpa", kernels="none", timeout_s=t),
        Run("plain", shape, micro_batch=base_mb, steps=steps, window=w, checkpointing=plain_ckpt, attn="sdpa", kernels="none",
            timeout_s=t),
        # What each optimisation brings: without Liger's kernels, then without the varlen kernel too.
        Run("zerolab", shape, micro_batch=zero_mb, steps=steps, window=w, kernels="none", variant="nokernels", timeout_s=t),
        Run("zerolab", shape, micro_batch=zero_mb, steps=steps, window=w, attn="sdpa", kernels="none", variant="sdpa-nokernels",
            timeout_s=t),
    ]


def _suite_scaling(shape: str, mb: int, steps: int, gpus: int) -> list[Run]:
    w = steps // 2
    runs = [Run("zerolab", shape, gpus=1, stage=0, micro_batch=mb, steps=steps, window=w, timeout_s=240)]
    for stage in (0, 2, 3):
        runs.append(Run("zerolab", shape, gpus=gpus, stage=stage, micro_batch=mb, steps=steps, window=w, timeout_s=240))
    runs.append(Run("zerolab", shape, gpus=gpus, stage=3, micro_batch=mb, steps=steps, window=w, ds_settings="hf-defaults",
                    variant="hf-defaults", timeout_s=240))
    return runs


def _suite_zero3(shape: str, gpus: int) -> list[Run]:
    """ZeRO-3 against ZeRO-2 with more tokens per micro-batch (each gather of the frozen weights
    serves 2× or 4× the tokens), and a profile of ZeRO-3's step under torchrun."""
    return [Run("zerolab", shape, gpus=gpus, stage=stage, micro_batch=mb, steps=8, window=4, variant=f"mb{mb}", timeout_s=240)
            for mb in (4, 2) for stage in (2, 3)] + [
        Run("zerolab-torchrun", shape, gpus=gpus, stage=3, micro_batch=1, steps=6, window=3, profile_steps=2, timeout_s=240)]


def _suite_trl(shape: str, *, micro_batch: int, steps: int, timeout_s: int) -> list[Run]:
    """zerolab at its recommended setting (ZeRO-2, packed rows, ``varlen``, Liger) and TRL set up for
    speed with the best attention the host has, alternating, three runs each (variants ``rep1``..``rep3``),
    at the same tokens per step: ``micro_batch`` packed rows of 4,096 tokens. TRL runs without
    DeepSpeed (``z0`` in its name). The first pair are first launches (:attr:`Run.first_launch`)."""
    w = steps // 2
    return [r for rep in (1, 2, 3) for r in (
        Run("zerolab", shape, stage=2, micro_batch=micro_batch, steps=steps, window=w, variant=f"rep{rep}", timeout_s=timeout_s,
            first_launch=rep == 1),
        Run("trl", shape, micro_batch=micro_batch, steps=steps, window=w, attn="auto", variant=f"rep{rep}", timeout_s=timeout_s,
            first_launch=rep == 1))]


def _fp8_against_bf16(shape: str, suffix: str = "", **settings: Any) -> list[Run]:
    """bf16 and FP8 base products (``model.fp8``) alternating, three runs each (variants ``bf16<suffix>-1``,
    ``fp8<suffix>-1``, ...)."""
    return [Run("zerolab", shape, variant=f"{label}{suffix}-{rep}", overrides=(f"model.fp8={v}",), **settings)
            for rep in (1, 2, 3) for label, v in (("bf16", "false"), ("fp8", "true"))]


def _suite_long_rows_7b() -> list[Run]:
    """7B LoRA r16 on one GPU, ZeRO-2, one packed long row per micro-batch, with the settings the memory
    estimate fits for each length on an 80 GiB GPU: 4K rows as today's benchmark trains them; 32K with the
    tiled MLP (no checkpointing: the fastest that fits) and with checkpointing; 128K with checkpointing,
    alone and with the tiled MLP; 256K with checkpoint offload and the tiled MLP too; then the longest row
    the estimate fits here with those (299,008 tokens on one H100 with 128 GiB of host memory, where the
    checkpoints' pinned copies stop it; 429,056 with 512 GiB). A few steps each, the last window measured
    (one step at 256K and past: the memory peak, the step's time with its first-step costs). A step's
    attention grows with the square of the row: about 10 s at 32K, a minute at 128K, four at 256K (7B on one
    H100, FlashAttention-2 at ~300 TFLOP/s), a quarter of an hour at 500K."""
    long = ("model.offload_checkpoints=true", "model.tiled_mlp=auto")
    return [
        Run("zerolab", "qwen2.5-7b", stage=2, row_tokens=4096, steps=12, window=6, variant="rows4k", timeout_s=300),
        Run("zerolab", "qwen2.5-7b", stage=2, row_tokens=32768, steps=6, window=3, variant="rows32k-tiled", timeout_s=420,
            overrides=("model.tiled_mlp=auto",)),
        Run("zerolab", "qwen2.5-7b", stage=2, row_tokens=32768, steps=6, window=3, checkpointing=True, variant="rows32k-ckpt",
            timeout_s=420),
        Run("zerolab", "qwen2.5-7b", stage=2, row_tokens=131072, steps=2, window=1, checkpointing=True, variant="rows128k-ckpt",
            timeout_s=540),
        Run("zerolab", "qwen2.5-7b", stage=2, row_tokens=131072, steps=3, window=2, checkpointing=True, variant="rows128k-ckpt-tiled",
            timeout_s=540, overrides=("model.tiled_mlp=auto",)),
        Run("zerolab", "qwen2.5-7b", stage=2, row_tokens=262144, steps=1, window=1, checkpointing=True,
            variant="rows256k-ckpt-offload-tiled", timeout_s=900, overrides=long),
        Run("zerolab", "qwen2.5-7b", stage=2, row_tokens=-1, steps=1, window=1, checkpointing=True,
            variant="rowsmax-ckpt-offload-tiled", timeout_s=3600, overrides=long),
    ]


def _suite_sequence_parallel_7b(gpus: int, sp: int) -> list[Run]:
    """7B LoRA r16, one long row per micro-batch, gradient checkpointing, on ``gpus`` GPUs with each row
    split over ``sp`` of them by Ulysses sequence parallelism (``scaling.sequence_parallel_size``,
    docs/sequence_parallel.md; the 7B shape's 28 attention and 4 key/value heads allow 2 and 4) against one
    GPU: first 16K rows for 20 steps, a new row each step, the loss and gradient norm logged every second
    step (one GPU, then sequence-parallel, each at ZeRO-2 and ZeRO-3: the same rows, the same steps, so each
    stage's curves must agree; ``bench/loss_curves.py`` compares them: each split run against the one-GPU
    run of its own stage, which tells the split's effect from the stage's), then 128K rows (a minute's step
    on one GPU) sequence-parallel at ZeRO-2 and ZeRO-3, and last the longest row the memory estimate fits
    here sequence-parallel, with checkpointing alone at ZeRO-2 and ZeRO-3 (about 290K tokens at ZeRO-2 on
    two H100s, a few minutes' step) and with checkpoint offload and the tiled MLP (a long run: about 600K
    tokens on two H100s of a host with 256 GiB, where the pinned host copies stop it)."""
    split = (f"scaling.sequence_parallel_size={sp}",)
    long = (*split, "model.offload_checkpoints=true", "model.tiled_mlp=auto")
    return [
        *[Run("zerolab", "qwen2.5-7b", stage=stage, row_tokens=16384, long_rows=20, steps=20, window=2, checkpointing=True,
              variant="rows16k-ckpt", timeout_s=300) for stage in (2, 3)],
        *[Run("zerolab", "qwen2.5-7b", gpus=gpus, stage=stage, row_tokens=16384, long_rows=20, steps=20, window=2, checkpointing=True,
              variant=f"sp{sp}-rows16k-ckpt", timeout_s=300, overrides=split) for stage in (2, 3)],
        *[Run("zerolab", "qwen2.5-7b", gpus=gpus, stage=stage, row_tokens=131072, steps=2, window=1, checkpointing=True,
              variant=f"sp{sp}-rows128k-ckpt", timeout_s=420, overrides=split) for stage in (2, 3)],
        Run("zerolab", "qwen2.5-7b", gpus=gpus, stage=2, row_tokens=262144, steps=2, window=1, checkpointing=True,
            variant=f"sp{sp}-rows256k-ckpt", timeout_s=600, overrides=split),
        # ZeRO-3 prefetches from its second step on (DeepSpeed records the modules' order in the first),
        # and its memory peak with it: two steps there.
        *[Run("zerolab", "qwen2.5-7b", gpus=gpus, stage=stage, row_tokens=-1, steps=2 if stage == 3 else 1, window=1, checkpointing=True,
              variant=f"sp{sp}-rowsmax-ckpt", timeout_s=900, overrides=split) for stage in (2, 3)],
        Run("zerolab", "qwen2.5-7b", gpus=gpus, stage=2, row_tokens=-1, steps=1, window=1, checkpointing=True,
            variant=f"sp{sp}-rowsmax-ckpt-offload-tiled", timeout_s=3600, overrides=long),
    ]


SUITES: dict[str, list[Run]] = {
    # One GPU: zerolab against the baselines (0.5B and 7B shapes, packed 4k-token sequences).
    "single-0.5b": _suite_single("qwen2.5-0.5b", zero_mb=4, base_mb=4, plain_ckpt=False, steps=20, timeout_s=180),
    "single-7b": _suite_single("qwen2.5-7b", zero_mb=1, base_mb=4, plain_ckpt=True, steps=12, timeout_s=240),
    # Both shapes on one GPU, most telling runs first (for a lease that may end before the rest).
    "single": [],
    # Scaling over the GPUs of one host, ZeRO 0/2/3 (and ZeRO-3 with Hugging Face's default buckets).
    "scaling-7b": _suite_scaling("qwen2.5-7b", mb=1, steps=10, gpus=2),
    "scaling-0.5b": _suite_scaling("qwen2.5-0.5b", mb=4, steps=20, gpus=2)[:-1],
    "scaling-7b-4gpu": _suite_scaling("qwen2.5-7b", mb=1, steps=10, gpus=4)[:-1],
    "zero3-7b": _suite_zero3("qwen2.5-7b", gpus=2),
    # 7B on one GPU: ZeRO-2's flat gradient buffers against ZeRO-0's per-tensor optimizer wrapper,
    # with 1 and 2 packed 4k rows per micro-batch, and a profile of the ZeRO-2 step under torchrun.
    "single-7b-stages": [Run("zerolab", "qwen2.5-7b", stage=0, steps=12, window=6, timeout_s=240),
                         Run("zerolab", "qwen2.5-7b", stage=2, steps=12, window=6, timeout_s=240),
                         Run("zerolab", "qwen2.5-7b", stage=2, micro_batch=2, steps=12, window=6, variant="mb2", timeout_s=240),
                         Run("zerolab-torchrun", "qwen2.5-7b", stage=2, steps=8, window=4, profile_steps=3, timeout_s=240)],
    # ZeRO-3 over two GPUs with DeepSpeed's live-parameter count capped at zerolab's derived value (the head,
    # the embeddings and three layers: 1.79e9 elements), at 2.5e9, and uncapped, where the prefetch passes
    # gathered layers for free and holds every layer at the loss (docs/memory.md). ZeRO-2 beside them, at one
    # and four packed 4k rows per micro-batch: what the cap costs or saves (mb1 measured in h200x4-64).
    "zero3-live-cap-7b-2gpu": [Run("zerolab", "qwen2.5-7b", gpus=2, stage=stage, micro_batch=mb, steps=8, window=4, timeout_s=300,
                                   variant=f"mb{mb}-{ds}", ds_settings=ds)
                               for mb in (1, 4) for stage, ds in ((2, "tuned"), (3, "tuned"), (3, "live-uncapped"), (3, "live-2.5e9"))],
    # ZeRO-3's decoder layers as DeepSpeed leaf modules (one gather and one hook per layer) or not.
    "zero3-leaf-7b": [Run("zerolab", "qwen2.5-7b", stage=3, steps=10, window=5, variant="leaf", timeout_s=240),
                      Run("zerolab", "qwen2.5-7b", stage=3, steps=10, window=5, variant="noleaf", timeout_s=240,
                          overrides=("deepspeed.z3_leaf_layers=false",))],
    # The issue's ZeRO-3 target on two GPUs with leaf layers: one packed 4k row per micro-batch, then four.
    "zero3-leaf-7b-2gpu": [Run("zerolab", "qwen2.5-7b", gpus=2, stage=stage, micro_batch=mb, steps=8, window=4, variant=f"mb{mb}", timeout_s=240)
                           for mb in (1, 4) for stage in (2, 3)],
    # The issue's second ZeRO-3 target: ZeRO-2 and ZeRO-3 each at the micro-batch the memory estimate
    # picks for it on this machine (``jobs/estimate.py``'s "most tokens per micro-batch").
    "zero3-est-7b-2gpu": [Run("zerolab", "qwen2.5-7b", gpus=2, stage=stage, micro_batch=0, steps=8, window=4, variant="mbest", timeout_s=300)
                          for stage in (2, 3)],
    "zero3-leaf-0.5b": [Run("zerolab", "qwen2.5-0.5b", stage=stage, micro_batch=4, steps=20, window=10, variant=variant, timeout_s=180,
                            overrides=overrides)
                        for stage, variant, overrides in ((2, "", ()), (3, "leaf", ()), (3, "noleaf", ("deepspeed.z3_leaf_layers=false",)))],
    # 7B on one GPU with 2 packed 4k rows per micro-batch: twice the work per kernel launch.
    "single-7b-mb2": [Run("zerolab", "qwen2.5-7b", micro_batch=2, steps=12, window=6, variant="mb2", timeout_s=240)],
    # Regional compilation (model.compile) on one GPU, ZeRO-0, 1 packed 4k row: eager and compiled
    # layers alternating, twice each, with Liger's kernels and without (Inductor fuses the norms and
    # SwiGLU itself). 16 steps, the last 8 measured: the first steps compile.
    "compile-7b": [Run("zerolab", "qwen2.5-7b", steps=16, window=8, variant=f"{label}-{rep}", kernels=k, timeout_s=360,
                       overrides=(f"model.compile={str(c).lower()}",))
                   for rep in (1, 2) for label, c, k in (("eager", False, "auto"), ("compile", True, "auto"), ("compile-nokernels", True, "none"))],
    # The same on the 0.5B shape (4 packed 4k rows): a quicker check of the compiled path, and the
    # more launch-bound step of the two.
    "compile-0.5b": [Run("zerolab", "qwen2.5-0.5b", micro_batch=4, steps=20, window=10, variant=f"{label}-{rep}", timeout_s=240,
                         overrides=(f"model.compile={str(c).lower()}",))
                     for rep in (1, 2) for label, c in (("eager", False), ("compile", True))],
    # The Ray path's cost on one GPU, medians of three alternating: zerolab as a job runs it (one
    # worker: in the job's process, Ray Train's local mode), zerolab through Ray Train's worker group,
    # and the same loop under bare torchrun.
    "ray-path-0.5b": _suite_ray_path("qwen2.5-0.5b", micro_batch=4, steps=20, window=10, timeout_s=180),
    # The same at the recommended 7B setting: ZeRO-2, two packed 4k rows per micro-batch.
    "ray-path-7b-mb2": _suite_ray_path("qwen2.5-7b", stage=2, micro_batch=2, steps=12, window=6, timeout_s=240),
    # FP8 products of the frozen base weights (model.fp8) against bf16, alternating, medians of three.
    "fp8-7b": _fp8_against_bf16("qwen2.5-7b", steps=12, window=6, timeout_s=240),
    # ZeRO-2 with two packed 4k rows per micro-batch (a step that waits on the GPU rather than the host).
    "fp8-7b-mb2": _fp8_against_bf16("qwen2.5-7b", "-mb2", stage=2, micro_batch=2, steps=12, window=6, timeout_s=240),
    "fp8-0.5b": _fp8_against_bf16("qwen2.5-0.5b", micro_batch=4, steps=20, window=10, timeout_s=180),
    # FP8's accuracy: the same data and seed, 240 steps, the loss every 10 (bench/loss_curves.py compares
    # them); every projection in FP8 (the 0.5B's are narrower than model.fp8_min_features' default).
    "fp8-curve-0.5b": [Run("zerolab", "qwen2.5-0.5b", micro_batch=4, steps=240, window=10, variant=f"{label}-curve", timeout_s=420,
                           overrides=(f"model.fp8={v}", "model.fp8_min_features=16")) for label, v in (("bf16", "false"), ("fp8", "true"))],
    # Where ZeRO-3's step on two GPUs spends its time: the same loop at ZeRO-2 and ZeRO-3 (one packed 4k
    # row per micro-batch), each profiled (kernels, NCCL against compute, host calls, DeepSpeed's Python).
    "zero3-profile-7b-2gpu": [Run("zerolab-torchrun", "qwen2.5-7b", gpus=2, stage=stage, steps=8, window=4, variant="mb1", profile_steps=2,
                                  timeout_s=240) for stage in (2, 3)],
    # ZeRO-2's step on one GPU, one packed 4k row per micro-batch (host-bound: run it from two checkouts
    # side by side to compare the step's code).
    "zero2-step-7b": [Run("zerolab", "qwen2.5-7b", stage=2, steps=12, window=6, variant="mb1", timeout_s=240)],
    # 7B on one GPU, one packed 4k row: ZeRO-0 against ZeRO-2 (its step's checks batched) and ZeRO-2 with
    # the FP8 base products, alternating, twice each.
    "single-7b-z2-fp8": [Run("zerolab", "qwen2.5-7b", stage=stage, steps=12, window=6, variant=f"{label}-{rep}", timeout_s=240,
                             overrides=(f"model.fp8={str(fp8).lower()}",))
                         for rep in (1, 2) for stage, label, fp8 in ((0, "bf16", False), (2, "bf16", False), (2, "fp8", True))],
    # The 7B target's candidates on one GPU: ZeRO-0 (the lease's reference) and ZeRO-2 with 1 and 2 packed
    # 4k rows per micro-batch.
    "single-7b-z2-rows": [Run("zerolab", "qwen2.5-7b", stage=stage, micro_batch=mb, steps=12, window=6, variant=f"mb{mb}", timeout_s=240)
                          for stage, mb in ((0, 1), (2, 1), (2, 2))],
    # ZeRO-2's 7B step on one GPU in bf16 and with FP8 base products, profiled: the GPU's own time per
    # step against the unprofiled step time says whether the step waits for the host or the GPU.
    "zero2-profile-7b": [Run("zerolab-torchrun", "qwen2.5-7b", stage=2, steps=8, window=4, variant=f"{label}-mb1", profile_steps=2,
                             timeout_s=240, overrides=(f"model.fp8={v}",)) for label, v in (("bf16", "false"), ("fp8", "true"))],
    # The same with two packed rows per micro-batch, the step that waits on the GPU: its own time per token.
    "zero2-profile-7b-mb2": [Run("zerolab-torchrun", "qwen2.5-7b", stage=2, micro_batch=2, steps=8, window=4, variant=f"{label}-mb2",
                                 profile_steps=2, timeout_s=240, overrides=(f"model.fp8={v}",))
                             for label, v in (("bf16", "false"), ("fp8", "true"))],
    # zerolab's step and TRL's at the trl-7b suite's setting, profiled in one lease: the GPU's time by kind
    # of kernel, the frozen weights' products apart from the adapters', and where each waits for its host.
    "trl-profile-7b": [Run("zerolab-torchrun", "qwen2.5-7b", stage=2, micro_batch=2, steps=8, window=4, variant="profile-mb2",
                           profile_steps=2, timeout_s=240),
                       Run("trl", "qwen2.5-7b", micro_batch=2, steps=8, window=4, attn="auto", variant="profile-mb2",
                           profile_steps=2, timeout_s=240)],
    # ZeRO-3's step on one GPU (no interconnect: what the hooks and gathers cost by themselves).
    "zero3-profile-7b": [Run("zerolab-torchrun", "qwen2.5-7b", stage=stage, steps=8, window=4, variant="mb1", profile_steps=2,
                             timeout_s=240) for stage in (2, 3)],
    # The memory estimator's open misses on the 0.5B shape (docs/calibration/heldout.md, set D): what
    # holds the GPU memory at full fine-tuning's ZeRO-3 peak, and the process's resident memory by phase
    # where one process reads the whole checkpoint (ZeRO-3 with and without parameter offload, full ZeRO-3).
    "memory-traces-0.5b": [
        Run("zerolab-torchrun", "qwen2.5-0.5b", stage=3, micro_batch=4, steps=4, window=2, variant="full-b4x512", max_seq_length=512,
            traces=("memory", "rss"), timeout_s=180, overrides=("adapter.method=full", "data.packing=false")),
        Run("zerolab-torchrun", "qwen2.5-0.5b", stage=3, micro_batch=16, steps=4, window=2, variant="b16x128", max_seq_length=128,
            traces=("rss",), timeout_s=180, overrides=("data.packing=false",)),
        Run("zerolab-torchrun", "qwen2.5-0.5b", stage=3, offload="all", micro_batch=16, steps=4, window=2, variant="b16x128",
            max_seq_length=128, traces=("rss",), timeout_s=180, overrides=("data.packing=false",))],
    # The ZeRO-3 target with compiled layers: ZeRO-2 and ZeRO-3 (leaf layers) on two GPUs, 1 packed 4k row.
    "compile-zero3-7b-2gpu": [Run("zerolab", "qwen2.5-7b", gpus=2, stage=stage, steps=12, window=6, variant="compile", timeout_s=360,
                                  overrides=("model.compile=true",)) for stage in (2, 3)],
    # Quantized bases (model.quantization), 7B on one GPU: bf16 LoRA at its recommended setting (ZeRO-2,
    # two packed 4k rows) beside nf4 at one row with gradient checkpointing (the memory figure) and at
    # two rows without (the throughput figure), and int8 at one row with checkpointing.
    "qlora-7b": [Run("zerolab", "qwen2.5-7b", stage=2, micro_batch=mb, steps=12, window=6, checkpointing=ckpt, variant=variant,
                     timeout_s=300, overrides=(f"model.quantization={q}",))
                 for variant, q, mb, ckpt in (("bf16-mb2", "none", 2, False), ("nf4-mb1-ckpt", "nf4", 1, True),
                                              ("nf4-mb2", "nf4", 2, False), ("int8-mb1-ckpt", "int8", 1, True))],
    # What gradient checkpointing costs a quantized base: bf16 at one row with it, nf4 at one row without.
    "qlora-7b-ckpt": [Run("zerolab", "qwen2.5-7b", stage=2, steps=12, window=6, checkpointing=ckpt, variant=variant, timeout_s=300,
                          overrides=(f"model.quantization={q}",))
                      for variant, q, ckpt in (("bf16-mb1-ckpt", "none", True), ("nf4-mb1", "nf4", False))],
    # 14B nf4 at one packed 4k row on one GPU (does it fit a 24 GB card?).
    "qlora-14b": [Run("zerolab", "qwen2.5-14b", stage=2, steps=8, window=4, checkpointing=True, variant="nf4-mb1-ckpt", timeout_s=420,
                      overrides=("model.quantization=nf4",))],
    # 14B QLoRA sharded: ZeRO-2 against ZeRO-3 over two GPUs, nf4 and int8, one packed 4k row per GPU.
    "qlora-14b-2gpu": [Run("zerolab", "qwen2.5-14b", gpus=2, stage=stage, steps=8, window=4, checkpointing=True, variant=f"{q}-mb1-ckpt",
                           timeout_s=420, overrides=(f"model.quantization={q}",)) for q in ("nf4", "int8") for stage in (2, 3)],
    # QLoRA's accuracy: bf16 LoRA and nf4 on the same data and seed, 200 steps, the loss every 10
    # (bench/loss_curves.py compares them).
    "qlora-curve-0.5b": [Run("zerolab", "qwen2.5-0.5b", micro_batch=4, steps=200, window=10, variant=f"{q}-curve", timeout_s=420,
                             overrides=(f"model.quantization={q}",)) for q in ("none", "nf4")],
    # zerolab against TRL's SFTTrainer (the peer users weigh it against), 7B on one GPU with two packed
    # 4k rows per step, medians of three; the first pair are first launches (empty data and kernel caches).
    "trl-7b": _suite_trl("qwen2.5-7b", micro_batch=2, steps=12, timeout_s=300),
    # The 7B job's loss at every step with zerolab's LoRA nodes, with peft's own LoRA forward
    # (`model.kernels=none`, which leaves Liger's kernels out too) and with the nodes where ZeRO-2 reduces
    # gradients on the compute stream (`overlap_comm` off): which LoRA products the engine's GPU path
    # computes as peft does, where two formulations of the nodes that agree on CPU and outside the engine
    # parted by 0.14 in loss after 12 steps (docs/benchmark.md, h200-106 to h200-110: the shipped nodes
    # match peft's forward there, the folded ones did not).
    "lora-nodes-7b": [Run("zerolab", "qwen2.5-7b", stage=2, micro_batch=2, steps=12, window=6, kernels=kernels, variant=label, timeout_s=300,
                          overrides=("train.log_every_n_steps=1", *extra))
                      for label, kernels, extra in (("nodes", "auto", ()), ("peft", "none", ()),
                                                    ("nodes-no-overlap", "auto", (f"deepspeed.config={REPO / 'bench/zero2_no_overlap.json'}",)))],
    "trl-0.5b": _suite_trl("qwen2.5-0.5b", micro_batch=4, steps=20, timeout_s=180),
    # Where zerolab's checkpointed nf4 step at one row loses to TRL's (h100-60: 6,047 against 7,501 tokens/s):
    # the same run at ZeRO-0 (no ZeRO-2 gradient buckets and their device syncs), and the ZeRO-2 step
    # under torchrun and TRL's step, profiled (the GPU's own time per step against the step's wall time).
    "qlora-7b-step": [Run("zerolab", "qwen2.5-7b", stage=0, steps=12, window=6, checkpointing=True, variant="nf4-mb1-ckpt", timeout_s=300,
                          overrides=("model.quantization=nf4",)),
                      Run("zerolab-torchrun", "qwen2.5-7b", stage=2, steps=8, window=4, checkpointing=True, variant="nf4-mb1-ckpt",
                          profile_steps=2, timeout_s=300, overrides=("model.quantization=nf4",)),
                      Run("trl", "qwen2.5-7b", steps=8, window=4, checkpointing=True, attn="auto", variant="nf4-mb1-ckpt-profile",
                          profile_steps=2, timeout_s=300, overrides=("model.quantization=nf4",))],
    # QLoRA against TRL's QLoRA on the same nf4 base and rows: one packed 4k row with gradient checkpointing
    # (the quantized-base memory figure's setting), zerolab at ZeRO-2, alternating, twice each.
    "trl-qlora-7b": [r for rep in (1, 2) for r in (
        Run("zerolab", "qwen2.5-7b", stage=2, steps=12, window=6, checkpointing=True, variant=f"nf4-mb1-ckpt-rep{rep}", timeout_s=300,
            overrides=("model.quantization=nf4",)),
        Run("trl", "qwen2.5-7b", steps=12, window=6, checkpointing=True, attn="auto", variant=f"nf4-mb1-ckpt-rep{rep}", timeout_s=300,
            overrides=("model.quantization=nf4",)))],
    # The held-out checks of the estimate's ZeRO-3 reserved memory over two GPUs. zero3-cache-heldout: shapes
    # and lengths the measured share of the time was not fitted to; zero3-pools-heldout: those the
    # stream pools' pending layers (Calibration.gather_pending_layers_per_doubling) were not fitted to.
    "zero3-cache-heldout": [
        Run("zerolab", "qwen2.5-7b", gpus=2, stage=3, steps=8, window=4, checkpointing=True, variant="nf4-mb1-ckpt", timeout_s=420,
            overrides=("model.quantization=nf4",)),
        Run("zerolab", "qwen2.5-7b", gpus=2, stage=3, row_tokens=32768, steps=4, window=2, checkpointing=True, variant="sp2-rows32k-ckpt",
            timeout_s=420, overrides=("scaling.sequence_parallel_size=2",)),
        Run("zerolab", "qwen2.5-0.5b", gpus=2, stage=3, micro_batch=2, steps=8, window=4, variant="nf4-mb2", timeout_s=300,
            overrides=("model.quantization=nf4",))],
    "zero3-pools-heldout": [
        Run("zerolab", "qwen2.5-7b", gpus=2, stage=3, micro_batch=2, steps=6, window=3, checkpointing=True, variant="mb2-ckpt", timeout_s=300),
        Run("zerolab", "qwen2.5-7b", gpus=2, stage=3, row_tokens=65536, steps=4, window=2, checkpointing=True, variant="sp2-rows64k-ckpt",
            timeout_s=420, overrides=("scaling.sequence_parallel_size=2",)),
        Run("zerolab", "qwen2.5-7b", gpus=2, stage=3, micro_batch=2, steps=6, window=3, checkpointing=True, variant="nf4-mb2-ckpt",
            timeout_s=300, overrides=("model.quantization=nf4",))],
    # int8 bases at two rows: 7B with checkpointing, the 0.5B shape without (the rows that once checked
    # LLM.int8()'s held inputs and outlier columns, which zerolab's own products no longer keep).
    "int8-heldout": [
        Run("zerolab", "qwen2.5-7b", stage=2, micro_batch=2, steps=8, window=4, checkpointing=True, variant="int8-mb2-ckpt", timeout_s=300,
            overrides=("model.quantization=int8",)),
        Run("zerolab", "qwen2.5-0.5b", stage=2, micro_batch=2, steps=8, window=4, variant="int8-mb2", timeout_s=300,
            overrides=("model.quantization=int8",))],
    # Long rows on one GPU (docs/memory.md#long-rows): see _suite_long_rows_7b.
    "long-rows-7b": _suite_long_rows_7b(),
    # The 0.5B shape at 64K-token rows: as they fit without checkpointing, and with the tiled MLP.
    "long-rows-0.5b": [Run("zerolab", "qwen2.5-0.5b", stage=2, row_tokens=65536, steps=6, window=3, variant=f"rows64k{label}",
                           timeout_s=420, overrides=overrides)
                       for label, overrides in (("", ()), ("-tiled", ("model.tiled_mlp=auto",)))],
    # Ulysses sequence parallelism against one GPU (see _suite_sequence_parallel_7b): each row over two
    # GPUs, over four, and on eight GPUs in two groups of four (the most the 7B shape's heads allow).
    "sp-7b-2gpu": _suite_sequence_parallel_7b(2, sp=2),
    "sp-7b-4gpu": _suite_sequence_parallel_7b(4, sp=4),
    "sp-7b-8gpu": _suite_sequence_parallel_7b(8, sp=4),
    # CPU smoke test of the harness itself (tiny model, no GPU): every system runs a few steps.
    "cpu-smoke": [Run(s, "tiny", micro_batch=2, steps=4, window=2, checkpointing=s == "seeds", attn="sdpa", kernels="none",
                      timeout_s=600) for s in SYSTEMS],
}


@dataclass
class Workspace:
    root: Path
    data: Path = field(init=False)
    models: dict[str, str] = field(default_factory=dict)
    long_data: dict[tuple[int, int], Path] = field(default_factory=dict)
    """Long-row files by row length and count (:attr:`Run.row_tokens`, :attr:`Run.long_rows`)."""

    def prepare(self, shapes: set[str], long_rows: Iterable[tuple[int, int]] = ()) -> None:
        from bench import workload
        from bench.calibrate_memory import model_path

        self.root.mkdir(parents=True, exist_ok=True)
        self.data = workload.data_mix(self.root / "data")
        for tokens, rows in sorted(r for r in long_rows if r[0] > 0):
            self.long_rows(tokens, rows)
        from zerolab.models import resolve_model_path

        for shape in sorted(shapes):
            self.models[shape] = resolve_model_path(model_path(shape, self.root / "models"))

    def long_rows(self, tokens: int, rows: int) -> Path:
        """The long-row file of ``rows`` rows of just under ``tokens`` tokens (written once)."""
        from bench import workload

        if (tokens, rows) not in self.long_data:
            self.long_data[tokens, rows] = workload.long_rows(self.root / "data", tokens, rows=rows)
        return self.long_data[tokens, rows]

    def data_of(self, run: Run) -> Path:
        return self.long_rows(run.row_tokens, run.long_rows) if run.row_tokens > 0 else self.data


def zerolab_overrides(run: Run, ws: Workspace, *, for_torchrun: bool = False) -> list[str]:
    """The job config of a zerolab run (the torchrun loop takes the same, minus Ray's and MLflow's)."""
    from bench.calibrate_memory import SHAPE_POSITIONS
    from bench.workload import NUM_LONG, NUM_MATH, NUM_NER

    length = run.row_tokens if run.row_tokens > 0 else run.max_seq_length
    o = [f"model.name_or_path={ws.models[run.shape]}", f"model.attn_implementation={run.attn}", f"model.kernels={run.kernels}",
         f"model.gradient_checkpointing={str(run.checkpointing).lower()}",
         "adapter.method=lora", "adapter.r=16", "adapter.alpha=32", "adapter.dropout=0.0",
         "data.task=custom", f"data.train_path={ws.data_of(run)}",
         f"data.num_train_rows={run.long_rows if run.row_tokens > 0 else NUM_MATH + NUM_NER + NUM_LONG}",
         f"data.max_seq_length={length}", "data.packing=true",
         f"train.micro_batch_size={run.micro_batch}", f"train.max_steps={run.steps}", f"train.log_every_n_steps={run.window}",
         "train.lr=1e-4", "train.weight_decay=0.1",
         f"deepspeed.stage={run.stage}", f"deepspeed.offload_optimizer={str(run.offload != 'none').lower()}",
         f"deepspeed.offload_param={str(run.offload == 'all').lower()}",
         f"scaling.use_gpu={str(run.shape != 'tiny').lower()}", f"scaling.num_workers={run.gpus}"]
    if length > SHAPE_POSITIONS:  # past the shapes' trained positions (zerolab's plan refuses it without)
        o += ["model.rope_scaling=yarn", f"model.rope_factor={math.ceil(length / SHAPE_POSITIONS)}"]
    if run.shape == "tiny":
        o = [x for x in o if not x.startswith(("model.name_or_path", "data.max_seq_length"))]
        o += ["data.max_seq_length=1024", "data.max_bad_fraction=0.2"]  # the smoke test skips the longest rows
    if run.ds_settings != "tuned":
        o.append(f"deepspeed.config={zero3_variant(ws, run)}")
    o += list(run.overrides)
    if "memory" in run.traces and not for_torchrun:
        o.append(f"train.memory_snapshot_dir={memory_snapshot_dir(run, ws)}")
    if not for_torchrun:
        o += [f"run.name=bench-{run.name.replace('.', '_')}", f"run.storage_path={ws.root / 'runs'}",
              f"tracking.uri=file://{ws.root / 'mlruns'}", "tracking.experiment=benchmark", "tracking.register=false"]
    return o


def memory_snapshot_dir(run: Run, ws: Workspace) -> Path:
    return ws.root / "memory_snapshots" / run.name


def zero3_variant(ws: Workspace, run: Run) -> Path:
    """zerolab's zero3.json with ``run.ds_settings``: ``hf-defaults``, the bucket values Hugging Face's
    integration derives for "auto" (the settings of the earliest reference figures); ``live-<n>``,
    ``stage3_max_live_parameters`` at n elements (zerolab derives it from the model for adapters) or,
    ``live-uncapped``, more than any model has."""
    from zerolab.ds_config import UNCAPPED

    raw = json.loads((REPO / "ds_configs" / "zero3.json").read_text())
    if run.ds_settings.startswith("live-"):
        live = run.ds_settings.removeprefix("live-")
        raw["zero_optimization"]["stage3_max_live_parameters"] = UNCAPPED if live == "uncapped" else int(float(live))
    else:
        from transformers import AutoConfig

        assert run.ds_settings == "hf-defaults", run.ds_settings
        h = AutoConfig.from_pretrained(ws.models[run.shape]).hidden_size
        raw["zero_optimization"].update(reduce_bucket_size=h * h, stage3_prefetch_bucket_size=int(0.9 * h * h),
                                        stage3_param_persistence_threshold=10 * h)
    path = ws.root / f"zero3_{run.ds_settings}.json"
    path.write_text(json.dumps(raw, indent=1))
    return path


def command(run: Run, ws: Workspace, result: Path) -> list[str]:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={run.gpus}"]
    model = ws.models[run.shape]
    length = run.row_tokens if run.row_tokens > 0 else run.max_seq_length
    common = ["--model", model, "--data", str(ws.data_of(run)), "--out", str(result), "--steps", str(run.steps), "--window", str(run.window),
              "--micro-batch", str(run.micro_batch), "--max-seq-length", "1024" if run.shape == "tiny" else str(length)]
    if run.system == "zerolab":
        return [sys.executable, str(REPO / "bench" / "zerolab_run.py"), "--out", str(result),
                *[a for o in zerolab_overrides(run, ws) for a in ("--set", o)]]
    if run.system == "zerolab-torchrun":
        return [*torchrun, str(REPO / "bench" / "torchrun_loop.py"), "--mode", "zerolab", *common, "--profile-steps", str(run.profile_steps),
                *[f"--{t}-trace" for t in run.traces],
                *[a for o in zerolab_overrides(run, ws, for_torchrun=True) for a in ("--set", o)]]
    if run.system == "seeds":
        return [*torchrun, str(REPO / "bench" / "seeds_recipe.py"), *common, "--stage", str(run.stage)]
    if run.system == "trl":  # one GPU: started as TRL's users start it, without a launcher
        trl = [str(REPO / "bench" / "trl_sft.py"), *common, "--attn", run.attn, "--kernels", run.kernels,
               "--quantization", run.quantization(), "--profile-steps", str(run.profile_steps),
               *(["--gradient-checkpointing"] if run.checkpointing else [])]
        return [sys.executable, *trl] if run.gpus == 1 else [*torchrun, *trl]
    return [*torchrun, str(REPO / "bench" / "torchrun_loop.py"), "--mode", "plain", *common,
            *(["--gradient-checkpointing"] if run.checkpointing else [])]


# The benchmark's runs record to an MLflow file store: the GPU hosts carry mlflow-skinny, which has no
# SQLAlchemy for a sqlite store, and MLflow 3 refuses file stores unless this is set.
FILE_STORE_ENV = {"MLFLOW_ALLOW_FILE_STORE": "true"}


def subprocess_env() -> dict[str, str]:
    """This environment with this checkout's zerolab first on the path (every run is a fresh process),
    MLflow's file store allowed (:data:`FILE_STORE_ENV`)."""
    return {**os.environ, **FILE_STORE_ENV,
            "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "platform"), os.environ.get("PYTHONPATH", "")])}


def estimated_micro_batch(run: Run, ws: Workspace) -> int:
    """The micro-batch ``jobs/estimate.py`` names for ``run`` on this machine: the largest with which
    the run's option fits its GPUs outside the estimate's 10% margin (1 if none does)."""
    from bench.calibrate_memory import estimate_overrides, resolved_overrides, shape_model_config

    from zerolab.config import load_config
    from zerolab.memory import Limits, largest_micro_batch
    from zerolab.zero import Option

    cfg = load_config(None, estimate_overrides(resolved_overrides(zerolab_overrides(dataclasses.replace(run, micro_batch=1), ws))))
    return largest_micro_batch(cfg, shape_model_config(run.shape), Limits.detect(), Option.of(cfg)) or 1


def estimated_row_tokens(run: Run, ws: Workspace) -> int:
    """The longest row ``jobs/estimate.py`` names for ``run`` on this machine (its settings, micro-batch
    1, packed): the longest multiple of 1,024 tokens that fits its GPU and host memory outside the
    estimate's 10% margin (4,096 if none does)."""
    from bench.calibrate_memory import estimate_overrides, resolved_overrides, shape_model_config

    from zerolab.config import load_config
    from zerolab.memory import Limits, longest_row
    from zerolab.zero import Option

    probe = dataclasses.replace(run, row_tokens=4096)  # the long-row data's row count; longest_row sets the length
    cfg = load_config(None, estimate_overrides(resolved_overrides(zerolab_overrides(probe, ws))))
    return longest_row(cfg, shape_model_config(run.shape), Limits.detect(), Option.of(cfg)) or 4096


def execute(run: Run, ws: Workspace, log: Any) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Run one benchmark run; returns its CSV row and, for zerolab runs, a memory-calibration row."""
    from bench.calibrate_memory import NodeMemorySampler

    if run.micro_batch == 0:
        run = dataclasses.replace(run, micro_batch=estimated_micro_batch(run, ws))
        log.write(f"\n{run.name}: micro-batch {run.micro_batch}, the largest the memory estimate allows here\n")
    if run.row_tokens < 0:
        run = dataclasses.replace(run, row_tokens=estimated_row_tokens(run, ws))
        log.write(f"\n{run.name}: rows of {run.row_tokens:,} tokens, the longest the memory estimate allows here\n")

    result = ws.root / "results" / run.name
    result.parent.mkdir(parents=True, exist_ok=True)
    for stale in result.parent.glob(f"{run.name}*json"):
        stale.unlink()
    cmd = command(run, ws, result.with_suffix(".json") if run.system == "zerolab" else result)
    row: dict[str, Any] = {"run": run.name, "system": run.system, "shape": run.shape, "gpus": run.gpus, "stage": run.stage,
                           "offload": run.offload, "variant": run.variant, "micro_batch": run.micro_batch,
                           "checkpointing": run.checkpointing, "attn": run.attn, "quantization": run.quantization(), "steps": run.steps,
                           "row_tokens": run.row_tokens or "",
                           "command": _shown(cmd, ws)}
    env = subprocess_env()
    if run.system == "zerolab-torchrun":  # the allocator settings zerolab's workers get
        from zerolab.cluster import CUDA_ALLOC_CONF

        env.setdefault("PYTORCH_CUDA_ALLOC_CONF", CUDA_ALLOC_CONF)
    if run.system == "trl" and run.gpus == 1:  # Trainer would wrap the model in DataParallel over every visible GPU
        env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    if run.first_launch:
        caches = ws.root / "first-launch" / run.name
        shutil.rmtree(caches, ignore_errors=True)
        env.update(ZEROLAB_CACHE=str(caches / "zerolab"), TRITON_CACHE_DIR=str(caches / "triton"))
    log.write(f"\n===== {run.name}\n$ {row['command']}\n")
    log.flush()
    launch = time.time()
    with NodeMemorySampler() as node:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
        try:
            code = proc.wait(timeout=run.timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = "timeout"
    row["wall_s"] = round(time.time() - launch, 1)
    row["node_used_peak_gib"] = round(node.peak_gib, 2)
    if code != 0:
        row["status"] = f"failed ({code})"
        return row, None
    metrics = _collect(run, result)
    row.update({k: (round(v, 4) if isinstance(v, float) else v) for k, v in metrics.items() if k in COLUMNS})
    row["time_to_first_step_s"] = round(metrics["first_step_unix"] - launch, 1) if metrics.get("first_step_unix") else ""
    row["mfu_attn"] = _mfu_with_attention(run, metrics)
    row["status"] = "ok"
    calibration = _calibration_row(run, ws, metrics, node.peak_gib) if run.system == "zerolab" and run.ds_settings != "hf-defaults" else None
    return row, calibration


def _collect(run: Run, result: Path) -> dict[str, Any]:
    from zerolab import perf

    if run.system == "zerolab":
        done = json.loads(result.with_suffix(".json").read_text())
        m, data = done["metrics"], done.get("data", {}).get("train", {})
        counts = {"train_rows": "rows_used", "train_tokens": "tokens", "train_target_tokens": "target_tokens"}
        return {**{column: data[key] for column, key in counts.items() if key in data},
                "tokens_per_s_per_gpu": m["perf/tokens_per_s"] / run.gpus, "step_s": m["perf/step_s"], "mfu": m.get("perf/mfu", 0.0),
                "tokens_per_step": m["perf/tokens_per_s"] * m["perf/step_s"],
                "gpu_peak_allocated_gib": m.get("mem/gpu_peak_allocated_gib", 0.0),
                "gpu_peak_reserved_gib": m.get("mem/gpu_peak_reserved_gib", 0.0), "host_rss_peak_gib": m["mem/host_rss_peak_gib"],
                "first_step_unix": m.get("perf/first_step_unix", 0.0), "train_loss": m.get("train/loss", ""), "device": _gpu_name()}
    ranks = [json.loads(p.read_text()) for p in sorted(result.parent.glob(f"{result.name}.rank*.json"))]
    tokens_per_s = sum(r["tokens_per_s"] for r in ranks)
    first = ranks[0]
    peak = perf.peak_flops_of(first["device"])
    flops = perf.train_flops_per_token(first["total_params"], first["trainable_params"], full=False)
    return {"tokens_per_s_per_gpu": tokens_per_s / len(ranks), "step_s": max(r["step_s"] for r in ranks),
            "mfu": tokens_per_s / len(ranks) * flops / peak if peak else 0.0,
            "tokens_per_step": sum(r["tokens_per_step"] for r in ranks),
            "gpu_peak_allocated_gib": max(r.get("gpu_peak_allocated_gib", 0.0) for r in ranks),
            "gpu_peak_reserved_gib": max(r.get("gpu_peak_reserved_gib", 0.0) for r in ranks),
            "host_rss_peak_gib": sum(r["host_rss_peak_gib"] for r in ranks), "first_step_unix": first["first_step_unix"],
            "device": first["device"], **{k: first[k] for k in ("attn", "train_rows", "train_tokens", "train_target_tokens") if k in first}}


def _mfu_with_attention(run: Run, metrics: dict[str, Any]) -> float | str:
    """MFU with attention's FLOPs counted (``zerolab.perf.attention_train_flops_per_token``), for runs
    of long rows, whose micro-batch rows are one sample each: the sample's length is the tokens of a
    step per row, a row being shared by the ``scaling.sequence_parallel_size`` GPUs of its group (each
    computes its share of the heads over the whole row). Empty for the data mix (samples of many
    lengths packed together)."""
    from bench.calibrate_memory import shape_model_config

    from zerolab import perf
    from zerolab.memory import ModelShape

    if run.row_tokens <= 0 or not metrics.get("mfu") or not metrics.get("tokens_per_step"):
        return ""
    shape = ModelShape.from_config(shape_model_config(run.shape))
    split = next((int(o.split("=", 1)[1]) for o in run.overrides if o.startswith("scaling.sequence_parallel_size=")), 1)
    sample = metrics["tokens_per_step"] * split / (run.micro_batch * run.gpus)
    attention = metrics["tokens_per_s_per_gpu"] * perf.attention_train_flops_per_token(int(sample), shape.q_dim, shape.num_layers)
    peak = perf.peak_flops_of(metrics.get("device", ""))
    return round(float(metrics["mfu"]) + attention / peak, 4) if peak else ""


def _calibration_row(run: Run, ws: Workspace, metrics: dict[str, Any], node_peak_gib: float) -> dict[str, Any]:
    from bench.calibrate_memory import error_pct, predict_overrides, resolved_overrides

    overrides = resolved_overrides([o for o in zerolab_overrides(run, ws) if not o.startswith(("run.", "tracking."))])
    row: dict[str, Any] = {"case": f"bench-{run.name}", "device": metrics["device"], "status": "ok", "workers": run.gpus,
                           "shape": run.shape, "overrides": json.dumps(overrides)}
    row.update({k: round(v, 3) for k, v in predict_overrides(overrides, run.shape).items()})
    row.update(meas_gpu_alloc_gib=round(metrics["gpu_peak_allocated_gib"], 3), meas_gpu_reserved_gib=round(metrics["gpu_peak_reserved_gib"], 3),
               meas_host_workers_gib=round(metrics["host_rss_peak_gib"], 3), meas_node_used_gib=round(node_peak_gib, 3))
    row.update(error_pct(row))
    return row


def ratios(rows: list[dict[str, Any]]) -> None:
    """Add ``vs_seeds`` and ``vs_plain``: tokens/s per GPU over the same shape's single-GPU baseline;
    and ``vs_trl``, ``vs_trl_memory``, ``vs_trl_first_step``: tokens/s per GPU, peak allocated GPU
    memory and time to first step over the medians of TRL's rows of the same shape, GPU count and
    micro-batch (the same tokens per step)."""
    base = {(r["shape"], r["system"]): float(r["tokens_per_s_per_gpu"]) for r in rows
            if r.get("status") == "ok" and r["system"] in ("seeds", "plain") and int(r["gpus"]) == 1}
    for r in rows:
        for name in ("seeds", "plain"):
            b = base.get((r["shape"], name))
            ok = r.get("status") == "ok" and b
            r[f"vs_{name}"] = f"{float(r['tokens_per_s_per_gpu']) / b:.2f}" if ok else ""

    def same_work(r: dict[str, Any]) -> tuple[str, int, int, str, str]:
        return r["shape"], int(r["gpus"]), int(r["micro_batch"]), str(r.get("checkpointing")), r.get("quantization") or "none"

    trl: dict[tuple[str, int, int, str, str], list[dict[str, Any]]] = {}
    for r in rows:
        if r.get("status") == "ok" and r["system"] == "trl":
            trl.setdefault(same_work(r), []).append(r)
    for r in rows:
        peers = trl.get(same_work(r), []) if r.get("status") == "ok" else []
        for ratio, column in (("vs_trl", "tokens_per_s_per_gpu"), ("vs_trl_memory", "gpu_peak_allocated_gib"),
                              ("vs_trl_first_step", "time_to_first_step_s")):
            theirs = [float(p[column]) for p in peers if _number(p.get(column))]
            r[ratio] = f"{float(r[column]) / statistics.median(theirs):.2f}" if theirs and _number(r.get(column)) else ""


def _number(v: Any) -> bool:
    """A measured, non-zero figure (CSV cells are strings; CPU runs have no GPU memory)."""
    try:
        return float(v) != 0.0
    except (TypeError, ValueError):
        return False


def environment() -> dict[str, Any]:
    """Machine and versions, for the report."""
    env: dict[str, Any] = {"python": platform.python_version(), "cpus": os.cpu_count(), "host": platform.node()}
    for package in ("torch", "transformers", "peft", "deepspeed", "ray", "mlflow-skinny", "mlflow", "liger-kernel", "triton", "accelerate",
                    "trl", "datasets", "flash-attn"):
        try:
            env[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            pass
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout.strip().splitlines()
        env["gpus"] = smi
    except (OSError, subprocess.SubprocessError):
        env["gpus"] = []
    try:
        import torch

        env["cuda"] = torch.version.cuda
    except ImportError:
        pass
    return env


def write_csv(path: Path, rows: list[dict[str, Any]], columns: list[str]) -> None:
    new = not path.is_file()
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        if new:
            writer.writeheader()
        writer.writerows(rows)


def read_csv(paths: list[Path]) -> list[dict[str, str]]:
    rows: list[dict[str, str]] = []
    for path in paths:
        with open(path, newline="") as f:
            rows.extend(csv.DictReader(f))
    return rows


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The results as a Markdown table, with ratios to the seeds' recipe, the plain loop and TRL
    (tokens/s, GPU memory, first step: :func:`ratios`)."""
    ratios(rows)
    head = ["run", "attn", "tokens/s/GPU", "step s", "MFU", "tokens/step", "GPU alloc / reserved GiB", "host RSS GiB",
            "first step s", "loss", "vs seeds", "vs plain", "vs TRL: tok/s · GPU mem · first step", "status"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    def num(r: dict[str, Any], key: str, fmt: str) -> str:
        v = r.get(key)
        return format(float(v), fmt) if r.get("status") == "ok" and v not in (None, "") else "—"

    for r in rows:
        ok = r.get("status") == "ok"
        mfu = f"{100 * float(r['mfu']):.1f}%" if ok and r.get("mfu") not in (None, "", "0.0", 0.0) else "—"
        vs_trl = " · ".join(f"{r[k]}×" if r.get(k) else "—" for k in ("vs_trl", "vs_trl_memory", "vs_trl_first_step"))
        lines.append("| " + " | ".join([
            r["run"], r.get("attn") or "—", num(r, "tokens_per_s_per_gpu", ",.0f"), num(r, "step_s", ".3f"), mfu, num(r, "tokens_per_step", ",.0f"),
            f"{num(r, 'gpu_peak_allocated_gib', '.1f')} / {num(r, 'gpu_peak_reserved_gib', '.1f')}", num(r, "host_rss_peak_gib", ".1f"),
            num(r, "time_to_first_step_s", ".1f"), num(r, "train_loss", ".4f"), (r.get("vs_seeds") or "—") + ("×" if r.get("vs_seeds") else ""),
            (r.get("vs_plain") or "—") + ("×" if r.get("vs_plain") else ""), vs_trl if r.get("vs_trl") else "—",
            r.get("status", "")]) + " |")
    return "\n".join(lines)


def _shown(cmd: list[str], ws: Workspace) -> str:
    text = " ".join(cmd).replace(sys.executable, "python").replace(str(REPO) + "/", "").replace(str(ws.root), "$WORK")
    return text


def _gpu_name() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True,
                              timeout=30, check=True).stdout.splitlines()[0].strip()
    except (OSError, subprocess.SubprocessError, IndexError):
        return "cpu"


_big, _small = SUITES["single-7b"], SUITES["single-0.5b"]
SUITES["single"] = [*_big[:4], _small[0], _small[2], _small[3], _small[1], *_big[4:], *_small[4:]]

__all__ = ["COLUMNS", "FILE_STORE_ENV", "Run", "SUITES", "Workspace", "asdict", "environment", "execute", "markdown_table", "read_csv", "subprocess_env",
           "write_csv"]
