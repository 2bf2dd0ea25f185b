"""The run folder in ``run.storage_path/run.name``: the run's record, its lock, relaunch checks,
checkpoint integrity with fallback, restart.

A run is its run folder plus its MLflow run, and each names the other: the folder's record
(``zerolab_job.json``) holds the training config, the MLflow store and run id, and the run's
status; the MLflow run carries the folder in its ``zerolab.run_folder`` tag.

Ray Train restores a run from the checkpoint snapshot in this folder whenever a job with the same
name and storage path starts again. Before that happens the driver checks here, where a problem
is still a clear message rather than a worker failure that Ray would retry: that the relaunched
job trains the same thing, that the run has not finished already, that no other job is using the
folder, and that the checkpoint it would resume from is complete and readable (a bad newest
checkpoint gives way to the newest good one, with a warning).
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import json
import logging
import os
import re
import socket
import zipfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import pyarrow as pa
import pyarrow.fs as pafs

from zerolab.config import SFTConfig
from zerolab.errors import UserError
from zerolab.integrity import json_problem, safetensors_problem
from zerolab.stop import shielded
from zerolab.tracking import mask_params, mask_text

logger = logging.getLogger(__name__)

JOB_CONFIG_FILE = "zerolab_job.json"
"""The run's record: config, MLflow store and run id, status."""
LOCK_FILE = "zerolab.lock"
SNAPSHOT_FILE = "checkpoint_manager_snapshot.json"
"""Ray Train V2's record of reported checkpoints in the run folder."""

RESUME_SAFE_KEYS = {
    "train.log_every_n_steps", "train.checkpoint_every_n_steps", "train.keep_checkpoints", "train.memory_snapshot_dir",
    "run.max_failures", "run.storage_path", "run.max_wall_time_s", "tracking.uri", "tracking.experiment",
    "tracking.register", "tracking.registered_model", "tracking.model_alias", "tracking.system_metrics_interval_s",
    "eval.enabled", "eval.num_examples", "eval.max_new_tokens", "eval.batch_size", "eval.compare_base", "eval.num_workers",
    "scaling.cpus_per_worker", "scaling.placement_strategy", "scaling.launch", "model.attn_implementation",
    "model.gradient_checkpointing", "deepspeed.config", "deepspeed.z3_leaf_layers",
}
"""Keys a relaunch may change without changing what is trained (or what the checkpoint holds): how
it runs, where it is recorded and registered, and what is evaluated after training."""

EXTENSION_KEYS = {"train.max_steps"}
"""Keys that may grow when a finished run is continued."""

Status = Literal["training", "stopped", "failed", "finished"]


class CheckpointError(UserError):
    """The run folder cannot be resumed as it is; the message says what to do."""

    remedies = ("restart",)


class DataChanged(CheckpointError):
    """A relaunch's data files differ from those the run trained on."""

    remedies = ("restart", "accept_changed_data")


class RunFinished(CheckpointError):
    """The named run finished already; relaunching it would train nothing."""

    def __init__(self, message: str, record: RunRecord) -> None:
        super().__init__(message)
        self.record = record

    def __reduce__(self) -> tuple:  # raised in Tune trials
        return type(self), (str(self), self.record)


class RunInUse(CheckpointError):
    """Another job holds the run folder's lock."""


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


@dataclass
class RunRecord:
    """What the run folder knows of its run (``zerolab_job.json``)."""

    config: dict[str, Any]
    """The training config as dotted keys, secrets masked."""
    tracking_uri: str | None = None
    """The MLflow store of the run (masked when it holds credentials)."""
    experiment: str | None = None
    run_id: str | None = None
    status: Status = "training"
    started_at: str = field(default_factory=_now)
    ended_at: str | None = None
    step: int | None = None
    """The last step saved in a checkpoint."""
    checkpoint: str | None = None
    registered: str | None = None
    """``models:/<name>/<version>`` of the registered adapter, once registered."""
    data: dict[str, str] | None = None
    """Each split's data fingerprint (sha256 of its files), as trained."""

    @classmethod
    def from_json(cls, value: Any) -> RunRecord:
        if isinstance(value, dict) and "config" not in value:  # written before runs had a status: a bare config
            return cls(config=value)
        known = {k: v for k, v in value.items() if k in cls.__dataclass_fields__}
        return cls(**known)


def location(fs: pafs.FileSystem, path: str) -> str:
    """``path`` on ``fs`` as users write it: a local path as it is, else ``<scheme>://<path>``.

    Built from the resolved filesystem, not from the configured URI, so credentials in that URI
    (``s3://key:secret@bucket/...``) and its options (``?endpoint_override=...``) are never shown.
    """
    return path if isinstance(fs, pafs.LocalFileSystem) else f"{fs.type_name}://{path}"


@dataclass
class RunFolder:
    fs: pafs.FileSystem
    path: str
    uri: str

    @classmethod
    def of(cls, cfg: SFTConfig, storage_path: str) -> RunFolder:
        assert cfg.run.name, "the run name is resolved before the run folder is opened"
        fs, root = pafs.FileSystem.from_uri(storage_path)
        path = f"{root.rstrip('/')}/{cfg.run.name}"
        return cls(fs=fs, path=path, uri=location(fs, path))

    def exists(self) -> bool:
        return self.fs.get_file_info(self.path).type == pafs.FileType.Directory

    def read_json(self, name: str) -> Any | None:
        """The file's JSON, None when it is absent; CheckpointError naming the file when unreadable."""
        info = self.fs.get_file_info(f"{self.path}/{name}")
        if info.type != pafs.FileType.File:
            return None
        with self.fs.open_input_stream(info.path) as f:
            data = f.read()
        try:
            return json.loads(data.decode())
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise _Unreadable(f"{self.uri}/{name}", exc) from None

    @shielded()
    def write_json(self, name: str, value: Any) -> None:
        self.fs.create_dir(self.path, recursive=True)
        with self.fs.open_output_stream(f"{self.path}/{name}") as f:
            f.write(json.dumps(value, indent=2, sort_keys=True).encode())

    def read_record(self) -> RunRecord | None:
        try:
            value = self.read_json(JOB_CONFIG_FILE)
        except _Unreadable as exc:
            raise CheckpointError(f"{exc.where} is unreadable ({exc.reason}); it records which config this run trains; "
                                  "start the run over.") from None
        return None if value is None else RunRecord.from_json(value)

    def write_record(self, record: RunRecord) -> None:
        self.write_json(JOB_CONFIG_FILE, asdict(record))

    def forget_record(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.delete_file(f"{self.path}/{JOB_CONFIG_FILE}")

    def delete(self) -> None:
        """Everything in the folder but its lock (held by the job that deletes it)."""
        if not self.exists():
            return
        for info in self.fs.get_file_info(pafs.FileSelector(self.path)):
            if info.base_name == LOCK_FILE:
                continue
            if info.type == pafs.FileType.Directory:
                self.fs.delete_dir(info.path)
            else:
                self.fs.delete_file(info.path)

    def checkpoint_names(self) -> list[str]:
        """The checkpoints Ray Train recorded, oldest first (the newest last)."""
        try:
            snapshot = self.read_json(SNAPSHOT_FILE)
        except _Unreadable:
            snapshot = None
        if snapshot:
            names = [_entry(e).get("checkpoint_dir_name") for e in snapshot.get("checkpoint_results", [])]
            latest = _entry(snapshot.get("latest_checkpoint_result")).get("checkpoint_dir_name")
            names = [n for n in names if n and n != latest] + ([latest] if latest else [])
            return names
        return []

    def checkpoint_metrics(self, name: str) -> dict[str, Any]:
        """The metrics recorded with checkpoint ``name`` (its report's), empty where none are."""
        try:
            snapshot = self.read_json(SNAPSHOT_FILE)
        except _Unreadable:
            return {}
        entries = [_entry(e) for e in (snapshot or {}).get("checkpoint_results", [])]
        return next((dict(e.get("metrics") or {}) for e in entries if e.get("checkpoint_dir_name") == name), {})

    def latest_checkpoint(self) -> str | None:
        names = self.checkpoint_names()
        return names[-1] if names else None

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the folder's lock while a job uses it. A lock left by a process that died on this
        host is taken over; one held by a live process, or by another host, refuses the job.
        On object stores (s3://, gs://) the lock is advisory: two launches in the same second
        can both pass."""
        self.fs.create_dir(self.path, recursive=True)
        path = f"{self.path}/{LOCK_FILE}"
        mine = {"host": socket.gethostname(), "pid": os.getpid(), "since": _now()}
        if isinstance(self.fs, pafs.LocalFileSystem):
            while True:
                try:
                    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
                except FileExistsError:
                    self._check_holder(path)
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)
                    continue
                with os.fdopen(fd, "w") as f:
                    json.dump(mine, f)
                break
        else:
            if self.fs.get_file_info(path).type == pafs.FileType.File:
                self._check_holder(path)
            with self.fs.open_output_stream(path) as f:
                f.write(json.dumps(mine).encode())
        try:
            yield
        finally:
            with contextlib.suppress(FileNotFoundError, OSError):
                self.fs.delete_file(path)
                if not self.fs.get_file_info(pafs.FileSelector(self.path)):
                    self.fs.delete_dir(self.path)  # a launch refused before it wrote anything leaves nothing behind

    def _check_holder(self, path: str) -> None:
        """Raise RunInUse unless the lock at ``path`` was left by a process that is gone."""
        try:
            with self.fs.open_input_stream(path) as f:
                holder = json.loads(f.read().decode())
        except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
            return  # released meanwhile, or written only in part by a process that died
        host, pid = holder.get("host"), holder.get("pid")
        if host == socket.gethostname() and isinstance(pid, int) and not _alive(pid):
            logger.warning("taking over the lock of %s left by process %d, which is gone", self.uri, pid)
            return
        raise RunInUse(
            f"run '{self.uri.rsplit('/', 1)[-1]}' is in use by process {pid} on {host} since {holder.get('since')} "
            f"({self.uri}). Wait for that job to end, or choose another run.name; if that job is gone, delete "
            f"{self.uri}/{LOCK_FILE}."
        )


class StorageUnavailable(UserError):
    """``run.storage_path`` cannot hold run folders (or ``train.memory_snapshot_dir`` its files); the
    message names what was found and the fix."""


def check_storage(storage_path: str, key: str = "run.storage_path", holds: str = "run folders") -> None:
    """Fail before anything starts when ``storage_path`` (the setting ``key``) cannot hold ``holds``: an unknown or
    malformed URI, a bucket that does not exist, credentials the store refuses, a path that names a
    file, a read-only or full filesystem. A small file is written and removed to prove it."""

    shown = mask_text(storage_path)
    try:
        fs, root = pafs.FileSystem.from_uri(storage_path)
    except (OSError, ValueError, pa.ArrowException) as exc:
        raise StorageUnavailable(f"{key}: {shown} is not a storage location zerolab can open ({_reason(exc)}); "
                                 f"give a local folder or an s3://, gs:// or hdfs:// URI (see docs/running.md, 'S3 and GCS storage')") from None
    probe = f"{root.rstrip('/')}/.zerolab-write-check-{socket.gethostname()}-{os.getpid()}"
    try:
        info = fs.get_file_info(root)
        if info.type == pafs.FileType.File:
            raise StorageUnavailable(f"{key}: {shown} is a file, not a folder; give a folder for the {holds} "
                                     f"(it is created if missing)")
        fs.create_dir(root, recursive=True)
        with fs.open_output_stream(probe) as f:
            f.write(b"zerolab")
        fs.delete_file(probe)
    except (OSError, pa.ArrowException) as exc:
        reason = _reason(exc)
        words = reason.lower().replace("_", " ")  # pyarrow writes S3's codes as ACCESS_DENIED
        if "not found" in words and ("bucket" in words or "container" in words):
            fix = f"create the bucket, or fix its name in {key}"
        elif "://" in storage_path and any(word in words for word in _REFUSED):
            raise StorageUnavailable(_refused(storage_path, shown, reason)) from None
        elif isinstance(exc, OSError) and exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            fix = "choose a folder you can write to"
        elif isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            fix = "free some space, or choose another disk"
        elif isinstance(exc, (NotADirectoryError, FileExistsError)):
            fix = "a part of the path is a file: choose a folder path"
        else:
            fix = "check the location and that this machine can reach and write it"
        raise StorageUnavailable(f"{key}: cannot write {holds} to {shown} ({reason}); {fix}") from None


_REFUSED = ("access denied", "accessdenied", "forbidden", "invalidaccesskeyid", "signaturedoesnotmatch", "credential",
            "permission", "unauthori", "expiredtoken", "invalidtoken")
"""Words of an object store's answer that mean it refused the caller (S3 answers an unknown key, a
wrong secret and a missing grant alike with 403 to a HEAD request, which has no body to tell them apart)."""


def _refused(storage_path: str, shown: str, reason: str) -> str:
    """The message for an object store that refused this process's credentials: the bucket, where
    the credentials came from (never their values) and the variables that set them."""

    parts = urlsplit(storage_path)
    bucket = parts.hostname or parts.netloc.rpartition("@")[2]
    if parts.scheme in ("gs", "gcs"):
        source = ("GOOGLE_APPLICATION_CREDENTIALS" if os.environ.get("GOOGLE_APPLICATION_CREDENTIALS")
                  else "the default Google credentials (gcloud auth application-default login, or the node's service account)")
        fix = ("set GOOGLE_APPLICATION_CREDENTIALS to a service account key file whose account may read and write "
               f"gs://{bucket}, or grant that to the account in use")
    else:
        if "@" in parts.netloc:
            source = "the keys written in run.storage_path itself"
        elif os.environ.get("AWS_ACCESS_KEY_ID"):
            source = "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
        elif os.environ.get("AWS_PROFILE"):
            source = f"the profile AWS_PROFILE={os.environ['AWS_PROFILE']}"
        else:
            source = "AWS's default chain (the default profile in ~/.aws/credentials, or the node's instance role)"
        fix = ("export AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (with AWS_SESSION_TOKEN for temporary keys), or "
               f"AWS_PROFILE naming a profile in ~/.aws/credentials, for keys that may list, read and write s3://{bucket}; "
               "on a cluster the nodes' credentials (instance role, or the environment ray start ran in) must allow it too")
    return (f"run.storage_path: the store refused access to bucket '{bucket}' with the credentials of this process "
            f"({shown}: {reason}): the keys are wrong, unknown or expired, or they may not write there; they came from "
            f"{source}. To fix it, {fix}, or choose another run.storage_path")


def _reason(exc: BaseException) -> str:
    """An error's first line, credentials masked."""

    text = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    return mask_text(f"{type(exc).__name__}: {text}" if text else type(exc).__name__)


class _Unreadable(Exception):
    def __init__(self, where: str, exc: BaseException) -> None:
        super().__init__(where)
        self.where, self.reason = where, f"{type(exc).__name__}: {exc}"


def _entry(value: Any) -> dict[str, Any]:
    if isinstance(value, str):  # the snapshot may nest its records as JSON strings
        value = json.loads(value)
    return value or {}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class Resume:
    """What a launch continues: the run's record (None for a new run) and the checkpoint it resumes from."""

    record: RunRecord | None = None
    checkpoint: str | None = None
    extends: bool = False
    """A finished run continued with more steps."""


def prepare_run_folder(cfg: SFTConfig, storage_path: str, *, restart: bool) -> Resume:
    """Check the run folder for this launch (the caller holds its lock); returns what it resumes.

    ``restart`` empties the folder (checkpoints included). Otherwise a recorded run must train the
    same thing, must not have finished (unless ``train.max_steps`` grows past its last step), and
    its newest complete checkpoint is the one resumed: bad newer ones are set aside with a warning.
    Nothing is written here; the record is written once training begins.
    """
    folder = RunFolder.of(cfg, storage_path)
    if restart:
        folder.delete()
        return Resume()
    record = folder.read_record()
    extends = False
    if record is not None:
        extends = record.status == "finished" and _extends(cfg, record)
        if record.status == "finished" and not extends:
            raise RunFinished(_finished_message(cfg, folder, record), record)
        _check_same_training(cfg, folder, record, allowed=EXTENSION_KEYS if extends else set())
    checkpoint = choose_checkpoint(folder, stage=cfg.deepspeed.stage, world_size=cfg.world_size())
    return Resume(record=record, checkpoint=checkpoint, extends=extends)


def _extends(cfg: SFTConfig, record: RunRecord) -> bool:
    return cfg.train.max_steps is not None and record.step is not None and cfg.train.max_steps > record.step


def _finished_message(cfg: SFTConfig, folder: RunFolder, record: RunRecord) -> str:
    where = f"MLflow run {record.run_id} in {record.tracking_uri}" if record.run_id else "no MLflow run recorded"
    adapter = f"{folder.uri}/{record.checkpoint}/adapter" if record.checkpoint else folder.uri
    registered = f", registered as {record.registered}" if record.registered else ""
    return (
        f"run '{cfg.run.name}' finished at {record.ended_at} after step {record.step}: nothing was trained or registered. "
        f"Its record is {where}; its adapter is {adapter}{registered}. To train again choose a new run.name (or leave it "
        f"empty for a new one), start it over (its checkpoints are discarded), or continue it with train.max_steps above "
        f"{record.step}."
    )


def _check_same_training(cfg: SFTConfig, folder: RunFolder, record: RunRecord, *, allowed: set[str]) -> None:
    """A key the record lacks came with a later zerolab: only a value other than its default
    changes what is trained. A key the record has and zerolab no longer knows cannot be set any more.
    Both sides are compared masked, as the record stores them."""

    now, default = mask_params(cfg.flat()), mask_params(SFTConfig().flat())
    saved = record.config
    skip = RESUME_SAFE_KEYS | allowed | {"run.name"}
    changed = sorted(k for k in now if k not in skip and saved.get(k, default[k]) != now[k])
    if changed:
        diffs = ", ".join(f"{k}: {saved.get(k, default[k])!r} -> {now[k]!r}" for k in changed[:8])
        raise CheckpointError(
            f"run.name '{cfg.run.name}' already exists in {folder.uri} with a different training config ({diffs}). "
            "A relaunch resumes that run, so it must train the same thing: choose a new run.name, or start the "
            "run over (its checkpoints are discarded)."
        )


def check_same_data(cfg: SFTConfig, folder: RunFolder, record: RunRecord, fingerprints: dict[str, str], *,
                    accept: bool = False) -> None:
    """Refuse a relaunch whose data files changed since the run began (other rows, same names):
    resuming would train the rest of the run on other data than its first steps. ``accept`` resumes
    anyway, with a warning. Records written before runs kept their data's fingerprint pass."""
    if not record.data:
        return
    changed = {split: (record.data[split], now) for split, now in fingerprints.items()
               if split in record.data and record.data[split] != now}
    if not changed:
        return
    diffs = ", ".join(f"{split} data {was[:16]} -> {now[:16]}" for split, (was, now) in sorted(changed.items()))
    if accept:
        logger.warning("run '%s' resumes on changed data (%s), as accepted", cfg.run.name, diffs)
        return
    raise DataChanged(
        f"run.name '{cfg.run.name}' in {folder.uri} was trained on other data than its files hold now ({diffs}; sha256 of "
        f"the files' names and bytes). A relaunch resumes that run, so it must train on the same data: restore the files, "
        f"choose a new run.name, start the run over, or resume it on the new data knowingly."
    )


def choose_checkpoint(folder: RunFolder, *, stage: int, world_size: int) -> str | None:
    """The newest complete checkpoint of the run, None when it has none.

    A checkpoint that fails its check, or whose folder is gone, is dropped from Ray Train's
    snapshot (its files are left where they are), so Ray resumes from the newest good one; a
    snapshot that cannot be read is rebuilt from the checkpoint folders. Raises CheckpointError
    when checkpoints exist and none is usable.
    """
    try:
        snapshot = folder.read_json(SNAPSHOT_FILE)
    except _Unreadable as exc:
        logger.warning("%s is unreadable (%s); rebuilding it from the checkpoint folders", exc.where, exc.reason)
        snapshot = None
        names = _checkpoint_folders(folder)
        if not names:
            raise CheckpointError(f"{exc.where} is unreadable ({exc.reason}) and the run has no checkpoint folder to rebuild "
                                  "it from; start the run over.") from None
    else:
        names = folder.checkpoint_names() if snapshot else []
    if not names:
        return None
    problems = []
    for name in reversed(names):
        try:
            verify_checkpoint(folder, name, stage=stage, world_size=world_size)
        except CheckpointError as exc:
            problems.append(str(exc))
            continue
        good = names[: names.index(name) + 1]
        if problems or snapshot is None:
            for problem in problems:
                logger.warning("%s; resuming from %s instead", problem, name)
            _write_snapshot(folder, snapshot, good)
        return name
    raise CheckpointError(f"no checkpoint of {folder.uri} can be resumed: {'; '.join(problems)}; start the run over.")


def _checkpoint_folders(folder: RunFolder) -> list[str]:
    infos = folder.fs.get_file_info(pafs.FileSelector(folder.path, allow_not_found=True))
    names = [i.base_name for i in infos if i.type == pafs.FileType.Directory and re.fullmatch(r"checkpoint_\d+", i.base_name)]
    return sorted(names, key=lambda n: int(n.split("_")[1]))


def record_checkpoint(folder: RunFolder, local_dir: Path, name: str, metrics: dict[str, Any], keep: int) -> str:
    """Persist a checkpoint the job's own process wrote (``scaling.launch=driver``, where Ray Train
    persists none) as Ray Train does: copied into the run folder as ``name``, recorded in its
    snapshot as the latest with its metrics, and the oldest beyond ``keep`` deleted. A relaunch,
    in either launch mode, resumes from it. Returns its path in the run folder's filesystem."""
    dest = f"{folder.path}/{name}"
    pafs.copy_files(str(local_dir), dest, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=folder.fs)
    try:
        snapshot = folder.read_json(SNAPSHOT_FILE)
    except _Unreadable:
        snapshot = None
    names = [n for n in folder.checkpoint_names() if n != name] + [name]
    _write_snapshot(folder, snapshot, names[-keep:], new={name: metrics})
    for dropped in names[:-keep]:
        with contextlib.suppress(FileNotFoundError):
            folder.fs.delete_dir(f"{folder.path}/{dropped}")
    return dest


def _write_snapshot(folder: RunFolder, snapshot: dict[str, Any] | None, keep: list[str],
                    new: dict[str, dict[str, Any]] | None = None) -> None:
    """Ray Train's snapshot with only the ``keep`` checkpoints (oldest first), the last as latest;
    ``new``: the metrics of checkpoints reported since the snapshot was written."""
    import ray

    entries = {}
    indices = {}
    for i, (value, index) in enumerate(zip((snapshot or {}).get("checkpoint_results", []),
                                           (snapshot or {}).get("checkpoint_report_indices", []))):
        entry = _entry(value)
        entries[entry.get("checkpoint_dir_name")] = entry
        indices[entry.get("checkpoint_dir_name")] = index if isinstance(index, int) else i
    next_index = (snapshot or {}).get("current_report_index", len(entries))
    for name, metrics in (new or {}).items():
        entries[name] = {"version": 0, "checkpoint_dir_name": name, "metrics": metrics}
        indices[name] = next_index
        next_index += 1
    results = [entries.get(n, {"version": 0, "checkpoint_dir_name": n, "metrics": {}}) for n in keep]
    report_indices = [indices.get(n, i) for i, n in enumerate(keep)]
    value = {
        "ray_version": (snapshot or {}).get("ray_version", ray.__version__),
        "checkpoint_results": results,
        "checkpoint_report_indices": report_indices,
        "latest_checkpoint_result": results[-1],
        "pending_training_results": [],
        "pending_validation_specs": [],
        "current_report_index": max(next_index, max(report_indices) + 1),
        "validated_checkpoint_dir_names": [],
        "timed_out_validation_checkpoint_dir_names": [],
        "failed_validation_checkpoint_dir_names": [],
    }
    with folder.fs.open_output_stream(f"{folder.path}/{SNAPSHOT_FILE}") as f:
        f.write(json.dumps(value).encode())


def verify_checkpoint(folder: RunFolder, name: str, *, stage: int, world_size: int) -> None:
    """Check a checkpoint is complete and readable: DeepSpeed state from every rank, every rank's
    RNG state, and the saved adapter (or model) with its config.

    DeepSpeed's own loader only warns about a missing ``latest`` file and starts from scratch, a
    truncated file fails deep inside a worker, where Ray would retry it, and a truncated adapter
    would be logged and registered as the run's result; checking here turns each into one clear
    error before any worker starts.
    """
    where = f"checkpoint {folder.uri}/{name}"
    path = f"{folder.path}/{name}"
    if folder.fs.get_file_info(path).type != pafs.FileType.Directory:
        raise CheckpointError(f"{where} is missing")
    files = _files(folder.fs, f"{path}/deepspeed/state")
    # ZeRO 0-2 write mp_rank_00_model_states.pt; ZeRO-3 one zero_pp_rank_<r>_mp_rank_00_model_states.pt per rank.
    if not any(re.fullmatch(r"(zero_pp_rank_\d+_)?mp_rank_\d+_model_states\.pt", n) for n in files):
        raise CheckpointError(f"{where} has no DeepSpeed model state (deepspeed/state/*mp_rank_*_model_states.pt); it is incomplete")
    if stage > 0:
        ranks = {int(m.group(1)) for n in files if (m := re.match(r"zero_pp_rank_(\d+)_", n))}
        if ranks != set(range(world_size)):
            raise CheckpointError(
                f"{where} holds ZeRO state of ranks {sorted(ranks)}, not of all {world_size} workers; "
                "it is incomplete (or was written with another scaling.num_workers)"
            )
    top = _files(folder.fs, path)
    missing_rng = [f"rng_rank{r}.pt" for r in range(world_size) if f"rng_rank{r}.pt" not in top]
    if missing_rng:
        raise CheckpointError(f"{where} lacks {', '.join(missing_rng)}; it is incomplete")
    for base, info in [*sorted(files.items()), *((f"rng_rank{r}.pt", top[f"rng_rank{r}.pt"]) for r in range(world_size))]:
        if base.endswith(".pt"):
            _check_zip(folder.fs, info, f"{where} is corrupt: {base}")
    adapter = _files(folder.fs, f"{path}/adapter")
    if "adapter_config.json" not in adapter and "config.json" not in adapter:
        raise CheckpointError(f"{where} has no saved adapter or model (adapter/adapter_config.json or adapter/config.json)")
    for base, info in sorted(adapter.items()):
        if base.endswith(".json"):
            with folder.fs.open_input_stream(info.path) as f:
                problem = json_problem(f.read())
            if problem is not None:
                raise CheckpointError(f"{where} is corrupt: adapter/{base} {problem}")
        elif base.endswith(".safetensors"):
            _check_safetensors(folder.fs, info, f"{where} is corrupt: adapter/{base}")
    if not any(b.endswith(".safetensors") for b in adapter):
        raise CheckpointError(f"{where} has no weights in adapter/ (*.safetensors); it is incomplete")


def _files(fs: pafs.FileSystem, path: str) -> dict[str, pafs.FileInfo]:
    infos = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
    return {info.base_name: info for info in infos if info.type == pafs.FileType.File}


def _check_zip(fs: pafs.FileSystem, info: pafs.FileInfo, what: str) -> None:
    """torch.save archives are zip files: every member's checksum must hold."""
    with fs.open_input_file(info.path) as f:
        try:
            with zipfile.ZipFile(f) as archive:
                bad = archive.testzip()
        except (zipfile.BadZipFile, OSError, EOFError) as exc:
            raise CheckpointError(f"{what} cannot be read ({exc})") from None
    if bad is not None:
        raise CheckpointError(f"{what} fails its checksum at {bad}")


def _check_safetensors(fs: pafs.FileSystem, info: pafs.FileInfo, what: str) -> None:
    with fs.open_input_file(info.path) as f:
        problem = safetensors_problem(f, f.size())
    if problem is not None:
        raise CheckpointError(f"{what} {problem}")
