"""The driver side of an SFT job: connect to Ray, check everything that can be checked before a
worker starts, prepare the data, open the MLflow run and run the ``TorchTrainer``."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import logging
import os
import platform as _platform
import re
import secrets
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

import zerolab
from zerolab import ds_config, stop, tracking
from zerolab.cadence import STOPPED_AT_DEADLINE
from zerolab.checkpoints import RunFolder, RunRecord, check_same_data, check_storage, location, prepare_run_folder
from zerolab.cluster import (
    adopt_worker_env,
    connect_ray,
    import_now,
    job_imports,
    may_train_in_driver,
    needs_ray,
    reserved_resources,
    resolve_launch,
    worker_resources,
)
from zerolab.config import ConfigError, SFTConfig
from zerolab.data import DataError, PreparedSplit, SplitReport, dataset_paths, prepare_split
from zerolab.errors import EnvironmentProblem
from zerolab.memory import load_model_config
from zerolab.stop import DeadlineReached, Interrupted, StopSignal
from zerolab.worker_plan import TrackingTarget, WorkerPlan

logger = logging.getLogger("zerolab")


@dataclass
class RunResult:
    run_id: str
    run_name: str
    tracking_uri: str
    checkpoint_path: str
    adapter_path: str
    metrics: dict[str, Any] = field(default_factory=dict)
    data: dict[str, dict[str, Any]] = field(default_factory=dict)


def run_sft(cfg: SFTConfig, *, config_file: str | Path | None = None, restart: bool = False, force: bool = False,
            parent_run_id: str | None = None, in_tune: bool = False, launched: float | None = None,
            shared_data: dict[str, PreparedSplit] | None = None, stop_flag: Any = None,
            accept_changed_data: bool = False) -> RunResult:
    """Run one SFT job end to end and return where its results are.

    A run is its run folder (``run.storage_path/run.name``) plus its MLflow run, each recording the
    other. An empty ``run.name`` names a new run for this launch. Naming an unfinished run resumes
    it from its newest good checkpoint; naming a finished one raises RunFinished (nothing trains,
    nothing is registered) unless ``train.max_steps`` grows past its last step, which continues
    it; ``restart`` discards the run first. The run folder is locked while the job runs.

    Raises a UserError subclass (ConfigError, DataError, ModelLoadError, CheckpointError,
    EnvironmentProblem, TrackingUnavailable, MemoryPreflightError unless ``force``) for
    user-fixable problems, before any worker starts: also StorageUnavailable for a storage path that
    cannot be written, and CheckpointError for a relaunch whose data changed (unless
    ``accept_changed_data``). During training the first SIGINT or SIGTERM asks the workers to
    checkpoint and stop at the next logging step (the run ends KILLED and a relaunch resumes it); a
    second one aborts at once; one during start-up (with :func:`zerolab.stop.signals_interrupt`
    installed, as the jobs do) raises Interrupted at once, nothing trained. ``run.max_wall_time_s``
    stops the run like a signal (DeadlineReached).

    Under Ray Tune (``in_tune``, from :mod:`zerolab.tune`) every logged window is reported to the
    trial, and the MLflow run is a child of ``parent_run_id``. ``launched`` (the job process's
    start time) starts the start-up clock and ``run.max_wall_time_s``; by default, the call.
    ``shared_data``: the splits a sweep prepared once for its trials (:func:`prepare_data`).
    ``stop_flag``: a :class:`StopFlag` actor that stops the run when set (a warm trainer's job sets it).
    """
    clock = StartupClock(launched)
    cfg = with_run_name(cfg)
    check_registry_name(cfg)
    storage = storage_path(cfg)
    check_storage(storage)
    folder = RunFolder.of(cfg, storage)
    stopper: StopSignal | None = None
    try:
        with folder.locked():
            resume = prepare_run_folder(cfg, storage, restart=restart)
            uri = _store_of(cfg, storage, resume.record)
            tracking.check_store(uri)
            store = tracking.StoreCheck(uri, cfg.tracking.experiment, registry=cfg.tracking.register)
            clock.mark("run folder and MLflow store checks")
            if may_train_in_driver(cfg):
                adopt_worker_env(cfg)
            if needs_ray(cfg):
                connect_ray(cfg, importing=job_imports(cfg))
                clock.mark("Ray (the training stack imported meanwhile)")
            else:
                logger.info("one worker on this machine: it trains in this process, without starting Ray (Ray Train's local mode)")
                import_now(job_imports(cfg))
                clock.mark("the training stack's imports")
            launch = resolve_launch(cfg)
            check_resources(cfg, launch)
            plan = plan_job(cfg, force=force, clock=clock, shared_data=shared_data, launch=launch)
            if resume.record is not None and not restart:
                check_same_data(cfg, folder, resume.record, {k: r.fingerprint for k, r in plan.reports.items()},
                                accept=accept_changed_data)
            if resume.checkpoint:
                logger.info("%s %s from %s", "continuing finished run" if resume.extends else "resuming", cfg.run.name, resume.checkpoint)
            warn_if_node_local(uri)
            tags = {**run_tags(cfg, plan.commit), tracking.RUN_FOLDER_TAG: tracking.mask_text(folder.uri),
                    **({"mlflow.parentRunId": parent_run_id} if parent_run_id else {})}
            store.result()
            recorded_id = resume.record.run_id if resume.record and resume.record.tracking_uri == tracking.mask_text(uri) else None
            with tracking.tracked_run(uri, cfg.tracking.experiment, cfg.run.name, tags=tags, new=restart, run_id=recorded_id) as run:
                logger.info("MLflow run %s (%s) in experiment '%s' at %s", run.run_id, "resumed" if run.resumed else "new",
                            cfg.tracking.experiment, tracking.mask_text(uri))
                record = RunRecord(config=tracking.mask_params(cfg.flat()), tracking_uri=tracking.mask_text(uri),
                                   experiment=cfg.tracking.experiment, run_id=run.run_id,
                                   data={k: r.fingerprint for k, r in plan.reports.items()},
                                   **({"started_at": resume.record.started_at} if resume.record else {}))
                stopper = StopSignal(cfg.train.log_every_n_steps, plan.launch, stop_flag)
                try:
                    return _train(plan, run, record, folder, clock, config_file, in_tune, resume.checkpoint, stopper)
                except KeyboardInterrupt:
                    run.status, record.status = "KILLED", "stopped"
                    raise
                finally:
                    with stop.shielded():
                        _settle_record(folder, record, run.status)
    except KeyboardInterrupt:
        if stopper is not None and stopper.fitting:
            raise
        raise Interrupted(f"stopped during start-up, before training began: nothing was trained. Relaunch with "
                          f"run.name={cfg.run.name} to start it (it keeps this run's MLflow record).", run_name=cfg.run.name) from None


def check_registry_name(cfg: SFTConfig) -> None:
    """Refuse, before anything starts, a registered-model name MLflow would refuse after training."""
    if not cfg.tracking.register:
        return
    key = "tracking.registered_model" if cfg.tracking.registered_model else "run.name"
    problem = tracking.model_name_problem(cfg.tracking.registered_model or cfg.run.name, key)
    if problem:
        raise ConfigError([problem])


def _train(plan: JobPlan, run: tracking.TrackedRun, record: RunRecord, folder: RunFolder, clock: StartupClock,
           config_file: str | Path | None, in_tune: bool, resume_from: str | None, stopper: StopSignal) -> RunResult:
    """Record the job's inputs, run the trainer, and record its outcome into ``run`` and ``record``."""
    cfg, memory = plan.cfg, plan.memory
    run.log_params(tracking.mask_params({**cfg.flat(), **derived_params(cfg, plan.reports, plan.commit, plan.launch), **memory.params()}))
    run.log_metrics(memory.predicted(), step=0)
    _log_inputs(run, plan, config_file)
    folder.write_record(record)  # training begins
    clock.mark("MLflow run")
    deadline = clock.launched + cfg.run.max_wall_time_s if cfg.run.max_wall_time_s else None
    trainer = build_trainer(plan, run.uri, run.run_id, stopper.flag, in_tune=in_tune, deadline=deadline, resume_from=resume_from)
    with stopper.installed():
        result = stopper.fit(trainer)
    in_driver = trainer.train_loop_config["plan"].in_driver
    metrics, checkpoint = in_driver.last if in_driver else (dict(result.metrics or {}), result.checkpoint)
    assert checkpoint is not None, "the run finished without a final checkpoint"
    checkpoint_uri = location(checkpoint.filesystem, checkpoint.path)
    step = int(metrics.get("step", 0))
    record.step, record.checkpoint = step, checkpoint.path.rstrip("/").rsplit("/", 1)[-1]
    run.log_metrics({**memory.errors(metrics), **clock.report(metrics)}, step=step)
    if metrics.get("stopped"):
        run.status, record.status = "KILLED", "stopped"
        cause = DeadlineReached if metrics["stopped"] == STOPPED_AT_DEADLINE else Interrupted
        why = f"run.max_wall_time_s={cfg.run.max_wall_time_s:g} reached" if cause is DeadlineReached else "stopped on request"
        raise cause(f"{why} at step {step}; checkpoint saved at {checkpoint_uri}. Resume the run with run.name={cfg.run.name}.",
                    run_name=cfg.run.name)
    with checkpoint.as_directory() as ckpt:
        run.log_artifact(Path(ckpt) / "adapter", "adapter")
    if cfg.tracking.register:
        name = cfg.tracking.registered_model or cfg.run.name
        version = tracking.register_model(run.uri, run.run_id, "adapter", name, cfg.tracking.model_alias or None, step,
                                          tags={"run_name": cfg.run.name, **_final_metric_tags(metrics)})
        alias = f"@{cfg.tracking.model_alias}" if cfg.tracking.model_alias else f"/{version}"
        record.registered = f"models:/{name}/{version}"
        logger.info("registered as %s version %s (models:/%s%s)", name, version, name, alias)
    if cfg.eval.enabled:
        from zerolab.evaluate import evaluate_after_training

        with checkpoint.as_directory() as ckpt:
            evaluate_after_training(cfg, run.uri, run.run_id, Path(ckpt) / "adapter", step=step)
    run.status, record.status = "FINISHED", "finished"
    adapter = f"{checkpoint_uri.rstrip('/')}/adapter"
    return RunResult(run_id=run.run_id, run_name=cfg.run.name, tracking_uri=run.uri, checkpoint_path=checkpoint_uri,
                     adapter_path=adapter, metrics=metrics, data={k: r.to_dict() for k, r in plan.reports.items()})


@dataclass(frozen=True)
class JobPlan:
    """What the driver resolves for a job, once, before anything is launched: the checks, the
    estimate, the MLflow params and the trainer read it, and the workers get its config and
    DeepSpeed JSON (they re-resolve nothing)."""

    cfg: SFTConfig
    model_path: str
    """Local folder or hub id (``builtin:`` names resolved)."""
    model_config: Any
    """The model's Hugging Face config (or a known shape's dict); no weights are read."""
    deepspeed: dict[str, Any]
    """The resolved DeepSpeed JSON the engine is built from."""
    splits: dict[str, PreparedSplit]
    """Tokenized rows of each split (with their fingerprint and token counts)."""
    memory: MemoryCheck
    commit: str | None
    launch: str = "workers"
    """``driver`` (the job's own process trains: Ray Train's local mode) or ``workers``."""

    @property
    def reports(self) -> dict[str, SplitReport]:
        return {name: split.report for name, split in self.splits.items()}


def plan_job(cfg: SFTConfig, *, force: bool = False, clock: StartupClock | None = None,
             shared_data: dict[str, PreparedSplit] | None = None, launch: str | None = None) -> JobPlan:
    """Resolve ``cfg`` against its model, data and cluster (Ray connected): raises ConfigError,
    DataError, ModelLoadError or MemoryPreflightError (unless ``force``) for what cannot run.
    ``shared_data``: a sweep's splits for this trial (:func:`prepare_data`); ``launch``: where it
    trains, when already resolved (``cluster.resolve_launch``)."""
    from zerolab.models import resolve_model_path

    model_path = resolve_model_path(cfg.model.name_or_path)
    model_config = load_model_config(cfg)
    resolved_ds = check_against_model(cfg, model_config)
    splits = prepare_data(cfg, model_path, shared_data)
    if clock:
        clock.mark("model config and data")
    memory = check_memory(cfg, model_config, force=force, datasets=splits)
    if clock:
        clock.mark("memory estimate")
    return JobPlan(cfg, model_path, model_config, resolved_ds, splits, memory, tracking.git_commit(),
                   launch or resolve_launch(cfg))


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


def with_run_name(cfg: SFTConfig) -> SFTConfig:
    """``cfg`` with its run named: an empty ``run.name`` becomes ``<task>-<model>-<UTC date>-<time>-<4 hex>``,
    new for every launch, and its adapter is registered under ``<task>-<model>`` (unless
    ``tracking.registered_model`` says otherwise), so the versions of such runs share one name."""
    if cfg.run.name:
        return cfg
    model = re.sub(r"[^A-Za-z0-9._-]+", "-", cfg.model.name_or_path.rstrip("/").rsplit("/", 1)[-1].split(":")[-1]).strip("-.")
    family = f"{cfg.data.task}-{model[:40] or 'model'}"
    name = f"{family}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{secrets.token_hex(2)}"
    return cfg.replace(run=replace(cfg.run, name=name),
                       tracking=replace(cfg.tracking, registered_model=cfg.tracking.registered_model or family))


def _store_of(cfg: SFTConfig, storage: str, record: RunRecord | None) -> str:
    """The MLflow store of this launch: the configured one, else the one the run recorded (so a
    relaunch from another working directory continues the same record), else the default."""
    configured = cfg.tracking.uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not configured and record is not None and record.tracking_uri and tracking.MASK not in record.tracking_uri:
        return record.tracking_uri
    return tracking.tracking_uri(cfg.tracking.uri, storage)


def _settle_record(folder: RunFolder, record: RunRecord, mlflow_status: str) -> None:
    """Write how the launch ended into the run's record; a launch that left no checkpoint trained
    nothing a relaunch could resume, so it leaves no record (and no config to be held to)."""
    if folder.latest_checkpoint() is None:
        folder.forget_record()
        return
    if record.status == "training" and mlflow_status == "FAILED":
        record.status = "failed"
    record.ended_at = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    record.step = record.step if record.step is not None else _checkpoint_step(folder.latest_checkpoint())
    record.checkpoint = record.checkpoint or folder.latest_checkpoint()
    folder.write_record(record)


def _checkpoint_step(name: str | None) -> int | None:
    return int(name.rsplit("_", 1)[-1]) if name and name.rsplit("_", 1)[-1].isdigit() else None


def check_resources(cfg: SFTConfig, launch: str) -> None:
    """Refuse a job the cluster cannot place (Ray Train would otherwise wait for resources forever).
    A worker group cannot use what the job's own process holds (``ray job submit
    --entrypoint-num-gpus/--entrypoint-num-cpus``): that is left out of what the cluster has."""
    import ray

    s = cfg.scaling
    if launch == "driver" and s.use_gpu and os.environ.get("DS_ACCELERATOR", "cuda") != "cuda":
        raise EnvironmentProblem(f"scaling.use_gpu=true, but this process has DS_ACCELERATOR={os.environ['DS_ACCELERATOR']}, "
                                 "which DeepSpeed would train with; unset it, or set --set scaling.use_gpu=false to train on CPUs.")
    if not ray.is_initialized():  # one worker, in this process, on this machine (cluster.needs_ray)
        import torch

        if s.use_gpu and not torch.cuda.device_count():
            raise EnvironmentProblem("scaling.use_gpu=true but this machine has no CUDA GPU that this process can see; run on a "
                                     "GPU machine, or set --set scaling.use_gpu=false to train on CPUs.")
        return
    resources = ray.cluster_resources()
    held = {k: v for k, v in reserved_resources().items() if k in ("CPU", "GPU") and v} if launch == "workers" else {}
    note = ""
    if held:
        note = (f", less {', '.join(f'{v:g} {k}' for k, v in held.items())} that the job's own process holds (the job was "
                "submitted with --entrypoint-num-gpus/--entrypoint-num-cpus, which its worker group cannot use: submit it "
                "without them, or with scaling.num_workers=1 it trains in that process)")
    if s.use_gpu:
        gpus = int(resources.get("GPU", 0))
        if gpus == 0:
            raise EnvironmentProblem(
                "scaling.use_gpu=true but the Ray cluster has no GPUs (no CUDA device was found, or the nodes "
                "were started without them). Run on a GPU machine/cluster, or set --set scaling.use_gpu=false to "
                "train on CPUs."
            )
        if gpus - held.get("GPU", 0) < s.num_workers:
            raise EnvironmentProblem(
                f"scaling.num_workers={s.num_workers} needs {s.num_workers} GPUs but the cluster has {gpus}{note}; lower "
                "scaling.num_workers or add GPU nodes."
            )
    cpus = resources.get("CPU", 0)
    if s.num_workers * s.cpus_per_worker > cpus - held.get("CPU", 0):
        raise EnvironmentProblem(
            f"scaling.num_workers × scaling.cpus_per_worker = {s.num_workers} × {s.cpus_per_worker:g} CPUs, but the "
            f"cluster has {cpus:g}{note}; lower either, or add nodes."
        )


def warn_if_node_local(tracking_uri: str) -> None:
    """Warn when the MLflow store is a file on this machine and the cluster has other nodes: rank 0
    logs metrics from its own node, where that file exists only on a filesystem all nodes mount."""
    import ray

    if not ray.is_initialized() or not tracking_uri.startswith(("sqlite:", "file:", "/", ".", "~")):
        return
    nodes = sum(1 for node in ray.nodes() if node["Alive"])
    if nodes > 1:
        logger.warning("MLflow store %s is a file, and the Ray cluster has %d nodes: workers on other nodes can log to it "
                       "only if every node mounts it at the same path. Otherwise set MLFLOW_TRACKING_URI (or tracking.uri) "
                       "to a tracking server that the nodes reach; infra/ starts one.", tracking_uri, nodes)


@dataclass
class MemoryCheck:
    """The memory estimator's prediction for a job (None where it could not estimate), logged next
    to the measured ``mem/*`` peaks so every run records its prediction error."""

    estimate: Any = None
    limits: Any = None
    note: str = ""
    by_config: str | None = None
    """The worst case by config, where it differs from a data-aware ``estimate``."""

    PAIRS = (("gpu_peak_allocated_gib", "device_peak"), ("gpu_peak_reserved_gib", "device_reserved"),
             ("host_rss_peak_gib", "host_workers"))
    """Measured metric (``mem/<name>``) -> Estimate figure it is compared with."""

    def _predicted_bytes(self) -> dict[str, float]:
        est = self.estimate
        if est is None:
            return {}
        figures = {"device_peak": est.device_peak, "device_reserved": est.device_reserved,
                   "host_workers": est.host_workers_before_save(est.workers_per_node(self.limits))}
        keys = self.PAIRS if est.use_gpu else self.PAIRS[2:]
        return {name: figures[attr] for name, attr in keys}

    def params(self) -> dict[str, Any]:
        if self.estimate is None:
            return {"memory.estimate": self.note or "unavailable"}
        params = {"memory.estimate": self.estimate.summary(self.limits), "memory.limits": self.limits.describe()}
        return {**params, **({"memory.estimate_by_config": self.by_config} if self.by_config else {})}

    def predicted(self) -> dict[str, float]:
        return {f"mem/pred_{name}": value / 2**30 for name, value in self._predicted_bytes().items()}

    def errors(self, measured: dict[str, Any]) -> dict[str, float]:
        """(measured - predicted) / measured in percent, for each peak the run reported."""
        out = {}
        for name, predicted in self._predicted_bytes().items():
            value = measured.get(f"mem/{name}")
            if isinstance(value, (int, float)) and value > 0:
                out[f"mem/pred_error_{name}_pct"] = 100 * (predicted / 2**30 - value) / value
        return out


def check_memory(cfg: SFTConfig, model_config: Any, *, force: bool = False, datasets: dict[str, Any] | None = None) -> MemoryCheck:
    """Estimate the job's memory per GPU and per node and refuse it when it cannot fit the nodes it
    would run on (raises MemoryPreflightError, which names the options that would fit). With the
    prepared ``datasets`` the estimate takes the largest micro-batch the workers' shards will make
    (and the worst case by config is logged next to it); without, the worst case by config.
    ``force`` launches anyway, with a warning. Models the estimator does not know are let through."""
    import ray

    from zerolab import memory

    calibration = memory.DEFAULT_CALIBRATION if ray.is_initialized() else memory.without_ray()
    try:
        limits = cluster_limits(cfg)
        data = shard_lengths(datasets, cfg.world_size()) if datasets else None
        try:
            est = memory.preflight(cfg, model_config, limits, calibration=calibration, data=data)
        except memory.MemoryPreflightError as exc:
            if not force:
                raise
            logger.warning("launching anyway (--force): %s", exc)
            est = exc.estimate
    except memory.MemoryPreflightError:
        raise
    except memory.MemoryEstimateError as exc:
        logger.warning("no memory estimate for this job, so no preflight check: %s", exc)
        return MemoryCheck(note=str(exc))
    by_config = memory.worst_case_by_config(cfg, model_config, est, limits, calibration=calibration)
    logger.info("memory estimate: %s on %s (%s)%s", est.summary(limits), limits.describe(), est.batch.describe(),
                f"; {by_config}" if by_config else "")
    return MemoryCheck(est, limits, by_config=by_config)


def shard_lengths(datasets: dict[str, PreparedSplit], world_size: int) -> Any:
    """The token length of every row of each rank's shards (a ``zerolab.memory.ShardLengths``), as
    :func:`zerolab.data.shard_rows` deals them to the workers."""
    from zerolab.data import shard_rows
    from zerolab.memory import ShardLengths

    def by_rank(split: PreparedSplit, equal: bool) -> list[list[int]]:
        return [split.lengths[rows].tolist() for rows in shard_rows(split.num_rows, world_size, equal=equal)]

    return ShardLengths(by_rank(datasets["train"], True), by_rank(datasets["eval"], False) if "eval" in datasets else [])


def job_shard_lengths(cfg: SFTConfig) -> Any:
    """The job's shards (``shard_lengths``) from its data as a run would prepare it (its files, or
    the task's generated ones; the tokenized-data cache when unchanged), without starting workers."""
    from zerolab.models import resolve_model_path

    splits = prepare_data(cfg, resolve_model_path(cfg.model.name_or_path))
    return shard_lengths(splits, cfg.world_size())


def cluster_limits(cfg: SFTConfig) -> Any:
    """GPU memory and host RAM of the Ray nodes that can run this job's workers, measured on each
    node by a zero-resource task (the driver may sit on a machine without GPUs), the driver's own
    node in-process (a task's new worker process costs seconds): the smallest GPU and the smallest
    RAM among them, so the check holds wherever Ray places the workers."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from zerolab.memory import Limits

    if not ray.is_initialized():  # the job trains in this process (cluster.needs_ray)
        return Limits.detect()

    @ray.remote(num_cpus=0)
    def detect() -> Limits:
        return Limits.detect_with_nvml()

    nodes = [n for n in ray.nodes() if n["Alive"] and (not cfg.scaling.use_gpu or n["Resources"].get("GPU", 0) > 0)
             and n["Resources"].get("CPU", 0) >= cfg.scaling.cpus_per_worker]
    here = ray.get_runtime_context().get_node_id()
    found = ray.get([detect.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote()
                     for n in nodes if n["NodeID"] != here])
    found += [Limits.detect_with_nvml() for n in nodes if n["NodeID"] == here]
    gpu = [f.gpu_mem_bytes for f in found if f.gpu_mem_bytes] if cfg.scaling.use_gpu else []
    host = [f.host_mem_bytes for f in found if f.host_mem_bytes]
    per_node = max((f.gpus_per_node or 0) for f in found) if cfg.scaling.use_gpu and found else None
    return Limits(gpu_mem_bytes=min(gpu) if gpu else None, gpus_per_node=per_node or None,
                  host_mem_bytes=min(host) if host else None, num_nodes=max(1, len(found)),
                  source=f"detected on {len(found)} Ray node(s)")


def check_against_model(cfg: SFTConfig, model_config: Any) -> dict[str, Any]:
    """Checks that need the model's architecture (``model_config``, see ``zerolab.memory.load_model_config``);
    returns the resolved DeepSpeed config. Problems from both are reported together."""
    from zerolab.models import linear_module_names

    problems: list[str] = []
    linear = linear_module_names(cfg.model, model_config)
    if cfg.adapter.is_peft() and list(cfg.adapter.target_modules) != ["all-linear"]:
        missing = [m for m in cfg.adapter.target_modules if m not in linear]
        if missing:
            problems.append(
                f"adapter.target_modules: {missing} are not linear modules of {cfg.model.name_or_path}; "
                f"choose from {sorted(linear)} or use [all-linear]"
            )
    hidden = model_config.get("hidden_size") if isinstance(model_config, dict) else getattr(model_config, "hidden_size", None)
    resolved: dict[str, Any] = {}
    try:
        resolved = ds_config.resolve(cfg, hidden or 1024)
    except ConfigError as exc:
        problems.extend(exc.problems)
    if problems:
        raise ConfigError(problems)
    return resolved


def prepare_data(cfg: SFTConfig, model_path: str, shared: dict[str, PreparedSplit] | None = None) -> dict[str, PreparedSplit]:
    """Each split's tokenized rows, with its report (from the tokenized-data cache when unchanged).

    ``shared``: the splits a sweep prepared once for trials on its data (:func:`zerolab.data.data_identity`);
    they are taken as they are, so a trial reads no data file (which may exist only on the sweep's
    node) and does not prepare the data again."""
    if shared is not None:
        splits = {name: replace(split, report=replace(split.report, from_sweep=True)) for name, split in shared.items()}
        for split in splits.values():
            logger.info("data %s", split.report.summary())
    else:
        splits = {}
        for split, path in dataset_paths(cfg).items():
            started = time.monotonic()
            splits[split] = prepare_split(split, path, cfg, model_path)
            logger.info("data %s, in %.1f s", splits[split].report.summary(), time.monotonic() - started)
    train = splits["train"].report
    if train.rows_used < cfg.world_size():
        raise DataError(
            f"data.train_path: {train.rows_used} usable rows cannot be split over scaling.num_workers="
            f"{cfg.world_size()} workers; add data or use fewer workers"
        )
    need = cfg.train.micro_batch_size * cfg.world_size()
    if train.rows_used < need and not cfg.data.packing:
        logger.warning("only %d training rows for a global micro-batch of %d", train.rows_used, need)
    return splits


def run_tags(cfg: SFTConfig, commit: str | None) -> dict[str, str]:
    tags = {"task": cfg.data.task, "model": tracking.mask_text(cfg.model.name_or_path), "method": cfg.adapter.method,
            "stage": str(cfg.deepspeed.stage)}
    if commit:
        tags["mlflow.source.git.commit"] = commit.removesuffix("-dirty")
    return tags


def _final_metric_tags(metrics: dict[str, Any]) -> dict[str, str]:
    """The run's last reported loss and throughput, readable on the registered version itself."""
    keys = ("train/loss", "eval/loss", "perf/tokens_per_s", "step")
    return {k: f"{metrics[k]:.6g}" for k in keys if isinstance(metrics.get(k), (int, float))}


def derived_params(cfg: SFTConfig, reports: dict[str, SplitReport], commit: str | None, launch: str) -> dict[str, Any]:
    params: dict[str, Any] = {
        "derived.world_size": cfg.world_size(),
        "derived.launch": launch,
        "derived.global_batch_size": cfg.global_batch_size(),
        "derived.precision": cfg.precision(),
        "derived.deepspeed_config": str(ds_config.config_path(cfg)),
        "versions.python": _platform.python_version(),
        "derived.git_commit": commit or "unknown",
    }
    # Read from package metadata: importing DeepSpeed on the driver would probe accelerators.
    for package in ("zerolab", "torch", "ray", "deepspeed", "transformers", "peft", "mlflow"):
        try:
            params[f"versions.{package}"] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            params[f"versions.{package}"] = zerolab.__version__ if package == "zerolab" else "unknown"
    for split, report in reports.items():
        params[f"data.{split}.fingerprint"] = report.fingerprint[:16]
        params[f"data.{split}.rows_used"] = report.rows_used
        params[f"data.{split}.rows_bad"] = report.rows_bad
        params[f"data.{split}.bad_reasons"] = ", ".join(f"{k}: {v}" for k, v in sorted(report.bad_by_reason.items())) or "none"
        params[f"data.{split}.tokens"] = report.tokens
        params[f"data.{split}.source"] = report.source
    return params


def _log_inputs(run: tracking.TrackedRun, plan: JobPlan, config_file: str | Path | None) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        resolved = {section: tracking.mask_params(values) for section, values in plan.cfg.to_dict().items()}
        (folder / "resolved_config.yaml").write_text(yaml.safe_dump(resolved, sort_keys=False, allow_unicode=True))
        (folder / "deepspeed.json").write_text(json.dumps(plan.deepspeed, indent=2))
        (folder / "data_report.json").write_text(json.dumps({k: r.to_dict() for k, r in plan.reports.items()}, indent=2, ensure_ascii=False))
        if config_file is not None:
            (folder / "job.yaml").write_text(tracking.mask_yaml(Path(config_file).read_text(encoding="utf-8")), encoding="utf-8")
        run.log_artifact(folder, "config")


def build_trainer(plan: JobPlan, uri: str | None, run_id: str | None, stop_flag: Any = None, *, in_tune: bool = False,
                  deadline: float | None = None, resume_from: str | None = None) -> Any:
    """The TorchTrainer for this job (Ray Train V2): same name and storage path = same run, resumed.

    With ``plan.launch == "driver"`` it is Ray Train's local mode (no workers: ``fit()`` calls the
    training function in this process), handed the prepared splits, the run folder its checkpoints
    go to and ``resume_from``, the checkpoint to resume (Ray Train's workers find it themselves)."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer
    from ray.tune.integration.ray_train import TuneReportCallback

    from zerolab.data import worker_datasets
    from zerolab.placement import InDriver
    from zerolab.train import train_loop_per_worker

    cfg = plan.cfg
    s = cfg.scaling
    path, filesystem = trainer_storage(cfg)
    worker_plan = WorkerPlan(sft=cfg, deepspeed=plan.deepspeed, tracking=TrackingTarget(uri, run_id) if run_id else None,
                             stop_flag=stop_flag, deadline_unix=deadline, report_every_log=in_tune)
    if plan.launch == "driver":  # this process took the workers' environment before its imports (run_sft)
        in_driver = InDriver(splits=plan.splits, folder=RunFolder.of(cfg, storage_path(cfg)), resume_from=resume_from,
                             keep=cfg.train.keep_checkpoints, in_tune=in_tune)
        return TorchTrainer(train_loop_per_worker, train_loop_config={"plan": replace(worker_plan, in_driver=in_driver)},
                            scaling_config=ScalingConfig(num_workers=0, use_gpu=s.use_gpu),
                            run_config=RunConfig(name=cfg.run.name, storage_path=path, storage_filesystem=filesystem))
    resources = worker_resources(cfg)
    shards, data_config = worker_datasets(plan.splits, s.num_workers)
    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"plan": worker_plan},
        torch_config=TorchConfig(backend="nccl" if s.use_gpu else "gloo"),
        scaling_config=ScalingConfig(num_workers=s.num_workers, use_gpu=s.use_gpu, resources_per_worker=resources,
                                     placement_strategy=s.placement_strategy),
        run_config=RunConfig(
            name=cfg.run.name,
            storage_path=path,
            storage_filesystem=filesystem,
            failure_config=FailureConfig(max_failures=cfg.run.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.train.keep_checkpoints),
            callbacks=[TuneReportCallback()] if in_tune else None,
        ),
        datasets=shards,
        dataset_config=data_config,
    )


def storage_path(cfg: SFTConfig) -> str:
    path = cfg.run.storage_path
    return path if "://" in path else str(Path(path).expanduser().resolve())


def trainer_storage(cfg: SFTConfig) -> tuple[str, Any]:
    """``storage_path`` and ``storage_filesystem`` for Ray Train's RunConfig. A URI that carries
    credentials (``s3://key:secret@bucket/...``) is resolved here and handed over as a filesystem,
    so Ray Train records and shows the bare path (its run state keeps the storage path)."""
    path = storage_path(cfg)
    if tracking.mask_text(path) == path:
        return path, None
    import pyarrow.fs as pafs

    filesystem, fs_path = pafs.FileSystem.from_uri(path)
    return fs_path, filesystem
