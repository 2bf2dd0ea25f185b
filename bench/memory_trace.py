"""What holds the GPU memory at a training step's peak: the CUDA caching allocator's history replayed.

``record(run)`` calls ``run`` (some training steps) with ``torch.cuda.memory._record_memory_history``
on and returns the breakdown of the allocated bytes at the highest point: what was allocated
before recording began (weights, states, buffers), and the blocks allocated during the steps that
were alive at the peak, grouped by the lines that allocated them (the two innermost frames outside ``torch``'s own
modules). ``bench/torchrun_loop.py --memory-trace`` prints it; it is how the memory estimator's
terms are checked against what a run holds.
"""

from __future__ import annotations

import gzip
import json
import pickle
import re
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
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
        elif action == "free_requested":  # torch's allocated count drops here, before the block is reusable
            current -= ev["size"]
            if live.pop(ev["addr"], None) is None:
                freed_from_before += ev["size"]
    groups: dict[str, list[int]] = defaultdict(list)
    for ev in peak_live.values():
        groups[_site_of(ev)].append(ev["size"])
    return {"before": before, "peak": peak, "freed_from_before_peak": freed_at_peak, "events": len(events),
            "peak_at": _site_of(events[peak_index]) if peak_index >= 0 else "",
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
    path = re.sub(r"^.*/_ray_pkg_[0-9a-f]+/", "", frame["filename"])  # zerolab as Ray ships it to the workers
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


def segment_report(snapshot: dict[str, Any], device: int = 0, last: int = 2, holes: int = 6) -> str:
    """Why the allocator reserved more than it allocated: replay ``device``'s history (a
    ``train.memory_snapshot_dir`` file, :func:`torch.cuda.memory._snapshot`, or :func:`compact`'s
    form of either) with the ranges each CUDA stream mapped and unmapped. For each stream: its own
    peaks of held bytes (allocated, or freed while work queued on the GPU may still use them: a block
    freed with ``record_stream`` uses pending is reusable only once they complete) and of mapped
    bytes, and the last ``last`` times its mapping grew to a new peak:
    the request that grew it, what every stream held then, and the requesting stream's free holes
    that were too small for it (each with the lines that allocated the live blocks on either side:
    what keeps the hole from joining the free end of the segment).

    The caching allocator keeps each stream's blocks apart, and with expandable segments a request that
    no free range of its stream fits maps new memory at the end of that stream's segment: reserved
    grows by the request less the free tail it extends."""
    events = snapshot["device_traces"][device]
    live: dict[int, tuple[int, int, str]] = {}  # addr -> (size, stream, site) until free_completed
    mapped: dict[int, list[list[int]]] = defaultdict(list)  # stream -> sorted, merged [lo, hi) ranges
    held: Counter[int] = Counter()  # until the allocator may reuse the block (free_completed)
    requested: Counter[int] = Counter()  # allocated as torch counts it: until the tensor is freed (free_requested)
    held_peak: Counter[int] = Counter()
    pending_at_peak: Counter[int] = Counter()
    mapped_peak: Counter[int] = Counter()
    reserved = reserved_peak = allocated_peak = 0
    growths: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for i, ev in enumerate(events):
        action, stream = ev["action"], ev.get("stream", 0)
        if action == "alloc":
            live[ev["addr"]] = (ev["size"], stream, _site_of(ev, 1))
            held[stream] += ev["size"]
            requested[stream] += ev["size"]
            if held[stream] > held_peak[stream]:
                held_peak[stream], pending_at_peak[stream] = held[stream], held[stream] - requested[stream]
            allocated_peak = max(allocated_peak, sum(requested.values()))
        elif action == "free_requested" and ev["addr"] in live:
            requested[live[ev["addr"]][1]] -= live[ev["addr"]][0]
        elif action == "free_completed" and ev["addr"] in live:
            size, owner, _ = live.pop(ev["addr"])
            held[owner] -= size
        elif action in ("segment_map", "segment_alloc"):
            own = _span(mapped[stream])
            if own + ev["size"] > mapped_peak[stream]:  # described as it was before the mapping
                request = next((e for e in events[i + 1:i + 50] if e["action"] == "alloc" and e.get("stream", 0) == stream), None)
                growths[stream].append({"event": i, "grew": ev["size"], "to": own + ev["size"], "request": request,
                                        "held": dict(held), "mapped": {st: _span(r) for st, r in mapped.items()},
                                        "holes": _holes(live, mapped[stream], stream)})
                del growths[stream][:-last]
            _add_range(mapped[stream], ev["addr"], ev["addr"] + ev["size"])
            mapped_peak[stream] = max(mapped_peak[stream], own + ev["size"])
            reserved += ev["size"]
            reserved_peak = max(reserved_peak, reserved)
        elif action in ("segment_unmap", "segment_free"):
            reserved -= _remove_range(mapped[stream], ev["addr"], ev["addr"] + ev["size"])
    lines = [f"{len(events)} events; replayed: reserved peak {reserved_peak / GIB:.3f} GiB, allocated peak {allocated_peak / GIB:.3f} "
             f"GiB (what was mapped or allocated before the history began is not in the replay); segments at the end "
             f"{sum(seg['total_size'] for seg in snapshot['segments']) / GIB:.3f} GiB"]
    for stream in sorted(mapped_peak, key=lambda st: -mapped_peak[st]):
        lines.append(f"stream {stream:#x}: peak held {held_peak[stream] / GIB:.3f} GiB (of which freed, the GPU's use of it still "
                     f"pending: {pending_at_peak[stream] / GIB:.3f}), peak mapped {mapped_peak[stream] / GIB:.3f} GiB")
        for g in growths[stream]:
            req = g["request"]
            what = f"{req['size'] / 2**20:.1f} MiB at {_site_of(req)}" if req else "?"
            lines.append(f"  growth at event {g['event']}: +{g['grew'] / 2**20:.1f} MiB to {g['to'] / GIB:.3f} GiB, for {what}")
            lines.append("    before it, held / mapped GiB by stream: " + ", ".join(
                f"{st:#x} {g['held'].get(st, 0) / GIB:.3f} / {g['mapped'].get(st, 0) / GIB:.3f}"
                for st in sorted(set(g["mapped"]) | set(g["held"]))))
            free = g["holes"]
            lines.append(f"    the stream's free holes: {sum(h[0] for h in free) / GIB:.3f} GiB in {len(free)}; the largest:")
            for size, below, above in free[:holes]:
                lines.append(f"      {size / 2**20:9.1f} MiB  between [{below}] and [{above}]")
    return "\n".join(lines)


def compact(snapshot: dict[str, Any], device: int = 0) -> dict[str, Any]:
    """``device``'s history with each event's stack reduced to its site (:func:`_site`), and the
    segments without their blocks: a few MB where the snapshot is hundreds, which
    :func:`segment_report` and :func:`peak_breakdown` read as they read the snapshot."""
    keep = ("action", "addr", "size", "stream")
    events = [{**{k: ev[k] for k in keep if k in ev}, "site": _site(ev.get("frames", []))} for ev in snapshot["device_traces"][device]]
    traces: list[list[dict[str, Any]]] = [[] for _ in snapshot["device_traces"]]
    traces[device] = events
    segments = [{k: seg[k] for k in ("device", "stream", "total_size", "allocated_size") if k in seg}
                for seg in snapshot["segments"] if seg.get("device", device) == device]
    return {"device_traces": traces, "segments": segments}


def _site_of(ev: dict[str, Any], depth: int = 2) -> str:
    return ev["site"] if "site" in ev else _site(ev.get("frames", []), depth)


def _span(ranges: list[list[int]]) -> int:
    return sum(hi - lo for lo, hi in ranges)


def _add_range(ranges: list[list[int]], lo: int, hi: int) -> None:
    ranges.append([lo, hi])
    ranges.sort()
    merged = [ranges[0]]
    for r in ranges[1:]:
        if r[0] <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], r[1])
        else:
            merged.append(r)
    ranges[:] = merged


def _remove_range(ranges: list[list[int]], lo: int, hi: int) -> int:
    """Remove [lo, hi) from ``ranges``; returns the bytes that were mapped there."""
    kept, removed = [], 0
    for a, b in ranges:
        if b <= lo or a >= hi:
            kept.append([a, b])
            continue
        removed += min(b, hi) - max(a, lo)
        if a < lo:
            kept.append([a, lo])
        if b > hi:
            kept.append([hi, b])
    ranges[:] = kept
    return removed


def _holes(live: dict[int, tuple[int, int, str]], ranges: list[list[int]], stream: int) -> list[tuple[int, str, str]]:
    """The free ranges inside ``stream``'s mapped ``ranges`` (size, and the allocating sites of the
    live blocks below and above), largest first."""
    blocks = sorted((a, size, site) for a, (size, s, site) in live.items() if s == stream)
    found: list[tuple[int, str, str]] = []
    j = 0
    for lo, hi in ranges:
        while j < len(blocks) and blocks[j][0] < lo:
            j += 1
        cursor, below = lo, "segment start"
        while j < len(blocks) and blocks[j][0] < hi:
            a, size, site = blocks[j]
            if a > cursor:
                found.append((a - cursor, below, site))
            cursor, below = max(cursor, a + size), site
            j += 1
        if hi > cursor:
            found.append((hi - cursor, below, "segment end"))
    return sorted(found, key=lambda h: -h[0])


def write_up(folder: Path, out: Path) -> None:
    """The allocator histories a run's workers wrote to ``folder`` (``train.memory_snapshot_dir``),
    one per rank, as text in ``out``: what was allocated at the peak (:func:`peak_breakdown`) and why
    the allocator reserved more (:func:`segment_report`); and each rank's history in :func:`compact`'s
    form beside it (``<out stem>.rank<N>.json.gz``, a few MB, for further reading). The histories
    themselves (hundreds of MB) are deleted."""
    parts = []
    for path in sorted(folder.glob("rank*.pickle")):
        snapshot = pickle.loads(path.read_bytes())
        device = next(i for i, trace in enumerate(snapshot["device_traces"]) if trace)
        small = compact(snapshot, device)
        del snapshot
        with gzip.open(out.with_name(f"{out.name.removesuffix('.txt')}.{path.stem}.json.gz"), "wt") as f:
            json.dump(small, f)
        parts += [f"===== {path.stem}: allocated at the peak", format_breakdown(peak_breakdown(small, 0, device)),
                  f"===== {path.stem}: reserved beyond allocated", segment_report(small, device)]
        path.unlink()
    out.write_text("\n".join(parts) + "\n" if parts else "no allocator history was written\n")
