"""Throughput and memory figures: FLOPs per token, peak device FLOP/s, peak memory per device and node."""

from __future__ import annotations

import contextlib
import gc
import logging
import resource
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

GIB = 1024**3
MEMORY_HISTORY_ENTRIES = 2_000_000
"""Allocator events a memory snapshot keeps (the newest): 7B and 14B runs of 4-8 steps under ZeRO-3 made
100,000-330,000 from their load on (lease h200x2-81)."""

logger = logging.getLogger(__name__)

_PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "A100": 312e12, "A800": 312e12, "L40S": 362e12, "4090": 165e12}
"""Dense bf16 tensor-core peaks from the vendors' datasheets (no sparsity)."""


def peak_flops(device: torch.device) -> float:
    """Dense bf16 peak of one device, or 0 where unknown (CPU): MFU is then not reported."""
    if device.type != "cuda":
        return 0.0
    return peak_flops_of(torch.cuda.get_device_name(device))


def peak_flops_of(device_name: str) -> float:
    """Dense bf16 peak of the GPU model ``device_name`` (as CUDA names it), or 0 where unknown."""
    return next((v for k, v in _PEAK_BF16_FLOPS.items() if k in device_name), 0.0)


def train_flops_per_token(total_params: int, trainable_params: int, full: bool) -> float:
    """Matmul FLOPs per trained token: forward 2N; backward 2N for activation gradients plus 2N for
    weight gradients when every weight trains (adapters add ~6 × their own size). Attention scores
    are left out, as in the usual 6N convention."""
    if full:
        return 6.0 * total_params
    return 4.0 * total_params + 6.0 * trainable_params


def attention_train_flops_per_token(sample_tokens: int, q_dim: int, num_layers: int) -> float:
    """Attention's matmul FLOPs per trained token of a causal sample of ``sample_tokens`` tokens,
    which :func:`train_flops_per_token` leaves out: per layer QKᵀ and the weighted sum of V over
    the n²/2 query-key pairs, 2·n²·q_dim FLOPs forward, three times that with the backward, spread
    over the n tokens: 6·n·q_dim·L. At long rows the larger part (7B at 256K tokens: 1.6e11 per
    token against 3.1e10 for a LoRA's 4N + 6T)."""
    return 6.0 * sample_tokens * q_dim * num_layers


def memory_metrics(device: torch.device, ctx: Any) -> dict[str, float]:
    """Peak GPU memory of this rank and the peak host RSS summed over the workers of each node
    (the largest node's sum). A collective: every rank calls it."""
    out: dict[str, float] = {}
    if device.type == "cuda":
        peaks = torch.tensor([torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)],
                             dtype=torch.float64, device=device)
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
        out["mem/gpu_peak_allocated_gib"] = peaks[0].item() / GIB
        out["mem/gpu_peak_reserved_gib"] = peaks[1].item() / GIB
    nodes = torch.zeros(ctx.get_world_size(), dtype=torch.float64, device=device)
    nodes[ctx.get_node_rank()] = host_rss_peak_bytes()
    dist.all_reduce(nodes)
    out["mem/host_rss_peak_gib"] = nodes.max().item() / GIB
    return out


def host_rss_peak_bytes() -> int:
    """Peak resident set size of this process since it started or since :func:`reset_memory_peaks`
    (Linux's VmHWM; elsewhere ru_maxrss, reported in KiB)."""
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_memory_peaks(device: torch.device) -> None:
    """Start this process's peaks afresh (host RSS where Linux allows it, the device's allocator):
    a process that trains one run after another (the job's own process, a reused Tune actor)
    then reports each run's own peaks, not the largest of all."""
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # resets VmHWM to the current RSS
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """The training steps with every Python object made before them (imports, model, engine: 0.6-0.8
    million in a 7B job) out of the cyclic garbage collector's reach (``gc.freeze``): a full collection
    would walk them all, 0.29 s inside one measured window of a host-bound 7B QLoRA step of 0.6 s
    (h200x2-71). Reference counting still frees them; cycles among them wait for the end of the steps."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@contextlib.contextmanager
def allocator_history(folder: str, rank: int, device: torch.device) -> Iterator[None]:
    """With ``folder`` (``train.memory_snapshot_dir``) on a GPU: record the CUDA caching allocator's
    history (every allocation, free and segment mapping with its Python stack) and write it as
    ``<folder>/rank<rank>.pickle`` when the block ends, also where it ends in an error (an
    out-of-memory one included)."""
    if not folder or device.type != "cuda":
        yield
        return
    path = Path(folder).expanduser() / f"rank{rank}.pickle"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES, context="alloc", stacks="python")
    try:
        yield
    finally:
        torch.cuda.memory._dump_snapshot(str(path))
        torch.cuda.memory._record_memory_history(enabled=None)
        logger.info("CUDA allocator history of rank %d written to %s", rank, path)
