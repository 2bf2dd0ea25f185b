"""Calibration: every term of the estimate that measurement, not arithmetic, decides.

:class:`Calibration` holds the constants fitted with ``bench/calibrate_memory.py``
(``docs/calibration/memory_calibration.md``); :func:`worker_imports_rss` measures, once per
environment, what the software a CPU worker imports holds.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import zerolab
from zerolab.memory.units import GIB, KIB, MIB

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """Constants of the estimate that depend on the software stack rather than on the model's
    arithmetic. GPU values are fitted to the runs in ``docs/calibration/memory_calibration.md``
    (H100, 2 × and 4 × H200, torch 2.11, DeepSpeed 0.19.8, Ray 2.60; ``bench/calibrate_memory.py``
    measures and fits them); CPU values were measured on the test machine."""

    framework_device_bytes: int = 93 * MIB
    """GPU memory that torch and DeepSpeed allocate through torch's allocator besides the model's
    tensors: cuBLAS workspaces, communication staging tensors, RNG state, bookkeeping tensors
    (fitted: the median residual of the measured allocated peaks)."""
    reserved_factor: float = 1.003
    """Peak reserved / peak allocated of torch's caching allocator at ZeRO 0-2, with the expandable
    segments zerolab's workers use (``zerolab.cluster.CUDA_ALLOC_CONF``): the median of the calibration
    runs whose reserved memory no single large block decides (1.001-1.004 with LoRA). With
    fixed-size blocks it was 1.01-2.8. Where a step frees and re-allocates blocks larger than this
    share of the peak (full fine-tuning's fp32 logits and flat gradient copy:
    :func:`~zerolab.memory.terms.cached_blocks`), the largest of them is what is cached instead."""
    reserved_factor_int8: float = 1.026
    """The same at ZeRO 0-2 with an int8 base, whose products allocate and free the input's fp16 and
    int8 copies, its outlier columns and the weight in fp16 at every projection (measured 1.026, 7B
    at one 4k row with checkpointing on one H100, lease h100x2-55: the value. Held out, 14B over two
    H200s, h200x2-63: 1.056 measured, the estimate −4.0%)."""
    reserved_factor_zero3: float = 1.049
    """The same under ZeRO-3, which gathers and frees every frozen weight each pass (measured
    1.04-1.06 with LoRA without parameter offload)."""
    gather_pending_layers_per_doubling: float = 4.0
    """ZeRO-3 without parameter offload: decoder layers' gathered weights that the all-gather stream's
    pool still holds after DeepSpeed released them, for each doubling of a GPU's tokens per micro-batch
    past 4,096 (at most :attr:`gather_pending_layers_max`: :func:`~zerolab.memory.terms.gather_pending`).
    The host releases a layer once it has queued its kernels; the block is reusable only once the GPU
    has run them, so the further the GPU lags (the longer its work per layer), the more released
    layers the pool holds. Traced (7B split over two H200s at 32K rows, lease h200x2-81): 3.8 GiB
    allocated and 5.2 pending free at that pool's peak. Fitted to the reserved peaks of the 7B's
    runs at 8K-64K tokens per GPU (h200x4-65, h200x2-72, h200x2-82, h100x2-84) beside the rest of the
    pool (:func:`~zerolab.memory.terms.gather_stream_held`: the gathered weights and the flat buffers
    they are copied out of): 1.6-4.9 layers per doubling by run (four 4k rows the fewest, a 32K row
    split over two H100s the most); 4 keeps each of them from −3.2% to +4.6%. (It was 5 when the pool
    counted the gathered weights alone.)"""
    gather_pending_layers_max: float = 17.5
    """The most released layers the all-gather stream's pool holds however long the GPU's work per
    layer: the host runs ahead of the GPU only as far as CUDA's queue of launched work lets it, so
    past some length the count stops growing. Traced at 117,760 tokens per GPU (7B, a 235K row split
    over two H100s, lease h100x2-84): 6.55 GiB pending, 15.1 layers, where the count per doubling
    gives 24; the most measured, 17.5 layers at 64K tokens per GPU (h200x4-65), is the bound."""
    reserved_param_offload_factor: float = 1.54
    """ZeRO-3 with parameter offload: the allocator keeps the buffers of the largest gathered
    parameter cached between its uses (its partition copied from the host and its gathered whole),
    this many times its 16-bit size (:func:`~zerolab.memory.terms.largest_gathered`; fitted: the
    median of measured (reserved − allocated) / that size over the calibration runs where it is
    the largest cached block: 1.28 and 1.79 on the 7B LoRA runs of 2 and 1 GPUs, whose embeddings
    are 1.0 GiB; held out, 1.8-2.0 on 0.5B LoRA runs of 1,104 tokens, whose embeddings are 0.25
    GiB). A constant fitted to the 7B runs (1,354 MiB) over-counted the 0.5B shape by 0.6-1.0 GiB."""
    cuda_context_bytes: int = 600 * MIB
    """Per GPU process, outside torch's allocator (so not in ``mem/gpu_*``, but on the card): CUDA
    context, loaded kernel images, cuBLAS/cuDNN handles."""
    nccl_bytes: int = 512 * MIB
    """Per GPU process when world size > 1, outside torch's allocator: NCCL communicator buffers."""
    host_imports_cpu_bytes: int | None = None
    """Host RSS of the software a worker training on CPU imports (:data:`WORKER_IMPORTS`: Python,
    torch, DeepSpeed, transformers, peft, Ray Train and Ray Data), which depends on what is
    installed rather than on the job: None measures it in this environment
    (:func:`worker_imports_rss`: 600 MiB with torch 2.13.0+cpu on the 2-core machine, where
    :data:`DEFAULT_IMPORTS_CPU_BYTES` stands in when it cannot be measured). torch's CUDA build
    alone holds 491 MiB once imported against 220 MiB for its CPU build (torch 2.11.0+cu130 with no
    GPU visible; 2.13.0+cpu), which a constant fitted on one of them cannot follow."""
    host_process_cpu_bytes: int = 131 * MIB
    """Host RSS of one Ray Train worker training on CPU beyond its imports and its tensors: Ray's
    worker runtime, the gloo process group, DeepSpeed's engine, MLflow's client and system-metrics
    monitor (rank 0's runs 50-56 MiB above the other ranks'). Fitted: the median residual of the
    default job and the DoRA ZeRO-3 NER job on the 2-core machine (docs/calibration/heldout.md)."""
    host_process_gpu_bytes: int = 2105 * MIB
    """The same on a GPU worker: adds the CUDA runtime and the host side of the CUDA context, cuBLAS,
    cuDNN and NCCL (fitted to LoRA runs of the 0.5B and 7B shapes together with the lazy load's
    former share of the checkpoint). It is the training phase's baseline, the peak with optimizer
    offload and under ZeRO-3; a lazy load's phase has its own (``host_gpu_before_load_bytes``)."""
    host_gpu_before_load_bytes: int = 1425 * MIB
    """What a GPU worker holds before it reads a checkpoint that loads lazily (ZeRO 0-2, the
    checkpoint in the training dtype), besides its data shard: the process, its imports and the host
    side of the CUDA context, before the kernel images and library state of the first steps. The
    load adds the checkpoint's largest file, whose pages stay resident until its last tensor has
    gone to the GPU. The runs put it at 1.05-1.17 GiB (1.5B, one 2.875 GiB file; 7B held out, four
    files of at most 4.59 GiB), 1.35-1.53 GiB (7B, ``jobs/benchmark.py``'s runs) and up to 1.47 GiB
    (0.5B, one 0.92 GiB file, where the load is the peak too); fitted as the smallest value that
    leaves none of the 29 stored GPU runs with a lazy load more than 5% under
    (docs/calibration/heldout.md)."""
    host_gpu_first_steps_bytes: int = 460 * MIB
    """The part of ``host_process_gpu_bytes`` that comes only with the first training steps (the
    kernel images and library state the CUDA runtime loads as each is first used), so is not yet
    resident while a process reads the whole checkpoint: traced (``bench/torchrun_loop.py
    --rss-trace``, 0.5B ZeRO-3 on one H100, lease h100-23) 1.76 GiB at the end of the load, 2.22-2.23
    GiB after the first steps; the 0.43-0.48 GiB by which such loads were over-predicted
    (docs/calibration/heldout.md, set D)."""
    host_load_factor: float = 1.0
    """Host RSS of loading the weights, as a multiple of the bytes read, where the whole checkpoint
    is held on the host at once: CPU training, rank 0 under ZeRO-3 (it reads the checkpoint,
    then partitions it), and ZeRO 0-2 on GPU converting the checkpoint's dtype on the way to the GPU
    (its files' pages stay mapped until the load ends). ``from_pretrained`` maps the safetensors
    files and pages come in as they are read; a dtype conversion on the host adds a private copy.
    Measured +1.0× on CPU and under ZeRO-3 on GPU; 0.93× (7B) and 0.4-0.5× (0.5B) converting to
    the GPU. A lazy load under ZeRO 0-2 on GPU holds the largest file instead
    (``host_gpu_before_load_bytes``)."""
    host_cpu_tensor_factor: float = 1.5
    """CPU training only: worker RSS growth / peak bytes of live tensors. glibc keeps freed heap
    chunks of activation-sized tensors mapped, so RSS runs ahead of what is allocated, by an
    amount that depends on the allocation pattern: measured 1.2× (full fine-tuning), 1.24× (LoRA,
    packed) and 1.5× (DoRA, padded) in Ray runs of the tiny model with 8-16k-token micro-batches
    (docs/calibration/heldout.md). With a fixed mmap threshold (``MALLOC_TRIM_THRESHOLD_=0`` or
    ``MALLOC_MMAP_THRESHOLD_=65536`` in the workers' environment) glibc returns them and RSS follows
    the live tensors (1.0-1.13×), but CPU steps took 30-65% longer on the 2-core machine."""
    host_cpu_tensor_factor_checkpointing: float = 2.7
    """The same with gradient checkpointing, whose forward pass allocates and frees every layer's
    activations and whose backward pass does it again, one layer at a time, beside the saved
    inputs: glibc keeps far more than the (smaller) live peak. Measured 2.15-2.67× in Ray runs
    (LoRA, full and DoRA; 2.85-3.6× in one process without DeepSpeed), 1.13× with a fixed mmap
    threshold; fitted as the highest of the Ray runs, so that they are not under-predicted."""
    host_ray_node_bytes: int = 3 * GIB
    """Per node, outside the training workers (so not in ``mem/host_rss_peak_gib``): raylet, GCS,
    dashboard, the driver with its tokenizer and Ray Data, idle pooled Ray workers."""
    host_row_bytes: int = 400
    """Host bytes per tokenized row held by a worker beyond its token ids and labels (Python and
    numpy object overhead); the ids and labels add 16 bytes per token (two int64 arrays)."""


DEFAULT_CALIBRATION = Calibration()

WORKER_IMPORTS = ("zerolab.train", "ray.train.torch", "ray.data", "deepspeed", "peft")
"""What a worker has imported by its first step: ``zerolab.train`` (torch, transformers, Ray
Train) and what it imports where it builds the engine, the adapter and its data shard."""

DEFAULT_IMPORTS_CPU_BYTES = 600 * MIB
""":data:`WORKER_IMPORTS`' RSS with torch 2.13.0+cpu on the 2-core machine, where
:func:`worker_imports_rss` cannot measure it."""


@functools.lru_cache(maxsize=1)
def _environment() -> tuple[str, dict[str, str | None]]:
    """This environment's key (this Python, the packages' versions, zerolab's) and the package
    versions in it: what a kept measurement of :func:`worker_imports_rss` belongs to."""
    versions: dict[str, str | None] = {}
    for package in ("torch", "deepspeed", "transformers", "peft", "ray", "numpy", "pyarrow"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    key = hashlib.sha256(json.dumps([sys.executable, sys.version, versions, zerolab.__version__, WORKER_IMPORTS]).encode()).hexdigest()
    return key[:32], versions


def _baseline_file() -> Path:
    """Where :func:`worker_imports_rss` keeps its measurement for this environment."""
    return zerolab.cache_dir() / "host_baseline" / f"{_environment()[0]}.json"


_probe: subprocess.Popen | None = None
"""The measuring process :func:`measure_worker_imports_meanwhile` started, until
:func:`worker_imports_rss` reads it."""


def _start_probe() -> subprocess.Popen:
    code = f"import {', '.join(WORKER_IMPORTS)}\nprint(open('/proc/self/status').read())"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _stop_probe() -> None:
    if _probe is not None and _probe.poll() is None:
        _probe.kill()


def measure_worker_imports_meanwhile() -> None:
    """Start :func:`worker_imports_rss`'s measurement now, in the background, where this
    environment has none kept: a CPU job calls this at its start, so that the measuring process
    imports beside the job's own imports and Ray's start instead of after them (a machine's first
    CPU job: 6-10 s of the 2-core machine's start-up, which Ray's start mostly spends waiting)."""
    global _probe
    if _probe is None and not _baseline_file().is_file():
        _probe = _start_probe()
        atexit.register(_stop_probe)  # a job that never estimates its memory leaves no process behind


@functools.lru_cache(maxsize=1)
def worker_imports_rss() -> int | None:
    """RSS of a fresh Python process of this environment once it has imported
    :data:`WORKER_IMPORTS` on DeepSpeed's CPU accelerator: the part of a CPU worker's baseline that
    the installed software decides. Measured once in a subprocess (about 10 s on the 2-core machine;
    started early by :func:`measure_worker_imports_meanwhile`) and kept in ``<zerolab
    cache>/host_baseline/``, keyed by this Python and the versions of the packages (torch's names
    its build) and of zerolab; None where it cannot be measured.

    Measured on the driver, it stands for workers on nodes with the same software (a cluster's
    nodes run one image)."""
    global _probe
    path, versions = _baseline_file(), _environment()[1]
    try:
        return int(json.loads(path.read_text())["rss_bytes"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    probe: subprocess.Popen | None = None
    try:
        probe, _probe = _probe or _start_probe(), None
        out, err = probe.communicate(timeout=300)
        if probe.returncode:
            raise subprocess.CalledProcessError(probe.returncode, probe.args, out, err)
        found = re.search(r"^VmRSS:\s+(\d+) kB", out, re.MULTILINE)
        if found is None:
            raise ValueError("no VmRSS in /proc/self/status")
        rss = int(found.group(1)) * KIB
    except (OSError, ValueError, subprocess.SubprocessError) as exc:
        if probe is not None and probe.poll() is None:
            probe.kill()
        logger.warning("could not measure what a CPU worker's imports hold (%s); the host estimate takes %d MiB",
                       exc, DEFAULT_IMPORTS_CPU_BYTES // MIB)
        return None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.partial")
        partial.write_text(json.dumps({"rss_bytes": rss, "versions": versions, "python": sys.executable}))
        partial.replace(path)
    except OSError as exc:
        logger.debug("could not keep the measured import RSS in %s: %s", path, exc)
    return rss


def without_ray(calibration: Calibration = DEFAULT_CALIBRATION) -> Calibration:
    """``calibration`` for a job that trains in its own process on a machine where no Ray runs
    (``zerolab.cluster.needs_ray``): the node holds that one process, which the worker figures
    cover (measured on CPU: within ±1.2% of its RSS), and no Ray services."""
    return dataclasses.replace(calibration, host_ray_node_bytes=0)
