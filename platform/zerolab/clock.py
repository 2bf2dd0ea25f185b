"""The job's start-up clock: when its process started, and how long each start-up phase took until
the workers' first optimizer step."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger("zerolab")


def process_start_time() -> float:
    """When this process started, on the wall clock: now less the process's age, read on the
    kernel's boot clock (``/proc``), which steps of the wall clock (NTP, a resumed VM) do not move.
    psutil's ``create_time`` adds the boot time in whole wall-clock seconds as recorded at boot: off
    by up to a second, and by every step since (minutes, seen on a VM)."""
    try:
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        started_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        return time.time() - (uptime - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):  # not Linux
        import psutil

        return psutil.Process().create_time()



class StartupClock:
    """The driver's start-up phases, from launch to the workers' first optimizer step: logged as
    one line and as ``perf/startup_s`` (with the step's time, ``perf/first_step_unix``, and the
    training time, ``perf/wall_s``) so runs compare their start-up in MLflow.

    ``launched`` is when the job's process started (the jobs pass it, so Python's start and the
    imports count); without it, now (a Tune trial, a job called in-process)."""

    def __init__(self, launched: float | None = None) -> None:
        self._marks: list[tuple[str, float]] = []
        self.launched = launched or time.time()
        if launched:
            self.mark("Python start and imports")

    def mark(self, phase: str) -> None:
        """The phase that ends now."""
        self._marks.append((phase, time.time()))

    def report(self, metrics: dict[str, Any]) -> dict[str, float]:
        first = metrics.get("perf/first_step_unix")
        if not first:
            return {}
        times = [self.launched, *(t for _, t in self._marks), first]
        phases = [*(name for name, _ in self._marks), "workers to their first step"]
        parts = ", ".join(f"{name} {end - start:.1f} s" for name, start, end in zip(phases, times, times[1:]))
        logger.info("start-up: first optimizer step %.1f s after launch (%s)", first - self.launched, parts)
        out = {"perf/startup_s": first - self.launched, "perf/first_step_unix": first}
        if "perf/wall_s" in metrics:
            out["perf/wall_s"] = metrics["perf/wall_s"]
        return out
