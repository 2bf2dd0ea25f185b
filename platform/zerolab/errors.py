"""The base class of every problem a user can fix: a job reports it as one message, without a
traceback, and exits 2 (nothing ran). Each module raises its own subclass, in its own words;
a subclass that several modules raise lives here."""

from __future__ import annotations

from typing import Literal

Remedy = Literal["restart", "force", "accept_changed_data"]
"""A way past a problem that a job offers on its command line (the job names the flag)."""


class UserError(Exception):
    """A problem with the user's configuration, data, model, environment or run folder; the
    message says what is wrong and how to fix it, in the library's words (config keys, files);
    ``remedies`` names what a job may offer besides (``zerolab.cli.run_job`` adds the flags)."""

    remedies: tuple[Remedy, ...] = ()


class EnvironmentProblem(UserError):
    """The machine or cluster cannot run the job as configured; the message says what to do."""


EvaluationInput = Literal["adapter", "model", "task", "data", "base comparison", "merge", "workers", "device", "dtype", "output"]


class EvaluationError(UserError):
    """What to evaluate or export cannot be found or used as given. The message speaks of
    adapters, models and eval data, not of a command line; a job names its own flag for
    ``input``."""

    def __init__(self, message: str, *, input: EvaluationInput | None = None) -> None:
        super().__init__(message)
        self.input = input
        """The input the problem is about; None when it is about no single one."""


def root_cause(exc: BaseException) -> str:
    """The innermost error of a chain (a Ray Train failure's worker error), as one message."""
    seen = exc
    while seen.__cause__ is not None:
        seen = seen.__cause__
    text = str(seen).strip()
    return text.splitlines()[-1] if text else type(seen).__name__
