"""What the worker loop does after each optimizer step — log a window, stop, checkpoint, report to
Tune — decided by a small object that needs neither Ray nor a device, so it is tested on its own.
The loop (``zerolab.train``) asks; the driver (``zerolab.run``) reads the stop codes it reports."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

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
