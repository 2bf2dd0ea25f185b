"""DeepSpeed's process-level runtime as a training worker needs it: imported without what it imports
for its autotuner (:func:`zerolab.lean_imports.import_deepspeed`), a process group formed without
building an op training never uses, DeepSpeed's cached groups forgotten when a world ends, and the
lock files of interrupted op builds cleared before they hang a run."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from zerolab.worker_log import logger

SHM_COMM_OP = "deepspeed_shm_comm"
"""DeepSpeed's shared-memory all-reduce op for CPU processes: only its inference path
(``inference_all_reduce``) calls it, yet its CPU accelerator compiles it at the first process
group of every machine (about 30 s on two cores). Training never uses it, so it is not built."""

SHM_COMM_BUILDER = "ShareMemCommBuilder"
"""The op builder of :data:`SHM_COMM_OP` (``deepspeed.comm.torch.build_shm_op`` asks the accelerator for it)."""


def init_distributed(backend: str, **kwargs: Any) -> None:
    """``deepspeed.init_distributed`` without building :data:`SHM_COMM_OP` (DeepSpeed skips an op
    marked incompatible and falls back to the process group's all-reduce).

    Only an accelerator with a builder for it (DeepSpeed's CPU accelerator) would build it, and the
    mark is made there alone: DeepSpeed fills the table of compatible ops on its first read, probing
    every op builder (compilers, the GPUs; 0.5 s of an H100 host's start-up), and on CUDA nothing
    else reads it.

    On the CPU accelerator ``LOCAL_SIZE`` is set to the node's number of ranks, as DeepSpeed's own
    launcher sets it: without it the accelerator counts its devices by running ``numactl`` in a
    subprocess, which ZeRO-3 asks twice per gradient bucket (a tenth of a one-rank CPU step)."""
    from zerolab.lean_imports import import_deepspeed  # here: importing it loads transformers

    import_deepspeed()  # a worker's first import of DeepSpeed
    import deepspeed
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().get_op_builder(SHM_COMM_BUILDER) is not None:
        deepspeed.ops.__compatible_ops__[SHM_COMM_OP] = False
    if get_accelerator().device_name() == "cpu":
        os.environ["LOCAL_SIZE"] = os.environ.get("LOCAL_WORLD_SIZE", "1")
    deepspeed.init_distributed(dist_backend=backend, **kwargs)


def forget_deepspeed_groups() -> None:
    """Drop the process groups DeepSpeed cached from a destroyed world (it clones the world group
    once per process and keeps it), so the next run in this process builds them afresh."""
    from deepspeed.utils import groups

    for name, value in list(vars(groups).items()):
        if isinstance(value, dist.ProcessGroup) or type(value).__name__ == "DeviceMesh":
            setattr(groups, name, None)
        elif isinstance(value, dict) and any(isinstance(v, dist.ProcessGroup) for v in value.values()):
            value.clear()


STALE_BUILD_LOCK_S = 600
"""Older than any build of a DeepSpeed op (about a minute on two cores)."""


def clear_stale_build_locks(max_age_s: float = STALE_BUILD_LOCK_S) -> list[Path]:
    """Remove the lock files that killed just-in-time builds of DeepSpeed ops left behind.

    torch builds an op (CPU Adam for optimizer offload, the CPU accelerator's shared-memory
    collectives) under ``<extensions dir>/<op>/lock`` and every later process waits, silently and
    forever, while that file exists: a worker killed mid-build would hang every run that needs the
    op. A lock older than any build is taken for such a leftover."""
    from torch.utils.cpp_extension import get_default_build_root

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    removed = []
    for lock in [*root.glob("*/lock"), *root.glob("*/*/lock")]:
        with contextlib.suppress(FileNotFoundError):  # another worker of this node was first
            if time.time() - lock.stat().st_mtime > max_age_s:
                lock.unlink()
                logger.warning("removed %s, left by an interrupted build of a DeepSpeed op (it would wait forever)", lock)
                removed.append(lock)
    return removed
