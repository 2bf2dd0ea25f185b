"""What the jobs share: turn a run's outcome into a summary or a clear error and an exit code
(the jobs print it)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

USER_ERROR = 2
"""Exit code for problems the user can fix (config, data, model, environment): nothing ran."""
TRAINING_FAILED = 1
INTERRUPTED = 130
"""Stopped by SIGINT/SIGTERM (128 + SIGINT, the shell convention)."""


def user_errors() -> tuple[type[BaseException], ...]:
    from zerolab.checkpoints import CheckpointError
    from zerolab.config import ConfigError
    from zerolab.data import DataError
    from zerolab.memory import MemoryPreflightError
    from zerolab.models import ModelLoadError
    from zerolab.run import EnvironmentProblem

    return ConfigError, DataError, ModelLoadError, EnvironmentProblem, CheckpointError, MemoryPreflightError


def run_job(job: Callable[[], Any]) -> tuple[int, str]:
    """Run ``job``; return the exit code and what the job prints: its summary, or the error as
    one message without a traceback."""
    from ray.train import TrainingFailedError

    from zerolab.run import Interrupted

    try:
        result = job()
    except user_errors() as exc:
        return USER_ERROR, f"\nerror: {exc}"
    except Interrupted as exc:
        return INTERRUPTED, f"\ninterrupted: {exc}"
    except KeyboardInterrupt:
        return INTERRUPTED, "\naborted without a checkpoint; a relaunch resumes from the last saved one"
    except TrainingFailedError as exc:
        return TRAINING_FAILED, f"\ntraining failed: {root_cause(exc)}"
    return 0, summary(result)


def root_cause(exc: BaseException) -> str:
    """The innermost worker error of a Ray Train failure, as one message."""
    seen = exc
    while seen.__cause__ is not None:
        seen = seen.__cause__
    text = str(seen).strip()
    return text.splitlines()[-1] if text else type(seen).__name__


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
    lines.append(f"compare runs: mlflow ui --backend-store-uri {result.tracking_uri}")
    return "\n".join(lines)
