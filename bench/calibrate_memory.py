"""Calibrate zerolab's memory estimator: short real trainings, measured peaks next to the predictions.

    python bench/calibrate_memory.py --cases gpu-1 --out cal-h100                 # on one GPU (H100): 3 cases
    python bench/calibrate_memory.py --cases gpu-2 --out cal-h200x2               # on two GPUs: 4 cases
    python bench/calibrate_memory.py --cases gpu --out cal --only 0.5b            # the full list, a subset; --resume goes on
    python bench/calibrate_memory.py --cases tiny --out /tmp/calibration          # CPU: the tiny model, 2 workers
    python bench/calibrate_memory.py --dry-run --cases gpu-2                      # list the cases and predictions only
    python bench/calibrate_memory.py --recompute a.csv b.csv --out docs/calibration   # merge rows, predict again
    python bench/calibrate_memory.py --held-out --cases held-out-1 --out heldout-h200   # held-out set, 1 GPU: errors, no fit
    python bench/calibrate_memory.py --held-out --cases held-out-2 --out heldout-h200x2 # held-out set, 2 GPUs
    python bench/calibrate_memory.py --held-out --recompute heldout/*.csv --out /tmp/h  # held-out rows predicted again

Each case trains a random-init model of a real shape (Qwen2.5-0.5B and -7B, built once from its
config into ``--models`` or $ZEROLAB_CACHE/calibration, no download; the tiny model's tokenizer,
the real vocabulary size) for a few packed steps through ``zerolab.run.run_sft``, then compares the
run's ``mem/gpu_peak_allocated_gib``, ``mem/gpu_peak_reserved_gib`` and ``mem/host_rss_peak_gib``
(and the node's used memory, sampled) with ``zerolab.memory.estimate``. Rows are appended to
``<out>/memory_calibration.csv`` as each case ends (``--resume`` skips cases already there), with
the overrides that predict them again anywhere (``--recompute``, after changing the constants);
``<out>/memory_calibration.md`` gets the table with errors and the calibration constants fitted to
the measurements. ``jobs/benchmark.py`` writes rows of the same form for its zerolab runs. A
harness run by hand on real hardware, not a job: it lives in bench/.

The held-out lists (``held-out-1``, ``held-out-2``) are kept apart from the fit: they vary what the
calibration cases do not (padded and packed rows of ≈ 100 to 4k tokens from the benchmark's data
mix, micro-batch 1 to 16, all five methods, fp32 AdaLoRA, ZeRO 0-3 with and without offload) and
``--held-out`` runs them into ``<out>/memory_heldout.{csv,md}``, predicting each run as its own
preflight does (data-aware, from the shards of its data) and fitting nothing.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import shutil
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

try:
    import zerolab  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))

SHAPES = {"qwen2.5-0.5b": "Qwen/Qwen2.5-0.5B", "qwen2.5-1.5b": "Qwen/Qwen2.5-1.5B", "qwen2.5-3b": "Qwen/Qwen2.5-3B",
          "qwen2.5-7b": "Qwen/Qwen2.5-7B", "qwen2.5-14b": "Qwen/Qwen2.5-14B", "tiny": None}
"""Calibration shape -> the KNOWN_CONFIGS entry it copies (tiny: the built-in model itself)."""

SHARD_SIZE = 5 * 10**9
"""``max_shard_size`` of the random-init models (5 GB, the hub's files of transformers 4.35-4.x;
transformers 5 saves up to 50 GB in one file): the 0.5B and 1.5B shapes are one file each, the 3B
shape two (4.62 and 1.13 GiB), the 7B shape four (the largest 4.59 GiB)."""

SHAPE_POSITIONS = 32768
"""The random-init shapes' ``max_position_embeddings`` (the Qwen2.5 instruct models'): longer rows need RoPE scaling."""

COLUMNS = ["case", "device", "status", "seconds", "pred_gpu_alloc_gib", "meas_gpu_alloc_gib", "err_gpu_alloc_pct",
           "pred_gpu_reserved_gib", "meas_gpu_reserved_gib", "err_gpu_reserved_pct", "pred_host_workers_gib",
           "meas_host_workers_gib", "err_host_pct", "pred_node_total_gib", "meas_node_used_gib", "workers",
           "base_framework_gib", "base_host_process_gib", "shape", "overrides", "host_imports_gib"]
"""``host_imports_gib``: on CPU rows, what the workers' imports held where the row was measured
(``zerolab.memory.worker_imports_rss``), so that predicting the row again elsewhere takes that machine's."""


@dataclass(frozen=True)
class Case:
    shape: str
    method: str
    stage: int
    offload: str = "none"
    workers: int = 1
    micro_batch: int = 4
    seq_len: int = 1024
    checkpointing: bool = False
    gpu: bool = True
    steps: int = 6
    packing: bool = True
    data: str = "math"
    """``math``: the generated math rows (≈ 30-70 tokens); ``mix``: ``bench/workload.py``'s mix, rows of
    ≈ 30 tokens up to ``seq_len``."""
    precision: str = ""
    """Empty: bf16 on GPU, fp32 on CPU."""
    quantization: str = "none"
    """``model.quantization`` of the base (``nf4``, ``fp4``, ``int8``)."""
    rank: int = 16
    """``adapter.r`` (alpha twice it)."""
    extra: tuple[str, ...] = ()
    """More job config overrides (``KEY=VALUE``), after the others."""

    @property
    def name(self) -> str:
        offload = "" if self.offload == "none" else f"-off{self.offload}"
        device = f"{self.workers}{'gpu' if self.gpu else 'cpu'}"
        return (f"{self.shape}-{self.method}-z{self.stage}{offload}-{device}-b{self.micro_batch}x{self.seq_len}"
                f"{'-ckpt' if self.checkpointing else ''}{'' if self.packing else '-pad'}{'' if self.data == 'math' else '-' + self.data}"
                f"{'-' + self.precision if self.precision else ''}{'' if self.quantization == 'none' else '-' + self.quantization}"
                f"{'' if self.rank == 16 else f'-r{self.rank}'}")

    def overrides(self, model: str, out: Path) -> list[str]:
        # Packed rows fill every sequence, so micro-batches are micro_batch × seq_len tokens, as the
        # estimate assumes; math_sum rows are ~30 tokens.
        rows = max(256, self.steps * self.micro_batch * self.workers * (self.seq_len // 24 + 1))
        return [
            f"model.name_or_path={model}", f"model.gradient_checkpointing={str(self.checkpointing).lower()}",
            f"adapter.method={self.method}", f"adapter.r={self.rank}", f"adapter.alpha={2 * self.rank}",
            *([f"model.quantization={self.quantization}"] if self.quantization != "none" else []),
            *(["adapter.adalora_init_r=24"] if self.method == "adalora" else []),
            f"deepspeed.stage={self.stage}", f"deepspeed.offload_optimizer={str(self.offload != 'none').lower()}",
            f"deepspeed.offload_param={str(self.offload == 'all').lower()}",
            f"scaling.num_workers={self.workers}", f"scaling.use_gpu={str(self.gpu).lower()}",
            # Every case in a worker process of its own: the cases run one after another in this
            # script's process, which a one-worker job would otherwise train in.
            "scaling.launch=workers",
            f"train.precision={self.precision or ('bf16' if self.gpu else 'fp32')}", f"train.micro_batch_size={self.micro_batch}",
            f"train.max_steps={self.steps}", "train.log_every_n_steps=2", "train.lr=1e-4",
            f"data.packing={str(self.packing).lower()}", f"data.max_seq_length={self.seq_len}", f"data.num_train_rows={rows}",
            "data.num_eval_rows=16", *self._data(),
            f"run.name=memcal-{self.name.replace('.', '_')}", f"run.storage_path={out / 'runs'}",
            f"tracking.uri=file://{(out / 'mlruns').resolve()}", "tracking.experiment=memory-calibration", "tracking.register=false",
            *self.extra,
        ]


    def _data(self) -> list[str]:
        if self.data == "math":
            return []
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from workload import data_mix

        from zerolab import cache_dir

        return [f"data.train_path={data_mix(cache_dir() / 'calibration', max_tokens=self.seq_len)}", "data.task=custom"]


def _gpu_cases() -> list[Case]:
    small = [Case("qwen2.5-0.5b", "full", 0), Case("qwen2.5-0.5b", "full", 0, workers=2),
             Case("qwen2.5-0.5b", "full", 2, workers=2), Case("qwen2.5-0.5b", "full", 2, "optimizer", workers=2),
             Case("qwen2.5-0.5b", "full", 3, workers=2), Case("qwen2.5-0.5b", "full", 3, "all", workers=2),
             Case("qwen2.5-0.5b", "lora", 0), Case("qwen2.5-0.5b", "lora", 3, workers=2)]
    large = [Case("qwen2.5-7b", "lora", 0, checkpointing=True), Case("qwen2.5-7b", "lora", 0, workers=2, checkpointing=True),
             Case("qwen2.5-7b", "lora", 2, workers=2, checkpointing=True),
             Case("qwen2.5-7b", "lora", 2, "optimizer", workers=2, checkpointing=True),
             Case("qwen2.5-7b", "lora", 3, workers=2, checkpointing=True),
             Case("qwen2.5-7b", "lora", 3, "all", workers=1, checkpointing=True),
             Case("qwen2.5-7b", "lora", 3, "all", workers=2, checkpointing=True),
             Case("qwen2.5-7b", "lora", 0, micro_batch=2, seq_len=512),
             Case("qwen2.5-7b", "dora", 0, checkpointing=True)]
    return small + large


CASES: dict[str, list[Case]] = {
    "gpu": _gpu_cases(),
    # The cases beside the benchmark's zerolab runs (which calibrate LoRA at ZeRO 0/2/3 on 1-2 GPUs):
    # full fine-tuning, offload and gradient checkpointing, on a one-GPU and a two-GPU machine.
    "gpu-1": [Case("qwen2.5-0.5b", "full", 0), Case("qwen2.5-7b", "lora", 0, checkpointing=True),
              Case("qwen2.5-7b", "lora", 3, "all", workers=1, checkpointing=True)],
    "gpu-2": [Case("qwen2.5-0.5b", "full", 2, workers=2), Case("qwen2.5-0.5b", "full", 3, "all", workers=2),
              Case("qwen2.5-7b", "lora", 2, "optimizer", workers=2, checkpointing=True),
              Case("qwen2.5-7b", "lora", 3, "all", workers=2, checkpointing=True)],
    "gpu-quick": [Case("qwen2.5-0.5b", "full", 0), Case("qwen2.5-0.5b", "full", 3, workers=2),
                  Case("qwen2.5-7b", "lora", 0, checkpointing=True), Case("qwen2.5-7b", "lora", 3, "all", workers=2, checkpointing=True)],
    # Held out: never fitted to. One GPU, then two; a few steps each (the 7B model is built once).
    "held-out-1": [
        Case("qwen2.5-0.5b", "lora", 0, micro_batch=16, seq_len=128, packing=False, steps=4),
        Case("qwen2.5-0.5b", "adalora", 0, micro_batch=8, seq_len=512, packing=False, data="mix", precision="fp32", steps=4),
        Case("qwen2.5-0.5b", "rslora", 0, micro_batch=1, seq_len=4096, data="mix", steps=4),
        Case("qwen2.5-7b", "dora", 0, micro_batch=2, seq_len=2048, packing=False, data="mix", checkpointing=True, steps=3),
        Case("qwen2.5-7b", "lora", 3, "all", micro_batch=4, seq_len=1024, packing=False, data="mix", checkpointing=True, steps=3),
    ],
    "held-out-2": [
        Case("qwen2.5-0.5b", "lora", 2, workers=2, micro_batch=16, seq_len=128, packing=False, steps=4),
        Case("qwen2.5-0.5b", "full", 2, workers=2, micro_batch=16, seq_len=128, packing=False, steps=4),
        Case("qwen2.5-0.5b", "dora", 3, workers=2, micro_batch=8, seq_len=1024, data="mix", steps=4),
        Case("qwen2.5-0.5b", "full", 1, "optimizer", workers=2, micro_batch=8, seq_len=512, packing=False, data="mix", steps=4),
        Case("qwen2.5-7b", "rslora", 2, workers=2, micro_batch=2, seq_len=2048, data="mix", checkpointing=True, steps=3),
        Case("qwen2.5-7b", "lora", 3, "all", workers=2, micro_batch=1, seq_len=4096, packing=False, data="mix",
             checkpointing=True, steps=3),
    ],
    # The second held-out set, made after the estimator's last change and fitted to nothing. Its three
    # lists run side by side on one two-GPU host (memory is measured per process, so neighbours do not
    # change it): the math cases not yet run on both GPUs, and one list per GPU
    # (CUDA_VISIBLE_DEVICES=0 / =1). The first 7B DoRA case repeats the earlier host miss.
    # Held out for DoRA's temporaries beside a layer's activations (traced on the padded ZeRO-0 case of
    # held-out-1, lease h100-83): packed rows at ZeRO-2, where DoRA's weight norm decides the peak too.
    "held-out-k-dora": [Case("qwen2.5-7b", "dora", 2, micro_batch=1, seq_len=4096, data="mix", checkpointing=True, steps=3)],
    "held-out-b-2gpu": [
        Case("qwen2.5-0.5b", method, stage, offload, workers=2, micro_batch=16, seq_len=128, packing=False, steps=4,
             precision="fp32" if method == "adalora" else "")
        for method, stage, offload in (("lora", 3, "none"), ("lora", 3, "all"), ("dora", 3, "none"), ("rslora", 3, "none"),
                                       ("adalora", 0, "none"), ("full", 3, "none"))
    ],
    "held-out-b-gpu0": [
        Case("qwen2.5-7b", "dora", 0, micro_batch=2, seq_len=2048, packing=False, data="mix", checkpointing=True, steps=3),
        Case("qwen2.5-7b", "lora", 1, "optimizer", micro_batch=4, seq_len=512, packing=False, data="mix", checkpointing=True, steps=3),
        Case("qwen2.5-7b", "adalora", 0, micro_batch=1, seq_len=4096, data="mix", checkpointing=True, precision="fp32", steps=3),
    ],
    "held-out-b-gpu1": [
        Case("qwen2.5-0.5b", "full", 1, micro_batch=2, seq_len=2048, data="mix", steps=4),
        Case("qwen2.5-0.5b", "dora", 2, "optimizer", micro_batch=12, seq_len=512, packing=False, data="mix", steps=4),
        Case("qwen2.5-0.5b", "rslora", 3, micro_batch=1, seq_len=4096, packing=False, data="mix", checkpointing=True, steps=4),
        Case("qwen2.5-0.5b", "adalora", 0, micro_batch=4, seq_len=1024, data="mix", precision="fp32", steps=4),
        Case("qwen2.5-0.5b", "lora", 0, micro_batch=16, seq_len=512, data="mix", steps=4),
    ],
    # The third held-out set, after AdaLoRA's division is counted and checkpoints in another dtype
    # are converted on their way to the GPU: two lists side by side on one GPU, fitted to nothing.
    "held-out-c-7b": [
        Case("qwen2.5-7b", "adalora", 0, micro_batch=2, seq_len=1024, packing=False, data="mix", checkpointing=True, precision="fp32", steps=3),
        Case("qwen2.5-7b", "lora", 2, micro_batch=2, seq_len=2048, data="mix", checkpointing=True, steps=3),
        Case("qwen2.5-7b", "dora", 1, micro_batch=1, seq_len=4096, packing=False, data="mix", checkpointing=True, steps=3),
    ],
    "held-out-c-0.5b": [
        Case("qwen2.5-0.5b", "adalora", 0, micro_batch=8, seq_len=512, packing=False, data="mix", precision="fp32", steps=4),
        Case("qwen2.5-0.5b", "full", 0, micro_batch=4, seq_len=512, packing=False, data="mix", precision="fp32", steps=4),
        Case("qwen2.5-0.5b", "lora", 2, "optimizer", micro_batch=8, seq_len=1024, data="mix", steps=4),
        Case("qwen2.5-0.5b", "rslora", 1, micro_batch=16, seq_len=128, packing=False, steps=4),
        Case("qwen2.5-0.5b", "dora", 0, micro_batch=2, seq_len=4096, data="mix", checkpointing=True, steps=4),
    ],
    # Held-out set G: the trust issue's misses on one H100 — full fine-tuning at ZeRO 1 and 2
    # (reserved 17-23% under), LoRA at ZeRO-3 with everything offloaded (reserved 30% over) — in
    # shapes not fitted to.
    "held-out-g-0.5b": [
        Case("qwen2.5-0.5b", "full", 2, micro_batch=16, seq_len=128, packing=False, steps=4),
        Case("qwen2.5-0.5b", "full", 1, micro_batch=8, seq_len=256, steps=4),
        Case("qwen2.5-0.5b", "full", 1, micro_batch=4, seq_len=1024, data="mix", steps=4),
        Case("qwen2.5-0.5b", "full", 0, micro_batch=8, seq_len=512, packing=False, data="mix", steps=4),
        Case("qwen2.5-0.5b", "lora", 3, "all", micro_batch=16, seq_len=256, steps=4),
    ],
    # The fourth held-out set, after the ZeRO-0 gradient all-reduce bucket is counted: two lists side
    # by side on one GPU, fitted to nothing. fp32 AdaLoRA and full fine-tuning in shapes and stages
    # not run before, bf16 7B loads under the shipped (lazy) loader, ZeRO-3 on one GPU.
    "held-out-d-7b": [
        Case("qwen2.5-7b", "lora", 0, micro_batch=4, seq_len=1024, packing=False, data="mix", checkpointing=True, steps=3),
        Case("qwen2.5-7b", "adalora", 0, micro_batch=1, seq_len=2048, data="mix", checkpointing=True, precision="fp32", steps=3),
        Case("qwen2.5-7b", "rslora", 3, micro_batch=1, seq_len=4096, data="mix", checkpointing=True, steps=3),
    ],
    "held-out-d-0.5b": [
        Case("qwen2.5-0.5b", "full", 2, micro_batch=8, seq_len=512, packing=False, data="mix", precision="fp32", steps=4),
        Case("qwen2.5-0.5b", "adalora", 0, micro_batch=1, seq_len=4096, data="mix", precision="fp32", steps=4),
        Case("qwen2.5-0.5b", "lora", 3, "all", micro_batch=16, seq_len=128, packing=False, steps=4),
        Case("qwen2.5-0.5b", "full", 3, micro_batch=4, seq_len=512, packing=False, data="mix", steps=4),
        Case("qwen2.5-0.5b", "dora", 2, micro_batch=2, seq_len=1024, data="mix", steps=4),
    ],
    # The fifth held-out set, after ZeRO-3's flattened gradient copy and the load-time host baseline
    # (fitted to set D's misses and an RSS trace): one GPU, fitted to nothing.
    "held-out-e": [
        Case("qwen2.5-0.5b", "full", 3, micro_batch=8, seq_len=512, packing=False, data="mix", steps=4),
        Case("qwen2.5-0.5b", "rslora", 3, micro_batch=2, seq_len=2048, data="mix", steps=4),
        Case("qwen2.5-0.5b", "adalora", 0, micro_batch=16, seq_len=128, packing=False, precision="fp32", steps=4),
        Case("qwen2.5-0.5b", "dora", 2, micro_batch=4, seq_len=1024, data="mix", steps=4),
        Case("qwen2.5-7b", "lora", 3, micro_batch=1, seq_len=2048, data="mix", checkpointing=True, steps=3),
    ],
    # Held-out set H, after the reserved-memory terms (the largest block the allocator keeps cached),
    # ZeRO 1-2's flattened gradient copy and the gather buffers of parameter offload scaled by the
    # largest parameter, all fitted to set G and the calibration: one H100, about 7 minutes, fitted
    # to nothing. A shape not run before (1.5B) at ZeRO-2's step peak and with all offload, full
    # ZeRO-2 at its forward/backward peak on one GPU, DoRA at ZeRO-2, AdaLoRA's host in fp32.
    "held-out-h": [
        Case("qwen2.5-1.5b", "full", 2, micro_batch=8, seq_len=128, packing=False, steps=4),
        Case("qwen2.5-1.5b", "lora", 3, "all", micro_batch=8, seq_len=256, steps=4),
        Case("qwen2.5-0.5b", "full", 2, micro_batch=4, seq_len=768, data="mix", steps=4),
        Case("qwen2.5-0.5b", "dora", 2, micro_batch=8, seq_len=256, packing=False, steps=4),
        Case("qwen2.5-0.5b", "adalora", 0, micro_batch=4, seq_len=512, data="mix", precision="fp32", steps=4),
    ],
    # Held-out set I, after the lazy load's largest file and DeepSpeed's float64 norm copy (fitted to
    # every stored GPU row and to set A's and D's reserved misses): one H100, about 6 minutes, fitted
    # to nothing. A shape not run before whose checkpoint is two files (3B: 4.62 and 1.13 GiB, so the
    # largest file, not the whole, is on the host at the load), full ZeRO-1 with optimizer offload on
    # one GPU (the norm copy on the reduction stream beside the fp32 logits), full ZeRO-1 in fp32
    # (the norm copy, then the larger flat copy; a converting load) and DoRA at ZeRO-1 (a lazy
    # single-file load that decides the host figure).
    "held-out-i": [
        Case("qwen2.5-3b", "lora", 2, micro_batch=4, seq_len=256, steps=3),
        Case("qwen2.5-0.5b", "full", 1, "optimizer", micro_batch=8, seq_len=128, packing=False, steps=3),
        Case("qwen2.5-0.5b", "full", 1, micro_batch=4, seq_len=256, precision="fp32", steps=3),
        Case("qwen2.5-0.5b", "dora", 1, micro_batch=8, seq_len=512, packing=False, data="mix", steps=3),
    ],
    # Held-out set L, after ZeRO 1-2's gradient partition is counted in the reduction stream's pool (with
    # one fp32 logits block beside the forward/backward peak for padded micro-batches) and a quantized
    # base's load on the pre-load baseline: two GPUs, fitted to nothing. Full fine-tuning at its
    # forward/backward peak, where the pool decides reserved: ZeRO-2 on padded rows of the mix (up to
    # 8 × 120 tokens), and ZeRO-1 (the same reduction path) on the padded math rows.
    "held-out-l-2gpu": [
        Case("qwen2.5-0.5b", "full", 2, workers=2, micro_batch=8, seq_len=512, packing=False, data="mix", steps=4),
        Case("qwen2.5-0.5b", "full", 1, workers=2, micro_batch=16, seq_len=128, packing=False, steps=4),
    ],
    # Held-out set M: int8 bases without checkpointing, in shapes between the measured ones, with the
    # default adapter dropout (0.05): peft's LoRA forward over zerolab's int8 products, which keep
    # nothing of their inputs (zerolab.quantized_products), where bitsandbytes' own kept the normed
    # inputs, down's input and its outlier columns. One H100, about 4 minutes.
    "held-out-m-int8": [
        Case("qwen2.5-1.5b", "lora", 2, micro_batch=2, seq_len=4096, data="mix", steps=3, quantization="int8"),
        Case("qwen2.5-3b", "lora", 2, micro_batch=1, seq_len=4096, data="mix", steps=3, quantization="int8"),
        Case("qwen2.5-7b", "lora", 0, micro_batch=1, seq_len=4096, data="mix", steps=3, quantization="int8"),
    ],
    # Held-out set N, after the ZeRO-3 replay's reuse scan (the embeddings kept gathered, the last layers
    # gathered past the cap) and the all-gather stream's flat buffers, checked against the traced 14B and
    # 7B nf4 runs of lease h200x2-81: two GPUs, about 4 minutes (the 7B model built once), fitted to
    # nothing. 7B nf4 at rank 64 (its persistence threshold, 8·r·h, keeps k/v and every adapter whole;
    # the live-parameter cap is the same) and at one 8k row (8K tokens per GPU: layers released but still
    # queued join the gathers' pool). The benchmark's kernels (varlen attention, Liger's), named so that
    # a dry run predicts what the run does.
    "held-out-n": [
        Case("qwen2.5-7b", "lora", 3, workers=2, micro_batch=1, seq_len=4096, data="mix", checkpointing=True, quantization="nf4",
             rank=64, steps=3, extra=("model.attn_implementation=varlen", "model.kernels=liger")),
        Case("qwen2.5-7b", "lora", 3, workers=2, micro_batch=1, seq_len=8192, data="mix", checkpointing=True, quantization="nf4",
             steps=3, extra=("model.attn_implementation=varlen", "model.kernels=liger")),
    ],
    "tiny": [Case("tiny", "lora", 2, workers=2, micro_batch=32, seq_len=512, gpu=False, steps=4),
             Case("tiny", "lora", 3, "all", workers=2, micro_batch=8, seq_len=128, gpu=False, steps=4)],
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", choices=sorted(CASES), default="gpu", help="case list (default: gpu)")
    parser.add_argument("--only", action="append", default=[], help="run cases whose name contains this (repeatable)")
    parser.add_argument("--out", type=Path, default=Path("calibration"), help="folder for the CSV, the Markdown and the runs")
    parser.add_argument("--resume", action="store_true", help="skip cases already in the CSV")
    parser.add_argument("--max-minutes", type=float, help="start no new case after this many minutes")
    parser.add_argument("--dry-run", action="store_true", help="print the cases and their predictions; run nothing")
    parser.add_argument("--held-out", action="store_true",
                        help="held-out check: data-aware predictions, rows in <out>/memory_heldout.{csv,md}, no constants fitted")
    parser.add_argument("--memory-trace", action="store_true",
                        help="record each case's CUDA allocator history (train.memory_snapshot_dir) and write it up "
                             "in <out>/traces/<case>.memory.txt (bench/memory_trace.write_up)")
    parser.add_argument("--models", type=Path, help="folder for the random-init models (default: $ZEROLAB_CACHE/calibration)")
    parser.add_argument("--recompute", type=Path, nargs="+", metavar="CSV",
                        help="no runs: merge these CSVs, predict every row again with the current Calibration, "
                             "and write <out>/memory_calibration.{csv,md}; with --held-out: held-out rows, data-aware, "
                             "into <out>/memory_heldout.md")
    args = parser.parse_args(argv)

    if args.recompute and args.held_out:
        rows = [recompute_held_out(r) for r in _read_rows_many(args.recompute)]
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "memory_heldout.md").write_text(report(rows, fit=False))
        print(report(rows, fit=False))
        return 0
    if args.recompute:
        rows = [recompute(r) for r in _read_rows_many(args.recompute)]
        args.out.mkdir(parents=True, exist_ok=True)
        csv_path = args.out / "memory_calibration.csv"
        csv_path.unlink(missing_ok=True)
        for row in rows:
            _append_row(csv_path, row)
        (args.out / "memory_calibration.md").write_text(report(rows))
        print(report(rows))
        return 0

    cases = [c for c in CASES[args.cases] if not args.only or any(o in c.name for o in args.only)]
    if args.dry_run:
        for case in cases:
            est = _predict(case, args.out)
            print(f"{case.name:55s} GPU alloc {est['pred_gpu_alloc_gib']:7.2f}  reserved {est['pred_gpu_reserved_gib']:7.2f}  "
                  f"host workers {est['pred_host_workers_gib']:7.2f}  node {est['pred_node_total_gib']:7.2f} GiB")
        return 0

    # The cases record to an MLflow file store, as the benchmark's runs do (bench/harness.py's FILE_STORE_ENV).
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    args.out.mkdir(parents=True, exist_ok=True)
    csv_path = args.out / ("memory_heldout.csv" if args.held_out else "memory_calibration.csv")
    done = {row["case"] for row in _read_rows(csv_path)} if args.resume else set()
    if not args.resume and csv_path.exists():
        csv_path.unlink()
    start = time.monotonic()
    for case in cases:
        if case.name in done:
            continue
        if args.max_minutes and time.monotonic() - start > 60 * args.max_minutes:
            print(f"stopping: --max-minutes {args.max_minutes:g} reached; rerun with --resume to go on")
            break
        row = run_case(case, args.out, args.models, data_aware=args.held_out, memory_trace=args.memory_trace)
        _append_row(csv_path, row)
        print(f"{case.name}: {row['status']} | GPU alloc {row.get('pred_gpu_alloc_gib')} vs {row.get('meas_gpu_alloc_gib')} | "
              f"host {row.get('pred_host_workers_gib')} vs {row.get('meas_host_workers_gib')} GiB", flush=True)
    rows = _read_rows(csv_path)
    md = csv_path.with_suffix(".md")
    md.write_text(report(rows, fit=not args.held_out))
    print(f"wrote {csv_path} and {md}")
    return 0 if all(r["status"] == "ok" for r in rows) else 1


def model_path(shape: str, root: Path | None = None) -> str:
    """A loadable folder (or built-in id) with the shape's architecture and random weights."""
    from zerolab import cache_dir
    from zerolab.config import BUILTIN_TINY_MODEL

    if SHAPES[shape] is None:
        return BUILTIN_TINY_MODEL
    return str(random_init_model(shape, root or cache_dir() / "calibration"))


def random_init_model(shape: str, root: Path) -> Path:
    """Build once (bf16, safetensors shards of :data:`SHARD_SIZE` like hub checkpoints) the random-init model of
    ``shape`` with the built-in tiny model's tokenizer and chat template; its token ids all fall
    inside the real vocabulary, whose full size keeps the logits realistic. Offline."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from zerolab.models import KNOWN_CONFIGS

    target = root / f"random-{shape}"
    if (target / "complete").is_file():
        return target
    tokenizer = shape_tokenizer()
    config_max = tokenizer.model_max_length
    config = Qwen2Config(**KNOWN_CONFIGS[SHAPES[shape]], max_position_embeddings=config_max, rope_theta=1_000_000.0, bos_token_id=None,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # a GPU initialises 7B in seconds
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    partial = root / f".random-{shape}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial, max_shard_size=SHARD_SIZE)
    tokenizer.save_pretrained(partial)
    (partial / "complete").write_text("")
    del model
    torch.cuda.empty_cache()  # the caller goes on to start the runs that need this GPU's memory
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
    return target


def shape_tokenizer() -> Any:
    """The tokenizer every random-init model carries: the built-in tiny model's, with the shapes'
    context (32k tokens, not the tiny model's 2048)."""
    from transformers import AutoTokenizer

    from zerolab.models import build_tiny_model

    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model())
    tokenizer.model_max_length = SHAPE_POSITIONS
    return tokenizer


def _predict(case: Case, out: Path) -> dict[str, float]:
    return predict_overrides(estimate_overrides(case.overrides("unused", out)), case.shape)


def estimate_overrides(overrides: list[str]) -> list[str]:
    """The overrides that decide the estimate, without paths that exist only where the run ran:
    data files become the generated task data of the same row count (no eval split where the run
    had none: a train file alone has none, `DataSpec.has_eval_split`), the model its shape."""
    drop = ("model.name_or_path=", "data.train_path=", "data.eval_path=", "run.", "tracking.")
    kept = [o for o in overrides if not o.startswith(drop)]
    files_only = any(o.startswith("data.train_path=") for o in overrides) and not any(o.startswith("data.eval_path=") for o in overrides)
    return [("data.task=math_sum" if o == "data.task=custom" else o) for o in kept] + (["data.num_eval_rows=0"] if files_only else [])


def resolved_overrides(overrides: list[str]) -> list[str]:
    """``overrides`` with ``model.kernels=auto`` (or no setting) replaced by what it resolves to on
    this machine, so that predicting them again elsewhere gives the estimate of the run made here."""
    from zerolab.kernels import use_liger

    kept = [o for o in overrides if not o.startswith("model.kernels=")]
    given = [o.split("=", 1)[1] for o in overrides if o.startswith("model.kernels=")]
    kernels = given[-1] if given else "auto"
    gpu = "scaling.use_gpu=true" in overrides
    if kernels == "auto":
        kernels = "liger" if use_liger("auto", use_gpu=gpu) else "none"
    return [*kept, f"model.kernels={kernels}"]


def shape_model_config(shape: str) -> Any:
    """The Hugging Face config of a benchmark shape, without its files (the tiny model's is built),
    with the sizes of the weights files :func:`random_init_model` saves for it (bf16, shards of
    :data:`SHARD_SIZE`), as the runs' own preflight read them."""
    from zerolab.checkpoint_files import CHECKPOINT_FILES_KEY
    from zerolab.config import load_config
    from zerolab.memory import ModelShape
    from zerolab.memory.shapes import checkpoint_layout
    from zerolab.models import KNOWN_CONFIGS, load_model_config

    shape_id = SHAPES[shape]
    if not shape_id:
        return load_model_config(load_config(None, []).model)
    config = dict(model_type="qwen2", dtype="bfloat16", **KNOWN_CONFIGS[shape_id])
    return {**config, CHECKPOINT_FILES_KEY: checkpoint_layout(ModelShape.from_config(config), 2, SHARD_SIZE)}


def predict_overrides(overrides: list[str], shape: str, calibration: Any = None, data: Any = None) -> dict[str, float]:
    """The estimate's figures for a run of ``shape`` configured by ``overrides`` (no paths needed)."""
    from zerolab.config import load_config
    from zerolab.memory import DEFAULT_CALIBRATION, GIB, estimate

    cfg = load_config(None, estimate_overrides(overrides))
    est = estimate(cfg, shape_model_config(shape), calibration=calibration or DEFAULT_CALIBRATION, data=data)
    gpu, workers = cfg.scaling.use_gpu, cfg.world_size()
    imports = {} if gpu else {"host_imports_gib": est.host_worker["worker process"] / GIB - est.calibration.host_process_cpu_bytes / GIB}
    host = est.host_workers_before_save(workers)
    return {"pred_gpu_alloc_gib": est.device_peak / GIB if gpu else 0.0,
            "pred_gpu_reserved_gib": est.device_reserved / GIB if gpu else 0.0,
            "pred_host_workers_gib": host / GIB, "pred_node_total_gib": est.host_total(workers) / GIB,
            "base_framework_gib": est.calibration.framework_device_bytes / GIB if gpu else 0.0,
            "base_host_process_gib": (est.calibration.host_process_gpu_bytes if gpu else est.calibration.host_process_cpu_bytes) / GIB,
            **imports}


def recompute(row: dict[str, str]) -> dict[str, str]:
    """``row`` with its predictions and errors from the current Calibration (measurements kept)."""
    if not row.get("overrides") or row.get("status") != "ok":
        return row
    out = dict(row)
    out.update({k: round(v, 3) for k, v in predict_overrides(json.loads(row["overrides"]), row["shape"], _measured_here(row)).items()})
    out.update(error_pct(out))
    return out


def _measured_here(row: dict[str, str]) -> Any:
    """The current Calibration with a CPU row's own measured imports (None: this machine's)."""
    from zerolab.memory import DEFAULT_CALIBRATION, GIB

    if not row.get("host_imports_gib"):
        return None
    return dataclasses.replace(DEFAULT_CALIBRATION, host_imports_cpu_bytes=int(float(row["host_imports_gib"]) * GIB))


def recompute_held_out(row: dict[str, str]) -> dict[str, str]:
    """A held-out ``row`` predicted again by the current estimator as its run's preflight did, from
    the shards of the case's data (tokenized here with the tokenizer every random-init model
    carries; no weights needed), measurements kept."""
    from zerolab import cache_dir
    from zerolab.config import load_config
    from zerolab.plan import job_shard_lengths

    case = next((c for cases in CASES.values() for c in cases if c.name == row["case"]), None)
    if case is None or row.get("status") != "ok":
        return row
    tokenizer_only = cache_dir() / "calibration" / "tokenizer-only"
    if not (tokenizer_only / "tokenizer_config.json").is_file():
        shape_tokenizer().save_pretrained(tokenizer_only)
    out_dir = cache_dir() / "calibration" / "recompute"
    data = job_shard_lengths(load_config(None, case.overrides(str(tokenizer_only), out_dir)))
    out = dict(row)
    out.update({k: round(v, 3) for k, v in predict_overrides(json.loads(row["overrides"]), row["shape"], _measured_here(row),
                                                               data=data).items()})
    out.update(error_pct(out))
    return out


def error_pct(row: dict[str, Any]) -> dict[str, str]:
    """Prediction errors in percent of the measurement: GPU allocated, GPU reserved, host."""
    return {key: _err(row.get(pred), row.get(meas)) for key, pred, meas in (
        ("err_gpu_alloc_pct", "pred_gpu_alloc_gib", "meas_gpu_alloc_gib"),
        ("err_gpu_reserved_pct", "pred_gpu_reserved_gib", "meas_gpu_reserved_gib"),
        ("err_host_pct", "pred_host_workers_gib", "meas_host_workers_gib"))}


def run_case(case: Case, out: Path, models: Path | None = None, *, data_aware: bool = False,
             memory_trace: bool = False) -> dict[str, Any]:
    """Train ``case`` and return its CSV row (status ``failed: ...`` when the run fails). ``data_aware``:
    predict from the shards of the case's data, as the run's preflight does (such rows cannot be
    predicted again from their overrides alone). ``memory_trace``: the workers' allocator histories,
    written up in ``<out>/traces/<case>.memory.txt``."""
    from zerolab.config import load_config
    from zerolab.errors import root_cause
    from zerolab.run import run_sft

    row: dict[str, Any] = {"case": case.name, "device": _device_name(case.gpu), "workers": case.workers, "shape": case.shape,
                           "overrides": json.dumps(resolved_overrides(estimate_overrides(case.overrides("unused", out))))}
    started = time.monotonic()
    try:
        path = model_path(case.shape, models)
        traces = out / "traces" / case.name
        cfg = load_config(None, [*case.overrides(path, out), *([f"train.memory_snapshot_dir={traces}"] if memory_trace else [])])
        data = None
        if data_aware:
            from zerolab.plan import job_shard_lengths

            data = job_shard_lengths(cfg)
        row.update({k: round(v, 3) for k, v in predict_overrides(estimate_overrides(case.overrides("unused", out)), case.shape,
                                                                 data=data).items()})
        with NodeMemorySampler() as node:
            result = run_sft(cfg, restart=True)
        metrics = result.metrics
        row["meas_gpu_alloc_gib"] = round(metrics.get("mem/gpu_peak_allocated_gib", 0.0), 3)
        row["meas_gpu_reserved_gib"] = round(metrics.get("mem/gpu_peak_reserved_gib", 0.0), 3)
        row["meas_host_workers_gib"] = round(metrics["mem/host_rss_peak_gib"], 3)
        row["meas_node_used_gib"] = round(node.peak_gib, 3)
        row["status"] = "ok"
        if memory_trace:
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            from memory_trace import write_up

            write_up(traces, traces.parent / f"{case.name}.memory.txt")
    except Exception as exc:  # a failed case (OOM, say) is a result too: record it and go on
        row["status"] = f"failed: {root_cause(exc)[:200]}"
    finally:
        shutil.rmtree(out / "runs", ignore_errors=True)  # 7B checkpoints would fill the disk
    row["seconds"] = round(time.monotonic() - started)
    row.update(error_pct(row))
    return row


class NodeMemorySampler:
    """Samples the node's used memory (total - available) every 0.2 s while a run lasts."""

    def __init__(self) -> None:
        self.peak_gib = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        import psutil

        while not self._stop.is_set():
            vm = psutil.virtual_memory()
            self.peak_gib = max(self.peak_gib, (vm.total - vm.available) / 1024**3)
            self._stop.wait(0.2)

    def __enter__(self) -> NodeMemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _device_name(gpu: bool) -> str:
    import torch

    return torch.cuda.get_device_name(0) if gpu and torch.cuda.is_available() else "cpu"


def _err(pred: Any, meas: Any) -> str:
    try:
        pred, meas = float(pred), float(meas)
    except (TypeError, ValueError):
        return ""
    return f"{100 * (pred - meas) / meas:+.1f}" if meas else ""


def _read_rows_many(paths: list[Path]) -> list[dict[str, str]]:
    return [row for path in paths for row in _read_rows(path)]


def _read_rows(path: Path) -> list[dict[str, str]]:
    if not path.is_file():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _append_row(path: Path, row: dict[str, Any]) -> None:
    new = not path.is_file()
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        if new:
            writer.writeheader()
        writer.writerow({k: row.get(k, "") for k in COLUMNS})


def fit_calibration(rows: list[dict[str, str]]) -> dict[str, float]:
    """Fit the stack-dependent constants to the measured rows. ``framework_device_bytes`` moves
    every GPU prediction by the same amount: its fit is the current value plus the median residual.
    Reserved memory is the allocated peak plus the larger of a share of it and the largest block
    the estimate expects cached (``zerolab.memory.terms.cached_blocks``): the share's constant
    (``zerolab.memory.terms.reserved_share``: ``reserved_factor`` at ZeRO 0-2, ``reserved_factor_int8``, ``reserved_factor_zero3``)
    is the median of measured reserved / allocated over the rows without parameter offload where the
    estimate takes that constant and the share is the larger (not ZeRO-3's stream pools, ``terms.stream_pools``); ``reserved_param_offload_factor``
    the median of measured (reserved − allocated) / the largest gathered parameter's bytes over the
    rows with parameter offload where those buffers are the largest cached block. On GPU what a
    worker holds before a lazy load (``host_gpu_before_load_bytes``) is the smallest value that
    leaves no row more than 5% under (:func:`_fit_gpu_host`); on CPU the rest of a worker's
    baseline beyond its measured imports (``host_process_cpu_bytes``) is the current value plus the
    median residual per worker."""
    from zerolab.memory import DEFAULT_CALIBRATION

    ok = [r for r in rows if r.get("status") == "ok"]
    gpu = [r for r in ok if float(r["meas_gpu_alloc_gib"] or 0) > 0]
    fitted: dict[str, float] = {}
    if gpu:
        fitted["framework_device_bytes"] = max(0.0, statistics.median(
            float(r["meas_gpu_alloc_gib"]) - float(r["pred_gpu_alloc_gib"]) + float(r["base_framework_gib"]) for r in gpu)) * 1024**3
        cal = DEFAULT_CALIBRATION
        with_overrides = [r for r in gpu if r.get("overrides")]
        by_share: dict[str, list[dict[str, str]]] = {}
        for r in with_overrides:
            est = _estimate_of(r)
            share = est.device_peak + int(est.device_peak * (est.reserved_factor - 1))
            if not _param_offload(r) and share >= est.device_peak + max(est.device_cached.values(), default=0) and share == est.device_reserved:
                by_share.setdefault(est.reserved_share, []).append(r)
        for key, rows_of_key in by_share.items():
            fitted[key] = statistics.median(float(r["meas_gpu_reserved_gib"]) / float(r["meas_gpu_alloc_gib"]) for r in rows_of_key)
        ratios = []
        for r in with_overrides:
            if not (_zero3(r) and _param_offload(r)):
                continue
            est = _estimate_of(r)
            gathered = est.device_cached.get("gathered parameter buffers", 0)
            if gathered and gathered == max(est.device_cached.values()):
                largest = gathered / cal.reserved_param_offload_factor
                ratios.append((float(r["meas_gpu_reserved_gib"]) - float(r["meas_gpu_alloc_gib"])) * 1024**3 / largest)
        if ratios:
            fitted["reserved_param_offload_factor"] = max(0.0, statistics.median(ratios))
        fitted.update(_fit_gpu_host(with_overrides))
    cpu = [r for r in ok if r not in gpu]
    if cpu:
        fitted["host_process_cpu_bytes"] = statistics.median(
            (float(r["meas_host_workers_gib"]) - float(r["pred_host_workers_gib"])) / int(r["workers"]) + float(r["base_host_process_gib"])
            for r in cpu) * 1024**3
    return fitted


def _estimate_of(row: dict[str, str], calibration: Any = None) -> Any:
    """The estimate of ``row``'s run from its overrides (not data-aware)."""
    from zerolab.config import load_config
    from zerolab.memory import DEFAULT_CALIBRATION, estimate

    return estimate(load_config(None, estimate_overrides(json.loads(row["overrides"]))), shape_model_config(row["shape"]),
                    calibration=calibration or DEFAULT_CALIBRATION)


def _zero3(row: dict[str, str]) -> bool:
    return "deepspeed.stage=3" in json.loads(row.get("overrides") or "[]")


def _param_offload(row: dict[str, str]) -> bool:
    return "deepspeed.offload_param=true" in json.loads(row.get("overrides") or "[]")


def _fit_gpu_host(rows: list[dict[str, str]]) -> dict[str, float]:
    """``host_gpu_before_load_bytes``: the smallest value with which no GPU row whose workers load
    their checkpoint lazily (ZeRO 0-2 in its dtype) or load a quantized base is predicted more than 5% under its measured
    host figure. Each such row's prediction is the larger of its load phase, linear in the constant
    (once per worker), and the phases that do not depend on it, so each row bounds it from below."""
    from zerolab.memory import DEFAULT_CALIBRATION, MIB

    zero = dataclasses.replace(DEFAULT_CALIBRATION, host_gpu_before_load_bytes=0)
    unit = dataclasses.replace(zero, host_gpu_before_load_bytes=MIB)
    bounds = []
    for r in rows:
        est = _estimate_of(r, zero)
        if est.host_worker_phases["model load"] == _estimate_of(r, unit).host_worker_phases["model load"]:
            continue  # no lazy load: the constant does not enter
        target = 0.95 * float(r["meas_host_workers_gib"]) * 1024**3
        workers, value = est.world_size, 0.0
        while _host_with(est, workers, value) < target:
            value += max((target - _host_with(est, workers, value)) / workers, MIB)
        bounds.append(value)
    return {"host_gpu_before_load_bytes": max(bounds)} if bounds else {}


def _host_with(est: Any, workers: int, before_load: float) -> float:
    """``est.host_workers_before_save(workers)`` with ``before_load`` more in each worker's model-load phase."""
    rank0 = max(v + (before_load if k == "model load" else 0) for k, v in est.host_worker_phases.items() if k != "checkpoint save")
    other = max(v + (before_load if k == "model load" else 0) for k, v in est.host_other_worker_phases.items())
    return rank0 + (workers - 1) * other


def report(rows: list[dict[str, str]], *, fit: bool = True) -> str:
    """The Markdown report: measured vs predicted per case, error summary, fitted constants (``fit``)."""
    lines = [
        "| case | device | GPU allocated pred / meas (err) | GPU reserved pred / meas (err) | host workers pred / meas (err) | node total pred / used | s | status |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        def cell(pred: str, meas: str, err: str) -> str:
            return f"{pred} / {meas} ({err}%)" if err else "—"

        lines.append(f"| {r['case']} | {r['device']} | {cell(r['pred_gpu_alloc_gib'], r['meas_gpu_alloc_gib'], r['err_gpu_alloc_pct'])} | "
                     f"{cell(r['pred_gpu_reserved_gib'], r['meas_gpu_reserved_gib'], r['err_gpu_reserved_pct'])} | "
                     f"{cell(r['pred_host_workers_gib'], r['meas_host_workers_gib'], r['err_host_pct'])} | "
                     f"{r['pred_node_total_gib'] or '—'} / {r['meas_node_used_gib'] or '—'} | {r['seconds']} | {r['status']} |")
    errors = {k: [abs(float(r[k])) for r in rows if r.get(k)] for k in ("err_gpu_alloc_pct", "err_gpu_reserved_pct", "err_host_pct")}
    lines += ["", "All figures GiB. Worst absolute errors: " + ", ".join(
        f"{k.removeprefix('err_').removesuffix('_pct')} {max(v):.1f}%" for k, v in errors.items() if v) + "."]
    fitted = fit_calibration(rows) if fit else {}
    if fitted:
        args = ", ".join(f"{k}={v:.3f}" if "factor" in k else f"{k}={int(v / 2**20)} * MIB" for k, v in fitted.items())
        lines += ["", "Constants fitted to these rows (paste into `zerolab.memory.Calibration` and rerun to see the errors after the fit):",
                  "", f"    Calibration({args})"]
    return "\n".join(lines) + "\n"


__all__ = ["CASES", "Case", "error_pct", "resolved_overrides", "fit_calibration", "main", "predict_overrides", "random_init_model", "recompute", "report",
           "run_case"]

if __name__ == "__main__":
    sys.exit(main())

