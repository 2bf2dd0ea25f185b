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
    maxima = (f" (max_memory_allocated {result['max_memory_allocated'] / GIB:.3f}, max_memory_reserved "
              f"{result['max_memory_reserved'] / GIB:.3f})" if "max_memory_allocated" in result else "")
    lines = [f"peak {result['peak'] / GIB:.3f} GiB{maxima}; "
             f"allocated before the trace {result['before'] / GIB:.3f} GiB, of which freed by the peak "
             f"{result['freed_from_before_peak'] / GIB:.3f}; {result['events']} events; peak at {result['peak_at']}"]
    for site, size, sizes in result["groups"][:top]:
        blocks = ", ".join(f"{n}×{s / 2**20:.1f}" for s, n in Counter(sizes).most_common(4))
        lines.append(f"  {size / GIB:8.3f} GiB  {site}  [MiB blocks: {blocks}{', …' if len(set(sizes)) > 4 else ''}]")
    rest = sum(size for _, size, _ in result["groups"][top:])
    if rest:
        lines.append(f"  {rest / GIB:8.3f} GiB  ({len(result['groups']) - top} other sites)")
    return "\n".join(lines)


def segment_report(snapshot: dict[str, Any], device: int = 0, last: int = 3, holes: int = 8) -> str:
    """Why the allocator reserved more than it allocated: replay ``device``'s history (a
    ``train.memory_snapshot_dir`` file, or :func:`torch.cuda.memory._snapshot`) with the segments
    each CUDA stream mapped, and describe the last ``last`` times the reserved total grew to a new
    peak: the request that grew it, what each stream held allocated and mapped, and the free holes of
    the requesting stream that were too small for it (each with the lines that allocated the live
    blocks on either side: what keeps the hole from joining the free end of the segment).

    The caching allocator keeps each stream's blocks apart, and with expandable segments a request that
    no free range of its stream fits maps new memory at the end of that stream's segment: reserved
    grows by the request less the free tail it extends."""
    events = snapshot["device_traces"][device]
    live: dict[int, tuple[int, int, list]] = {}  # addr -> (size, stream, frames)
    mapped: dict[int, dict[int, int]] = defaultdict(dict)  # stream -> {addr: size}
    alloc_by_stream: Counter[int] = Counter()
    reserved = peak_reserved = 0
    peak_allocated = 0
    growths: list[dict[str, Any]] = []
    for i, ev in enumerate(events):
        action, stream = ev["action"], ev.get("stream", 0)
        if action == "alloc":
            live[ev["addr"]] = (ev["size"], stream, ev.get("frames", []))
            alloc_by_stream[stream] += ev["size"]
            peak_allocated = max(peak_allocated, sum(alloc_by_stream.values()))
        elif action == "free_completed" and ev["addr"] in live:
            size, s, _ = live.pop(ev["addr"])
            alloc_by_stream[s] -= size
        elif action in ("segment_map", "segment_alloc"):
            if reserved + ev["size"] > peak_reserved:  # described as it was before the mapping
                peak_reserved = reserved + ev["size"]
                request = next((e for e in events[i + 1:i + 50] if e["action"] == "alloc" and e.get("stream", 0) == stream), None)
                growths.append({"event": i, "stream": stream, "grew": ev["size"], "reserved": peak_reserved,
                                "request": request, "allocated": dict(alloc_by_stream),
                                "mapped": {s: sum(r.values()) for s, r in mapped.items()},
                                "holes": _holes(live, mapped[stream], stream)})
            mapped[stream][ev["addr"]] = ev["size"]
            reserved += ev["size"]
        elif action in ("segment_unmap", "segment_free"):
            if mapped[stream].pop(ev["addr"], None) is not None:
                reserved -= ev["size"]
    end_reserved = sum(seg["total_size"] for seg in snapshot["segments"] if seg.get("device", device) == device)
    lines = [f"{len(events)} events; reserved peak {peak_reserved / GIB:.3f} GiB replayed (segments held at the end: "
             f"{end_reserved / GIB:.3f}; what was mapped before the history began is not in the replay); allocated peak "
             f"{peak_allocated / GIB:.3f} GiB replayed; {len(growths)} growths to a new reserved peak"]
    by_stream: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    for seg in snapshot["segments"]:
        by_stream[seg.get("stream", 0)][0] += seg["total_size"]
        by_stream[seg.get("stream", 0)][1] += seg["allocated_size"]
    for stream, (total, allocated) in sorted(by_stream.items()):
        lines.append(f"  at the end, stream {stream:#x}: {total / GIB:.3f} GiB in segments, {allocated / GIB:.3f} allocated")
    for g in growths[-last:]:
        req = g["request"]
        what = f"{req['size'] / 2**20:.1f} MiB at {_site(req.get('frames', []))}" if req else "?"
        lines.append(f"growth at event {g['event']}: +{g['grew'] / 2**20:.1f} MiB to {g['reserved'] / GIB:.3f} GiB on stream "
                     f"{g['stream']:#x}, for {what}")
        for s in sorted(set(g["mapped"]) | set(g["allocated"])):
            lines.append(f"    stream {s:#x} before it: allocated {g['allocated'].get(s, 0) / GIB:.3f} GiB of "
                         f"{g['mapped'].get(s, 0) / GIB:.3f} mapped")
        free = g["holes"]
        lines.append(f"    its stream's free holes: {sum(h[0] for h in free) / GIB:.3f} GiB in {len(free)}; the largest:")
        for size, below, above in free[:holes]:
            lines.append(f"      {size / 2**20:9.1f} MiB  between [{below}] and [{above}]")
    return "\n".join(lines)


def _holes(live: dict[int, tuple[int, int, list]], ranges: dict[int, int], stream: int) -> list[tuple[int, str, str]]:
    """The free ranges inside ``stream``'s mapped ``ranges`` (size, and the allocating sites of the
    live blocks below and above), largest first."""
    spans: list[list[int]] = []
    for addr in sorted(ranges):
        if spans and spans[-1][1] == addr:
            spans[-1][1] = addr + ranges[addr]
        else:
            spans.append([addr, addr + ranges[addr]])
    blocks = sorted((a, size, frames) for a, (size, s, frames) in live.items() if s == stream)
    found: list[tuple[int, str, str]] = []
    j = 0
    for lo, hi in spans:
        cursor, below = lo, "segment start"
        while j < len(blocks) and blocks[j][0] < hi:
            a, size, frames = blocks[j]
            if a >= lo:
                if a > cursor:
                    found.append((a - cursor, below, _site(frames, 1)))
                cursor, below = a + size, _site(frames, 1)
            j += 1
        if hi > cursor:
            found.append((hi - cursor, below, "segment end"))
    return sorted(found, key=lambda h: -h[0])
