"""A worker's part of a checkpoint: what it saves (its DeepSpeed shard, its RNG state and, on rank 0,
the adapter or model in Hugging Face format), what it restores on a retry or a relaunch, and the
seeding that starts a run."""

from __future__ import annotations

import contextlib
import random
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from zerolab import adapters
from zerolab.batches import PACKER
from zerolab.checkpoints import CheckpointError
from zerolab.config import SFTConfig
from zerolab.worker_log import log_rank0, logger


@contextlib.contextmanager
def saved(engine: Any, cfg: SFTConfig, tokenizer: Any, step: int) -> Iterator[Path]:
    """Every rank saves its DeepSpeed shard (a collective) into a temporary folder, rank 0 adds the
    adapter; yields the folder once all have saved (to report it), and removes it afterwards."""
    rank = dist.get_rank()
    tmp = Path(tempfile.mkdtemp(prefix="zerolab-ckpt-"))
    try:
        # An adapter run saves only what trains: the frozen base weights are the model it started from.
        engine.save_checkpoint(str(tmp / "deepspeed"), tag="state", client_state={"step": step, "packer": PACKER},
                               exclude_frozen_parameters=cfg.adapter.is_peft())
        torch.save(rng_state(), tmp / f"rng_rank{rank}.pt")
        state = _gather_for_save(engine, full=not cfg.adapter.is_peft())
        if rank == 0:
            n = adapters.save_trained(engine.module, state, tmp / "adapter", tokenizer)
            log_rank0("saved %s (%d tensors, checked) at step %d", "adapter" if cfg.adapter.is_peft() else "model", n, step)
        dist.barrier()
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _gather_for_save(engine: Any, *, full: bool) -> dict[str, torch.Tensor]:
    """Full CPU tensors of what gets saved (rank 0; empty elsewhere). Under ZeRO-3 the parameters
    are gathered from all ranks first, which every rank must join."""
    import deepspeed

    module = engine.module
    rank0 = dist.get_rank() == 0
    if engine.zero_optimization_stage() == 3:
        if full:
            state = engine._zero3_consolidated_16bit_state_dict()
            return state if rank0 else {}
        params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=None):
            return {n: p.detach().cpu().clone() for n, p in params} if rank0 else {}
    if not rank0:
        return {}
    if full:
        return {k: v.detach().cpu() for k, v in module.state_dict().items()}
    return {n: p.detach().cpu().clone() for n, p in module.named_parameters() if p.requires_grad}


def restore(engine: Any, rank: int, checkpoint: Any, *, adapter_only: bool, packing: bool) -> int:
    """Load ``checkpoint`` (a retry's or a relaunch's); returns the step to start at."""
    if checkpoint is None:
        return 0
    with checkpoint.as_directory() as folder:
        try:
            # Adapter checkpoints hold the trained parameters only (the rest was loaded from the model).
            path, client_state = engine.load_checkpoint(str(Path(folder) / "deepspeed"), tag="state",
                                                         load_module_strict=not adapter_only)
        except (OSError, RuntimeError, KeyError, ValueError) as exc:
            raise CheckpointError(f"checkpoint {checkpoint.path} cannot be loaded ({type(exc).__name__}: {exc}); "
                                  "delete it to resume from an earlier one, or start the run over") from exc
        if path is None:
            raise CheckpointError(f"checkpoint {checkpoint.path} holds no DeepSpeed state; it is incomplete. "
                                  "Delete it to resume from an earlier one, or start the run over")
        rng_file = Path(folder) / f"rng_rank{rank}.pt"
        if rng_file.is_file():
            set_rng_state(torch.load(rng_file, weights_only=False))
    step = int(client_state["step"])
    log_rank0("resumed from %s at step %d", checkpoint.path, step)
    change = packer_change(client_state, packing=packing)
    if change and rank == 0:
        logger.warning(change)
    return step


def packer_change(client_state: dict[str, Any], *, packing: bool) -> str | None:
    """What a packed run resumed from ``client_state`` cannot reproduce, if its checkpoint's packer
    planned sequences otherwise (checkpoints before best fit recorded none: next fit)."""
    was = client_state.get("packer", "next-fit")
    if not packing or was == PACKER:
        return None
    return (f"this checkpoint was written while packing planned sequences {was}, now {PACKER}: the rest of its epoch "
            "groups that epoch's rows anew, so some of them are seen twice and others not at all (later epochs are "
            "unaffected); start the run over to train from the start instead")


def rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)

