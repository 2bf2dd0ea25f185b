"""What the jobs share: turn a run's outcome into a summary or a clear error and an exit code
(the jobs print it)."""

from __future__ import annotations

import shlex
import sys
from collections.abc import Callable, Collection, Sequence
from typing import Any

from zerolab.errors import UserError, root_cause
from zerolab.stop import DeadlineReached, Interrupted, NoFinalCheckpoint, signals_interrupt
from zerolab.tracking import mask_text

USER_ERROR = 2
"""Exit code for problems the user can fix (config, data, model, environment, run folder): nothing ran."""
TRAINING_FAILED = 1
DEADLINE = 3
"""Stopped at ``run.max_wall_time_s`` with a checkpoint saved; a relaunch resumes."""
INTERRUPTED = 130
"""Stopped by SIGINT/SIGTERM (128 + SIGINT, the shell convention)."""


REMEDIES = {
    "restart": ("--restart", "starts the run over, discarding its checkpoints"),
    "force": ("--force", "launches anyway"),
    "accept_changed_data": ("--accept-changed-data", "resumes the run on the changed data"),
}
"""The flags of ``jobs/sft.py`` for a user error's remedies (``zerolab.errors.Remedy``)."""


def run_job(job: Callable[[], Any], *, command: Sequence[str] | None = None, remedies: Collection[str] = ()) -> tuple[int, str]:
    """Run ``job``; return the exit code and what the job prints: its summary, or the error as
    one message without a traceback, credentials masked. SIGTERM stops it like Ctrl-C, at once
    outside training (after a record write in progress), exit 130. ``command`` (the job's argv) makes a
    stopped run's message end with the exact command that resumes it; ``remedies``, the ones of
    :data:`REMEDIES` the job offers, end a user error's message with their flags."""
    from ray.train import TrainingFailedError

    try:
        with signals_interrupt():
            result = job()
    except UserError as exc:
        flags = "".join(f"\n  {REMEDIES[r][0]} {REMEDIES[r][1]}" for r in exc.remedies if r in remedies)
        return USER_ERROR, mask_text(f"\nerror: {exc}{flags}")
    except Interrupted as exc:
        code, word = (DEADLINE, "stopped") if isinstance(exc, DeadlineReached) else (INTERRUPTED, "interrupted")
        return code, mask_text(f"\n{word}: {exc}{resume_hint(command, exc.run_name)}")
    except KeyboardInterrupt:
        return INTERRUPTED, "\naborted without a checkpoint; a relaunch resumes from the last saved one"
    except TrainingFailedError as exc:
        return TRAINING_FAILED, mask_text(f"\ntraining failed: {root_cause(exc)}")
    except NoFinalCheckpoint as exc:
        return TRAINING_FAILED, mask_text(f"\ntraining failed: {exc}")
    return 0, summary(result)


def resume_hint(command: Sequence[str] | None, run_name: str | None) -> str:
    """``\\nresume: <the command, naming the run>``, or nothing without a command."""
    if not command or not run_name:
        return ""
    argv = [sys.executable.rsplit("/", 1)[-1], *(a for a in command if a != "--restart")]
    if f"run.name={run_name}" not in argv:
        argv += ["--set", f"run.name={run_name}"]
    return f"\nresume: {shlex.join(argv)}"


def summary(result: Any) -> str:

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
