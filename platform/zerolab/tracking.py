"""MLflow behind a small interface: the driver opens and closes the run, rank 0 logs metrics.

One MLflow run per training job, found again by the job's run name, so a relaunch (or a Ray Train
retry) continues the same run; a step that was already logged is never logged twice.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

RUN_NAME_TAG = "zerolab.run_name"
MAX_PARAM_LENGTH = 6000
"""MLflow rejects longer param values; those go to the config artifact only."""


def tracking_uri(configured: str | None) -> str:
    """``tracking.uri``, else $MLFLOW_TRACKING_URI, else ``sqlite:///<cwd>/mlflow.db`` (absolute, so workers find it)."""
    uri = configured or os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
            return "sqlite:///" + str(Path(uri[len("sqlite:///"):]).expanduser().resolve())
        return uri
    return "sqlite:///" + str(Path.cwd() / "mlflow.db")


def _client(uri: str) -> Any:
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri)


def open_run(uri: str, experiment: str, run_name: str, tags: dict[str, str] | None = None, *, new: bool = False) -> tuple[str, bool]:
    """Find the newest run named ``run_name`` in ``experiment`` (unless ``new``) or create one;
    returns (run_id, resumed)."""
    client = _client(uri)
    exp = client.get_experiment_by_name(experiment)
    experiment_id = exp.experiment_id if exp is not None else client.create_experiment(experiment)
    found = [] if new else client.search_runs(
        [experiment_id], filter_string=f"tags.`{RUN_NAME_TAG}` = '{run_name}'", max_results=1, order_by=["attributes.start_time DESC"]
    )
    if found:
        run_id = found[0].info.run_id
        client.update_run(run_id, status="RUNNING")
        return run_id, True
    run = client.create_run(experiment_id, run_name=run_name, tags={RUN_NAME_TAG: run_name, **(tags or {})})
    return run.info.run_id, False


def close_run(uri: str, run_id: str, status: str) -> None:
    _client(uri).set_terminated(run_id, status=status)


def log_params(uri: str, run_id: str, params: dict[str, Any]) -> None:
    """Log params, skipping keys already logged with the same value (MLflow params are immutable)."""
    from mlflow.entities import Param

    client = _client(uri)
    existing = client.get_run(run_id).data.params
    fresh = []
    for key, value in params.items():
        text = "" if value is None else str(value)
        if len(text) > MAX_PARAM_LENGTH:
            continue
        if key in existing:
            if existing[key] != text:
                logger.warning("MLflow param %s was %r in the earlier attempt of this run, now %r", key, existing[key], text)
            continue
        fresh.append(Param(key, text))
    for i in range(0, len(fresh), 100):
        client.log_batch(run_id, params=fresh[i : i + 100])


def log_artifact(uri: str, run_id: str, path: str | Path, artifact_path: str | None = None) -> None:
    client = _client(uri)
    if Path(path).is_dir():
        client.log_artifacts(run_id, str(path), artifact_path)
    else:
        client.log_artifact(run_id, str(path), artifact_path)


class MetricsLogger:
    """Rank 0's metric writer. A (key, step) already in the run, from an earlier attempt, is skipped."""

    def __init__(self, uri: str, run_id: str) -> None:
        self._client = _client(uri)
        self._run_id = run_id
        self._last_step: dict[str, int] = {}

    def _last(self, key: str) -> int:
        if key not in self._last_step:
            history = self._client.get_metric_history(self._run_id, key)
            self._last_step[key] = max((m.step for m in history), default=-1)
        return self._last_step[key]

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        fresh = [Metric(k, float(v), now, step) for k, v in metrics.items() if step > self._last(k)]
        if fresh:
            self._client.log_batch(self._run_id, metrics=fresh)
            for m in fresh:
                self._last_step[m.key] = step
