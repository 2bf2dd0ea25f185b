"""What the worker loop does after each optimizer step — log a window, stop, checkpoint, report to
Tune — decided by a small object that needs neither Ray nor a device, so it is tested on its own;
and the :class:`MetricWindow` whose sums a logged window reports.
The loop (``zerolab.train``) asks; the driver (``zerolab.run``) reads the stop codes it reports."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

STOPPED_ON_REQUEST = 1
"""Stop code: the driver got SIGINT/SIGTERM."""
STOPPED_AT_DEADLINE = 2
"""Stop code: another logging window would end past ``run.max_wall_time_s``."""


@dataclass(frozen=True)
class Cadence:
    total_steps: int
    log_every: int
    """``train.log_every_n_steps``: metrics, the stop poll and the deadline check run then, where
    the loop synchronises anyway."""
    checkpoint_every: int | None = None
    report_every_log: bool = False
    """Under Tune: every logged window is reported (ASHA decides on them), not only checkpoints."""
    deadline_unix: float | None = None

    def logs(self, done: int) -> bool:
        """A logging window ends after step ``done`` (every ``log_every`` steps, and the last)."""
        return done % self.log_every == 0 or done == self.total_steps

    def stop_code(self, *, now: float, window_s: float, requested: Callable[[], bool]) -> int:
        """Rank 0's stop code at a logging step: ``STOPPED_AT_DEADLINE`` when another window as long
        as the last one would end past the deadline, ``STOPPED_ON_REQUEST`` when the driver asks
        (``requested`` is only called when the deadline does not decide), else 0."""
        if self.deadline_unix is not None and now + window_s >= self.deadline_unix:
            return STOPPED_AT_DEADLINE
        return STOPPED_ON_REQUEST if requested() else 0

    def checkpoints(self, done: int, stop: int) -> bool:
        """A checkpoint is saved (and reported) after step ``done``: at the end, on a stop, and every
        ``checkpoint_every`` steps."""
        return bool(stop) or done == self.total_steps or bool(self.checkpoint_every and done % self.checkpoint_every == 0)

    def reports_window(self, done: int, stop: int) -> bool:
        """Under Tune, a logged window that no checkpoint report carries is reported on its own."""
        return self.report_every_log and done % self.log_every == 0 and not self.checkpoints(done, stop)


@dataclass(frozen=True)
class WindowMeans:
    """A logging window, all ranks together."""

    loss: float
    """The mean step loss (each step's is already its token mean over the world)."""
    tokens_per_s: float
    """Non-padding tokens of all ranks per second."""
    step_s: float
    stop: int
    """Rank 0's stop code (0: go on)."""


class MetricWindow:
    """The sums of the steps since the last logging step, kept on the device so that a step does not
    synchronise with the host: the step losses, the non-padding tokens and, at the window's end, rank
    0's stop code, all-reduced together in one collective (``.item()`` is a device sync, once a
    window)."""

    def __init__(self, device: Any, world: int) -> None:
        import torch  # workers only: the driver imports this module for its stop codes

        self.world = world
        self.sums = torch.zeros(3, dtype=torch.float64, device=device)
        self.steps = 0
        self.start = time.perf_counter()

    def add(self, loss: Any, tokens: int) -> None:
        """Count one optimizer step: its summed loss (a device tensor) and its non-padding tokens."""
        self.sums[0] += loss
        self.sums[1] += tokens
        self.steps += 1

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def reduce(self, elapsed: float, stop_code: int | None) -> WindowMeans:
        """Every rank's sums together (a collective all ranks join); rank 0 passes its stop code,
        the others ``None``."""
        import torch.distributed as dist

        if stop_code is not None:
            self.sums[2] = stop_code
        dist.all_reduce(self.sums)
        return WindowMeans(loss=self.sums[0].item() / (self.world * self.steps), tokens_per_s=self.sums[1].item() / elapsed,
                           step_s=elapsed / self.steps, stop=int(self.sums[2].item()))

    def restart(self) -> None:
        """Start the next window (after the last one is logged)."""
        self.sums.zero_()
        self.steps, self.start = 0, time.perf_counter()
