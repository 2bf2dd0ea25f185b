"""MLflow behind a small interface: the driver opens and closes the run, rank 0 logs metrics.

One MLflow run per training job, found again by the job's run name, so a relaunch (or a Ray Train
retry) continues the same run; a step that was already logged is never logged twice.
"""

from __future__ import annotations

import contextlib
import logging
import os
import posixpath
import re
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zerolab.config import RunSpec
from zerolab.errors import UserError
from zerolab.stop import shielded

logger = logging.getLogger(__name__)

RUN_NAME_TAG = "zerolab.run_name"
RUN_FOLDER_TAG = "zerolab.run_folder"
STEP_TAG = "zerolab.step"
"""On a registered version: the training step of the adapter it holds."""
MAX_PARAM_LENGTH = 6000
"""MLflow rejects longer param values; those go to the config artifact only."""


def tracking_uri(configured: str | None, storage_path: str | None = None) -> str:
    """``tracking.uri``, else $MLFLOW_TRACKING_URI, else a SQLite store beside the run folders
    (``<run.storage_path>/mlflow.db``; ``~/zerolab_runs/mlflow.db`` when storage is remote), so the
    record lives as long as the runs it describes: not in a working directory that ``ray job
    submit`` deletes with the Ray session. ``storage_path`` defaults to ``run.storage_path``'s default.
    Relative SQLite paths are made absolute, so workers find them."""

    storage_path = storage_path or RunSpec.storage_path
    uri = configured or os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
            return "sqlite:///" + str(Path(uri[len("sqlite:///"):]).expanduser().resolve())
        return uri
    root = Path(storage_path if "://" not in storage_path else RunSpec.storage_path).expanduser().resolve()
    return "sqlite:///" + str(root / "mlflow.db")


class TrackingUnavailable(UserError):
    """The MLflow store cannot be reached or written; the message names it and the fix."""


class RegistrationFailed(TrackingUnavailable):
    """The Model Registry refused a trained adapter; the run keeps its checkpoint and a relaunch registers it."""


def check_store(uri: str, timeout_s: float = 5.0) -> None:
    """Fail in seconds, before anything starts, when the MLflow store cannot be used: a server that
    does not answer its health check (MLflow's client retries one for minutes), a file store MLflow
    refuses, or a SQLite file that cannot be written, is not a database, is damaged, is locked by
    another writer or sits on a full disk. What only MLflow can tell (a deleted experiment, a
    registry that refuses) is checked by :class:`StoreCheck`."""
    shown = mask_text(uri)
    fix = "start it, fix tracking.uri (or MLFLOW_TRACKING_URI), or unset both to use the local store beside the runs"
    scheme = urllib.parse.urlparse(uri).scheme
    if scheme in ("http", "https"):
        try:
            with urllib.request.urlopen(f"{_without_userinfo(uri).rstrip('/')}/health", timeout=timeout_s):
                return
        except urllib.error.HTTPError:
            return  # it answers: the server is up (authentication is checked by the first real call)
        except (OSError, ValueError) as exc:
            reason = getattr(exc, "reason", exc)
            raise TrackingUnavailable(f"tracking.uri: the MLflow server at {shown} does not answer ({reason}); {fix}") from None
    if uri.startswith("sqlite:///"):
        _check_sqlite(Path(uri[len("sqlite:///"):]), shown, timeout_s)
    elif scheme in ("", "file") and os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() not in ("true", "1"):
        folder = uri[len("file://"):] if scheme == "file" else uri
        raise TrackingUnavailable(
            f"tracking.uri: {shown} is a file store (a folder of files), which MLflow 3 refuses unless "
            f"MLFLOW_ALLOW_FILE_STORE=true is exported; use a SQLite store instead, e.g. tracking.uri=sqlite:///"
            f"{Path(folder).expanduser().resolve().parent / 'mlflow.db'} (`mlflow migrate-filestore` moves an existing "
            f"folder's runs there), or export MLFLOW_ALLOW_FILE_STORE=true to keep the file store")


_STORE_MIN_FREE = 64 * 2**20
"""Free disk below which a SQLite store counts as full: MLflow's writes need room for the journal."""


def _check_sqlite(path: Path, shown: str, timeout_s: float) -> None:
    import shutil
    import sqlite3

    fix = "or point tracking.uri (or MLFLOW_TRACKING_URI) at another store"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise TrackingUnavailable(f"tracking.uri: cannot create the folder of the MLflow store {shown} ({exc.strerror}); "
                                  f"choose a writable folder, {fix}") from None
    if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise TrackingUnavailable(f"tracking.uri: the MLflow store {shown} (or its folder) is not writable; "
                                  f"fix its permissions, {fix}")
    free = shutil.disk_usage(path.parent).free
    if free < _STORE_MIN_FREE:
        raise TrackingUnavailable(f"tracking.uri: the disk of the MLflow store {shown} is full ({free / 2**20:.0f} MiB free); "
                                  f"free some space, {fix}")
    if not path.exists() or path.stat().st_size == 0:
        return  # a new store: MLflow creates its tables
    try:
        con = sqlite3.connect(f"{path.as_uri()}?mode=rw", uri=True, timeout=timeout_s)
    except sqlite3.Error as exc:
        raise TrackingUnavailable(f"tracking.uri: cannot open the MLflow store {shown} ({exc}); {fix}") from None
    try:
        # quick_check reads every page: a damaged store is found here, not in the middle of a run.
        # Large stores get the header and schema read only (seconds per GiB otherwise).
        query = "PRAGMA quick_check(1)" if path.stat().st_size < 512 * 2**20 else "SELECT count(*) FROM sqlite_master"
        found = con.execute(query).fetchone()
        if query.startswith("PRAGMA") and found and found[0] != "ok":
            raise sqlite3.DatabaseError(f"database disk image is malformed: {' '.join(str(found[0]).split())}")
        con.execute("BEGIN IMMEDIATE")  # waits up to timeout_s for another writer
        con.rollback()
    except sqlite3.OperationalError as exc:
        if "locked" in str(exc) or "busy" in str(exc):
            raise TrackingUnavailable(
                f"tracking.uri: the MLflow store {shown} is locked by another process that has been writing to it for "
                f"over {timeout_s:g} s (a program holding a transaction open, such as a sqlite3 shell, or a job stuck "
                f"mid-write); end that process and relaunch, {fix}") from None
        raise TrackingUnavailable(f"tracking.uri: the MLflow store {shown} cannot be read ({exc}); {fix}") from None
    except sqlite3.DatabaseError as exc:
        raise TrackingUnavailable(
            f"tracking.uri: the MLflow store {shown} is damaged ({exc}): it is not a readable SQLite database. Move it "
            f"aside (its runs are lost unless a backup or `sqlite3 {path} .recover` restores them) so a new one is "
            f"created, {fix}") from None
    finally:
        con.close()


class StoreCheck:
    """What only MLflow can tell of a store, checked in a background thread while the launch goes on
    (importing MLflow and creating a new SQLite store's tables take seconds): that it opens, that
    ``experiment`` was not deleted, and (``registry``) that its Model Registry answers. :meth:`result`
    waits for it and raises TrackingUnavailable for what it found."""

    def __init__(self, uri: str, experiment: str, *, registry: bool = False) -> None:
        self.uri, self.experiment, self.registry = uri, experiment, registry
        self._problem: str | None = None
        self._thread = threading.Thread(target=self._check, name="zerolab-mlflow-check", daemon=True)
        self._thread.start()

    def _check(self) -> None:
        shown = mask_text(self.uri)
        fix = "fix tracking.uri (or MLFLOW_TRACKING_URI), or unset both to use the local store beside the runs"
        try:
            client = mlflow_client(self.uri)
            found = client.get_experiment_by_name(self.experiment)
        except Exception as exc:  # MlflowException, SQLAlchemy's and the network's errors alike: reported, not raised here
            self._problem = f"tracking.uri: the MLflow store {shown} cannot be used ({_first_line(exc)}); {fix}"
            return
        if found is not None and found.lifecycle_stage == "deleted":
            self._problem = (
                f"tracking.experiment: the experiment '{self.experiment}' (id {found.experiment_id}) was deleted from the "
                f"MLflow store {shown}; restore it (in the MLflow UI, or `mlflow experiments restore --experiment-id "
                f"{found.experiment_id}` with MLFLOW_TRACKING_URI set to the store), choose another tracking.experiment, or "
                f"remove it for good with `mlflow gc`")
            return
        if self.registry:
            try:
                client.search_registered_models(max_results=1)
            except Exception as exc:  # as above
                self._problem = (f"tracking.register: the Model Registry of the MLflow store {shown} does not answer "
                                 f"({_first_line(exc)}); fix the store, or set tracking.register=false to train without "
                                 f"registering the adapter")

    def result(self, timeout_s: float = 120.0) -> None:
        self._thread.join(timeout=timeout_s)
        if self._thread.is_alive():
            raise TrackingUnavailable(f"tracking.uri: the MLflow store {mask_text(self.uri)} did not answer within {timeout_s:g} s; "
                                      f"check it, or unset tracking.uri to use the local store beside the runs")
        if self._problem:
            raise TrackingUnavailable(self._problem)


def model_name_problem(name: str, key: str) -> str | None:
    """Why MLflow's Model Registry would refuse ``name`` (after training, when it registers), as a
    config problem of ``key``; None when it takes it."""
    if name.strip() and "/" not in name and ":" not in name and posixpath.normpath(name) == name and not name.startswith("."):
        return None
    return (f"{key}: {name!r} cannot name a registered model (MLflow refuses names with '/' or ':', empty ones, and ones a "
            f"path would change, such as '..'); choose another, e.g. {re.sub(r'[^A-Za-z0-9._-]+', '-', name).strip('.-') or 'my-adapter'}")


def _without_userinfo(uri: str) -> str:
    return _URL_USERINFO.sub(lambda m: m["scheme"], uri)


# --- secrets ----------------------------------------------------------------------------------

_SECRET_NAME = r"(?:token|password|passwd|secret|api_?key|access_?key|secret_?key|credentials?|private_?key)"
_SECRET_KEY = re.compile(rf"(?:^|[._-]){_SECRET_NAME}$", re.IGNORECASE)
_URL_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<user>[^/@\s:]+)(?::[^/@\s]*)?@")
_QUERY_SECRET = re.compile(rf"(?P<key>[?&][^=&\s]*{_SECRET_NAME}[^=&\s]*=|[?&](?:sig|signature|x-amz-signature|x-amz-credential)=)[^&\s]+",
                           re.IGNORECASE)
_YAML_SECRET = re.compile(rf"^(?P<key>\s*-?\s*[\w.-]*{_SECRET_NAME}\s*:\s*)(?P<value>\S.*)$", re.IGNORECASE | re.MULTILINE)
MASK = "***"


def mask_text(text: str) -> str:
    """Hide credentials in free text: URL user info (``https://user:pass@host`` -> ``https://***@host``)
    and secret-looking query parameters (``?token=...``, signed-URL signatures)."""
    text = _URL_USERINFO.sub(lambda m: f"{m['scheme']}{MASK}@", text)
    return _QUERY_SECRET.sub(lambda m: f"{m['key']}{MASK}", text)


def mask_params(params: dict[str, Any]) -> dict[str, Any]:
    """Params safe to log: values of secret-named keys (``*token``, ``*password``, ``*api_key``, ...)
    replaced, credentials in other values hidden."""
    return {k: (MASK if v not in (None, "") and _SECRET_KEY.search(k) else mask_text(v) if isinstance(v, str) else v)
            for k, v in params.items()}


def mask_yaml(text: str) -> str:
    """A job YAML as given, with the values of secret-named keys and credentials in URLs hidden."""
    return mask_text(_YAML_SECRET.sub(lambda m: f"{m['key']}'{MASK}'", text))


def git_commit(folder: str | Path | None = None) -> str | None:
    """The commit checked out in ``folder`` (default: the working directory), with ``-dirty`` when
    tracked files have changed; None outside a git work tree or without git."""
    try:
        def git(*args: str) -> str:
            return subprocess.run(["git", *args], cwd=folder or os.getcwd(), capture_output=True, text=True, check=True,
                                  timeout=10).stdout.strip()

        commit = git("rev-parse", "HEAD")
        return commit + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return None


def mlflow_client(uri: str) -> Any:
    from mlflow import MlflowClient

    # MLflow prints "View run ... at: <tracking URI>" when a run on a server ends, credentials and
    # all; close_run logs the link itself, masked.
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    return MlflowClient(tracking_uri=uri)


@shielded()
def open_run(uri: str, experiment: str, run_name: str, tags: dict[str, str] | None = None, *, new: bool = False,
             run_id: str | None = None) -> tuple[str, bool]:
    """Continue ``run_id`` (the run a run folder recorded) if this store has it, else the newest run
    named ``run_name`` in ``experiment`` (unless ``new``), else create one; returns (run_id, resumed)."""
    from mlflow.exceptions import MlflowException

    client = mlflow_client(uri)
    if run_id and not new:
        try:
            client.get_run(run_id)
        except MlflowException:
            logger.warning("MLflow run %s recorded by the run folder is not in %s; looking it up by name", run_id, mask_text(uri))
        else:
            client.update_run(run_id, status="RUNNING")
            return run_id, True
    exp = client.get_experiment_by_name(experiment)
    # The kind makes MLflow's UI open the experiment in its model-training view (runs, charts).
    experiment_id = exp.experiment_id if exp is not None else client.create_experiment(
        experiment, artifact_location=_artifact_location(uri), tags={"mlflow.experimentKind": "custom_model_development"})
    found = [] if new else client.search_runs(
        [experiment_id], filter_string=f"tags.`{RUN_NAME_TAG}` = '{run_name}'", max_results=1, order_by=["attributes.start_time DESC"]
    )
    if found:
        run_id = found[0].info.run_id
        client.update_run(run_id, status="RUNNING")
        return run_id, True
    run = client.create_run(experiment_id, run_name=run_name, tags={RUN_NAME_TAG: run_name, **(tags or {})})
    return run.info.run_id, False


def _artifact_location(uri: str) -> str | None:
    """For a SQLite store, artifacts beside the database (``<db folder>/mlartifacts/<run id>/``);
    MLflow's default, ``./mlruns`` of the working directory, vanishes with a ``ray job submit``
    job's temporary working dir. Servers and other stores choose their own."""
    if not uri.startswith("sqlite:///"):
        return None
    return (Path(uri[len("sqlite:///"):]).parent / "mlartifacts").as_uri()


@dataclass
class TrackedRun:
    """An open MLflow run: where it is, whether it was resumed, and the status it will end with
    (``FAILED`` unless the body that uses it says otherwise; None leaves it open for another
    process to close)."""

    uri: str
    run_id: str
    resumed: bool
    status: str | None = "FAILED"

    def log_params(self, params: dict[str, Any]) -> None:
        log_params(self.uri, self.run_id, params)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        MetricsLogger(self.uri, self.run_id).log(metrics, step=step)

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        log_artifact(self.uri, self.run_id, path, artifact_path)


@contextlib.contextmanager
def tracked_run(uri: str, experiment: str, run_name: str, *, tags: dict[str, str] | None = None, new: bool = False,
                run_id: str | None = None) -> Iterator[TrackedRun]:
    """Open (or resume, see :func:`open_run`) a run and close it however the body ends: with the
    status the body set on it (open if it set None), ``KILLED`` on an interrupt, ``FAILED`` on an
    error. Every job's MLflow run (training, sweep, trial, evaluation) goes through here."""
    found, resumed = open_run(uri, experiment, run_name, tags=tags, new=new, run_id=run_id)
    run = TrackedRun(uri, found, resumed)
    try:
        yield run
    except KeyboardInterrupt:
        run.status = "KILLED"
        raise
    finally:
        if run.status is not None:
            close_run(uri, found, run.status)


class NotInStore(LookupError):
    """A run, artifact or registered version the MLflow store does not have (or cannot hand over)."""


def get_run(uri: str, run_id: str) -> Any:
    """The run ``run_id`` (MLflow's entity); NotInStore when the store has none."""
    from mlflow.exceptions import MlflowException

    try:
        return mlflow_client(uri).get_run(run_id)
    except MlflowException as exc:
        raise NotInStore(_first_line(exc)) from None


def download(artifact_uri: str, uri: str, dst: Path) -> Path:
    """Download ``artifact_uri`` (``runs:/``, ``models:/`` or a store URI) into ``dst``; NotInStore on failure."""
    import mlflow.artifacts
    from mlflow.exceptions import MlflowException

    dst.mkdir(parents=True, exist_ok=True)
    try:
        return Path(mlflow.artifacts.download_artifacts(artifact_uri=artifact_uri, tracking_uri=uri, dst_path=str(dst)))
    except (MlflowException, OSError) as exc:
        raise NotInStore(_first_line(exc)) from None


def model_version(uri: str, name: str, *, version: str | None = None, alias: str | None = None) -> Any:
    """A registered version by number, ``latest`` or alias; NotInStore when there is none."""
    from mlflow.exceptions import MlflowException

    client = mlflow_client(uri)
    try:
        if alias is not None:
            return client.get_model_version_by_alias(name, alias)
        if version == "latest":
            versions = client.search_model_versions(f"name = '{name}'")
            if not versions:
                raise NotInStore(f"the registered model '{name}' has no versions")
            return max(versions, key=lambda v: int(v.version))
        return client.get_model_version(name, str(version))
    except MlflowException as exc:
        raise NotInStore(_first_line(exc)) from None


@shielded()
def log_table(uri: str, run_id: str, data: dict[str, list[Any]], artifact_file: str) -> None:
    mlflow_client(uri).log_table(run_id, data=data, artifact_file=artifact_file)


def _first_line(exc: BaseException) -> str:
    return next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)


@shielded()
def close_run(uri: str, run_id: str, status: str) -> None:
    client = mlflow_client(uri)
    client.set_terminated(run_id, status=status)
    if urllib.parse.urlparse(uri).scheme in ("http", "https"):
        experiment = client.get_run(run_id).info.experiment_id
        logger.info("MLflow run %s: %s/#/experiments/%s/runs/%s", run_id, mask_text(uri).rstrip("/"), experiment, run_id)


@shielded()
def log_params(uri: str, run_id: str, params: dict[str, Any]) -> None:
    """Log params, skipping keys already logged with the same value (MLflow params are immutable)."""
    from mlflow.entities import Param

    client = mlflow_client(uri)
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


@shielded()
def log_artifact(uri: str, run_id: str, path: str | Path, artifact_path: str | None = None) -> None:
    client = mlflow_client(uri)
    if Path(path).is_dir():
        client.log_artifacts(run_id, str(path), artifact_path)
    else:
        client.log_artifact(run_id, str(path), artifact_path)


class MetricsLogger:
    """Rank 0's metric writer. A (key, step) already in the run, from an earlier attempt, is skipped."""

    def __init__(self, uri: str, run_id: str) -> None:
        self._client = mlflow_client(uri)
        self._run_id = run_id
        self._last_step: dict[str, int] = {}

    def _last(self, key: str) -> int:
        if key not in self._last_step:
            history = self._client.get_metric_history(self._run_id, key)
            self._last_step[key] = max((m.step for m in history), default=-1)
        return self._last_step[key]

    @shielded()
    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        fresh = [Metric(k, float(v), now, step) for k, v in metrics.items() if step > self._last(k)]
        if fresh:
            self._client.log_batch(self._run_id, metrics=fresh)
            for m in fresh:
                self._last_step[m.key] = step


@shielded()
def register_model(uri: str, run_id: str, artifact_path: str, name: str, alias: str | None, step: int,
                   tags: dict[str, str] | None = None) -> str:
    """Register the run's ``artifact_path`` (a PEFT adapter or HF model folder) as a new version of
    ``name`` in the Model Registry, point ``alias`` at it, and return the version.

    The version records the run id, so the run's params and metrics are one click away in the UI
    (and ``client.get_run(version.run_id)`` in code). Idempotent per run: a relaunch of a finished
    job returns the version it registered before.
    """
    from mlflow.exceptions import MlflowException

    client = mlflow_client(uri)
    try:
        try:
            client.create_registered_model(name, description="Adapters and models trained by zerolab jobs.")
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        existing = [v for v in client.search_model_versions(f"name = '{name}' and run_id = '{run_id}'")
                    if v.tags.get(STEP_TAG) == str(step)]
        if existing:
            version = existing[0]
        else:
            source = f"{client.get_run(run_id).info.artifact_uri.rstrip('/')}/{artifact_path}"
            version = client.create_model_version(name, source, run_id=run_id, tags={**(tags or {}), STEP_TAG: str(step)})
        if alias:
            client.set_registered_model_alias(name, alias, version.version)
    except MlflowException as exc:
        raise RegistrationFailed(
            f"tracking.register: registering the adapter of MLflow run {run_id} as '{name}' in {mask_text(uri)} failed "
            f"({_first_line(exc)}). The training and its checkpoint are kept: fix the registry (or set tracking.register="
            f"false, or another tracking.registered_model) and relaunch the same run; it registers without training again."
        ) from None
    return str(version.version)


@contextlib.contextmanager
def system_metrics(uri: str, run_id: str, interval_s: float, node: str) -> Iterator[None]:
    """Sample this node's CPU, memory, disk, network and (through NVML) GPU use into the run as
    ``system/<node>/...`` every ``interval_s`` seconds, continuing the run's earlier samples after a
    relaunch. Started by one worker per node, so the nodes that train are the ones measured (the
    driver often sits on a machine without GPUs)."""
    if interval_s <= 0:
        yield
        return
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    # MLflow's monitor copes with what a node lacks (no NVML: no GPU metrics; a thread that cannot
    # start: a warning), so sampling never costs the training run.
    monitor = SystemMetricsMonitor(run_id, sampling_interval=interval_s, resume_logging=True, node_id=node, tracking_uri=uri)
    monitor.start()
    try:
        yield
    finally:
        monitor.finish()
        # MLflow's monitor drops the samples of its last, unfinished interval: a run shorter than
        # one interval would record none at all.
        last = monitor.aggregate_metrics()
        if last:
            monitor.publish_metrics(last)
            monitor.mlflow_logger.flush()
