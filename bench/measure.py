"""Step timing for the baseline trainers, measured the way zerolab measures itself.

Throughput is taken over the last ``window`` optimizer steps (zerolab's last logging window has
the same length), from CUDA events recorded at each step's end, so timing adds no device sync
except one after the first step, whose wall-clock time (``first_step_unix``) ends start-up. Tokens
are non-padding tokens; they may be device tensors (summed at the end, without syncs).
"""

from __future__ import annotations

import gc
import json
import os
import resource
import time
from pathlib import Path
from typing import Any

import torch


class StepMeter:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.events: list[Any] = []
        self.tokens: list[Any] = []
        self.first_step_unix: float | None = None
        self._t0 = time.perf_counter()
        self.cpu_times: list[float] = []
        self.gc = GcClock()

    def step_done(self, tokens: int | torch.Tensor) -> None:
        """Call once per optimizer step, after ``optimizer.step()`` was issued."""
        self.tokens.append(tokens)
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.events.append(event)
        self.cpu_times.append(time.perf_counter())
        if self.first_step_unix is None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.first_step_unix = time.time()

    def result(self, window: int) -> dict[str, float]:
        """Non-padding tokens/s and step time over the last ``window`` steps, peaks, first step."""
        n = len(self.tokens)
        window = max(1, min(window, n - 1))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            elapsed = self.events[n - window - 1].elapsed_time(self.events[n - 1]) / 1000
        else:
            elapsed = self.cpu_times[n - 1] - self.cpu_times[n - window - 1]
        tokens = sum(float(t) for t in self.tokens[n - window:])
        out = {"tokens_per_s": tokens / elapsed, "step_s": elapsed / window, "tokens_per_step": tokens / window,
               "steps": n, "window": window, "first_step_unix": self.first_step_unix or 0.0,
               "host_rss_peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1024**3,
               "gc": self.gc.summary(self.first_step_unix or 0.0)}
        if self.device.type == "cuda":
            out["gpu_peak_allocated_gib"] = torch.cuda.max_memory_allocated(self.device) / 1024**3
            out["gpu_peak_reserved_gib"] = torch.cuda.max_memory_reserved(self.device) / 1024**3
        return out


class GcClock:
    """Python's garbage collections in this process, from now on: when, which generation, how long
    (a host-bound step pays for every collection; a process holding many objects pays more for each)."""

    def __init__(self) -> None:
        self.events: list[tuple[float, int, float]] = []
        self._started = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.events.append((time.time(), info["generation"], time.perf_counter() - self._started))

    def summary(self, since_unix: float) -> dict[str, Any]:
        """Collections after ``since_unix`` (the first step's end): counts and seconds per generation, and
        the objects the collector tracks now."""
        after = [(g, s) for t, g, s in self.events if t >= since_unix]
        return {"gc_collections": {g: sum(1 for gen, _ in after if gen == g) for g in (0, 1, 2)},
                "gc_s": {g: round(sum(s for gen, s in after if gen == g), 4) for g in (0, 1, 2)},
                "gc_tracked_objects": len(gc.get_objects())}


def write_rank_result(path: str | Path, result: dict[str, Any]) -> None:
    """Each rank writes ``<path>.rank<r>.json``; the harness sums tokens and host memory over ranks."""
    rank = int(os.environ.get("RANK", "0"))
    Path(f"{path}.rank{rank}.json").write_text(json.dumps(result, indent=1))


def model_counts(model: torch.nn.Module) -> tuple[int, int]:
    """(total, trainable) parameters, also under ZeRO-3 and of a 4-bit base (``zerolab.adapters.parameter_counts``)."""
    from zerolab.adapters import parameter_counts

    trainable, total = parameter_counts(model)
    return total, trainable
