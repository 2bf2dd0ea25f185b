"""What the jobs share: turn a run's outcome into a summary or a clear error and an exit code
(the jobs print it)."""

from __future__ import annotations

import shlex
import sys
from collections.abc import Callable, Sequence
from typing import Any

USER_ERROR = 2
"""Exit code for problems the user can fix (config, data, model, environment, run folder): nothing ran."""
TRAINING_FAILED = 1
DEADLINE = 3
"""Stopped at ``run.max_wall_time_s`` with a checkpoint saved; a relaunch resumes."""
INTERRUPTED = 130
"""Stopped by SIGINT/SIGTERM (128 + SIGINT, the shell convention)."""


def user_errors() -> tuple[type[BaseException], ...]:
    from zerolab.config import ConfigError
    from zerolab.data import DataError
    from zerolab.errors import UserError
    from zerolab.memory import MemoryPreflightError
    from zerolab.models import ModelLoadError

    return UserError, ConfigError, DataError, ModelLoadError, MemoryPreflightError


def run_job(job: Callable[[], Any], *, command: Sequence[str] | None = None) -> tuple[int, str]:
    """Run ``job``; return the exit code and what the job prints: its summary, or the error as
    one message without a traceback, credentials masked. SIGTERM stops it like Ctrl-C, at once
    outside training (after a record write in progress), exit 130. ``command`` (the job's argv) makes a
    stopped run's message end with the exact command that resumes it."""
    from ray.train import TrainingFailedError

    from zerolab.stop import DeadlineReached, Interrupted, signals_interrupt
    from zerolab.tracking import mask_text

    try:
        with signals_interrupt():
            result = job()
    except user_errors() as exc:
        return USER_ERROR, mask_text(f"\nerror: {exc}")
    except Interrupted as exc:
        code, word = (DEADLINE, "stopped") if isinstance(exc, DeadlineReached) else (INTERRUPTED, "interrupted")
        return code, mask_text(f"\n{word}: {exc}{resume_hint(command, exc.run_name)}")
    except KeyboardInterrupt:
        return INTERRUPTED, "\naborted without a checkpoint; a relaunch resumes from the last saved one"
    except TrainingFailedError as exc:
        return TRAINING_FAILED, mask_text(f"\ntraining failed: {root_cause(exc)}")
    return 0, summary(result)


def resume_hint(command: Sequence[str] | None, run_name: str | None) -> str:
    """``\\nresume: <the command, naming the run>``, or nothing without a command."""
    if not command or not run_name:
        return ""
    argv = [sys.executable.rsplit("/", 1)[-1], *(a for a in command if a != "--restart")]
    if f"run.name={run_name}" not in argv:
        argv += ["--set", f"run.name={run_name}"]
    return f"\nresume: {shlex.join(argv)}"


def root_cause(exc: BaseException) -> str:
    """The innermost worker error of a Ray Train failure, as one message."""
    seen = exc
    while seen.__cause__ is not None:
        seen = seen.__cause__
    text = str(seen).strip()
    return text.splitlines()[-1] if text else type(seen).__name__


def summary(result: Any) -> str:
    from zerolab.tracking import mask_text

    lines = [
        "",
        f"run        {result.run_name}  (MLflow run {result.run_id})",
        f"adapter    {result.adapter_path}",
        f"checkpoint {result.checkpoint_path}",
    ]
    for key in ("train/loss", "eval/loss", "perf/tokens_per_s", "perf/wall_s"):
        if key in result.metrics:
            lines.append(f"{key:<18} {result.metrics[key]:.4g}")
    lines.append(f"compare runs: mlflow ui --backend-store-uri {mask_text(result.tracking_uri)}")
    return "\n".join(lines)
