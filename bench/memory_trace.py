"""What holds the GPU memory at a training step's peak: the CUDA caching allocator's history replayed.

``record(run)`` calls ``run`` (some training steps) with ``torch.cuda.memory._record_memory_history``
on and returns the breakdown of the allocated bytes at the highest point: what was allocated
before recording began (weights, states, buffers), and the blocks allocated during the steps that
were alive at the peak, grouped by the lines that allocated them (the two innermost frames outside ``torch``'s own
modules). ``bench/torchrun_loop.py --memory-trace`` prints it; it is how the memory estimator's
terms are checked against what a run holds.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

import torch

GIB = 1024**3


def record(run: Callable[[], Any], *, max_entries: int = 2_000_000) -> dict[str, Any]:
    """Call ``run`` under the allocator's history and return ``peak_breakdown`` of it."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=max_entries)
    try:
        run()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    result = peak_breakdown(snapshot, before, torch.cuda.current_device())
    result["max_memory_allocated"] = torch.cuda.max_memory_allocated()
    result["max_memory_reserved"] = torch.cuda.max_memory_reserved()
    return result


def peak_breakdown(snapshot: dict[str, Any], before: int, device: int = 0) -> dict[str, Any]:
    """Replay the allocation events of ``device`` from ``before`` allocated bytes; at the highest
    point, sum the live blocks allocated during the trace by allocating line."""
    events = snapshot["device_traces"][device]
    live: dict[int, dict[str, Any]] = {}
    current = peak = before
    freed_from_before = 0
    peak_live: dict[int, dict[str, Any]] = {}
    peak_index, freed_at_peak = -1, 0
    for i, ev in enumerate(events):
        action = ev["action"]
        if action == "alloc":
            live[ev["addr"]] = ev
            current += ev["size"]
            if current > peak:
                peak, peak_index, freed_at_peak = current, i, freed_from_before
                peak_live = dict(live)
        elif action == "free_completed":
            current -= ev["size"]
            if live.pop(ev["addr"], None) is None:
                freed_from_before += ev["size"]
    groups: dict[str, list[int]] = defaultdict(list)
    for ev in peak_live.values():
        groups[_site(ev.get("frames", []))].append(ev["size"])
    return {"before": before, "peak": peak, "freed_from_before_peak": freed_at_peak, "events": len(events),
            "peak_at": _site(events[peak_index].get("frames", [])) if peak_index >= 0 else "",
            "groups": sorted(((site, sum(sizes), sorted(sizes, reverse=True)) for site, sizes in groups.items()),
                             key=lambda g: -g[1])}


def _site(frames: list[dict[str, Any]], depth: int = 2) -> str:
    """The ``depth`` innermost frames outside torch's own modules (or the innermost frame), as
    ``file:line function < caller``."""
    def outside_torch(f: dict[str, Any]) -> bool:
        name = f.get("filename", "")
        return "/torch/" not in name and not name.startswith("<")

    chosen = [f for f in frames if outside_torch(f)][:depth] or frames[:1]
    return " < ".join(_frame(f) for f in chosen) or "?"


def _frame(frame: dict[str, Any]) -> str:
    path = frame["filename"]
    for marker in ("site-packages/", "site/", "platform/", "bench/"):
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    return f"{path}:{frame['line']} {frame['name']}"


def format_breakdown(result: dict[str, Any], top: int = 25) -> str:
    lines = [f"peak {result['peak'] / GIB:.3f} GiB (max_memory_allocated {result['max_memory_allocated'] / GIB:.3f}, "
             f"max_memory_reserved {result['max_memory_reserved'] / GIB:.3f}); "
             f"allocated before the trace {result['before'] / GIB:.3f} GiB, of which freed by the peak "
             f"{result['freed_from_before_peak'] / GIB:.3f}; {result['events']} events; peak at {result['peak_at']}"]
    for site, size, sizes in result["groups"][:top]:
        blocks = ", ".join(f"{n}×{s / 2**20:.1f}" for s, n in Counter(sizes).most_common(4))
        lines.append(f"  {size / GIB:8.3f} GiB  {site}  [MiB blocks: {blocks}{', …' if len(set(sizes)) > 4 else ''}]")
    rest = sum(size for _, size, _ in result["groups"][top:])
    if rest:
        lines.append(f"  {rest / GIB:8.3f} GiB  ({len(result['groups']) - top} other sites)")
    return "\n".join(lines)
