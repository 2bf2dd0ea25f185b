"""The driver side of an SFT job, in the order of its phases: open the run folder and check the
environment, connect to Ray, plan (:mod:`zerolab.plan`), open the MLflow record, fit the
``TorchTrainer``, and record the outcome (adapter, registration, evaluation)."""

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
from zerolab import stop, tracking
from zerolab.cadence import STOPPED_AT_DEADLINE
from zerolab.checkpoints import RunFolder, RunRecord, check_same_data, check_storage, location, prepare_run_folder
from zerolab.clock import StartupClock
from zerolab.cluster import (
    adopt_worker_env,
    cluster_nodes,
    connect_ray,
    import_now,
    job_imports,
    may_train_in_driver,
    needs_ray,
    resolve_launch,
    worker_resources,
)
from zerolab.config import ConfigError, SFTConfig
from zerolab.data import PreparedSplit, needs_ray_data, worker_datasets
from zerolab.memory import measure_worker_imports_meanwhile
from zerolab.plan import JobPlan, check_resources, plan_job
from zerolab.stop import DeadlineReached, Interrupted, NoFinalCheckpoint, StopSignal
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
    trial, and the MLflow run is a child of ``parent_run_id``; a trial that Tune stops leaves its run
    open for the sweep's driver to close with the status Tune saw. ``launched`` (the job process's
    start time) starts the start-up clock and ``run.max_wall_time_s``; by default, the call.
    ``shared_data``: the splits a sweep prepared once for its trials (:func:`prepare_data`).
    ``stop_flag``: a :class:`StopFlag` actor that stops the run when set (a warm trainer's job sets it).
    """
    clock = StartupClock(launched)
    cfg = with_run_name(cfg)
    check_registry_name(cfg)
    storage = storage_path(cfg)
    check_storage(storage)
    if cfg.train.memory_snapshot_dir:  # this node's; a cluster's workers write on their own
        check_storage(cfg.train.memory_snapshot_dir, "train.memory_snapshot_dir", "allocator histories")
    folder = RunFolder.of(cfg, storage)
    stopper: StopSignal | None = None
    try:
        with folder.locked():
            resume = prepare_run_folder(cfg, storage, restart=restart)
            uri = _store_of(cfg, storage, resume.record)
            tracking.check_store(uri)
            store = tracking.StoreCheck(uri, cfg.tracking.experiment, registry=cfg.tracking.register)
            clock.mark("run folder and MLflow store checks")
            if not cfg.scaling.use_gpu:  # the memory estimate's CPU-worker baseline, measured beside the imports below
                measure_worker_imports_meanwhile()
            if may_train_in_driver(cfg):
                adopt_worker_env(cfg)
            if needs_ray(cfg) or needs_ray_data(cfg):
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
                except SystemExit:
                    # Ray Tune ends the thread of a trial it stops (the sweep's Ctrl-C, ASHA, max_t) this way,
                    # at the trial's next report, and does not wait for it: the sweep's driver gives the run
                    # the status Tune saw (tune._finish_children), and a close here could land after it.
                    run.status, record.status = (None if in_tune else "KILLED"), "stopped"
                    raise
                finally:
                    with stop.shielded():
                        _settle_record(folder, record, run.status)
    except KeyboardInterrupt:
        if stopper is not None and stopper.fitting:
            raise
        raise Interrupted(f"stopped during start-up, before training began: nothing was trained. Relaunch with "
                          f"run.name={cfg.run.name} to start it (it keeps this run's MLflow record).", run_name=cfg.run.name) from None


def no_final_checkpoint(folder: RunFolder, metrics: dict[str, Any], run_name: str) -> NoFinalCheckpoint:
    """The error of a run whose training ended without a final checkpoint handed back: where the
    run folder's latest checkpoint is, and how to go on from it."""
    latest = folder.latest_checkpoint()
    after = f" after step {metrics['step']}" if "step" in metrics else ""
    where = (f"{latest} as its latest; relaunch with run.name={run_name} to resume there" if latest
             else f"none; relaunch with run.name={run_name} to train it again")
    return NoFinalCheckpoint(f"training ended{after} without Ray Train handing back a final checkpoint; the run folder "
                             f"{folder.uri} holds {where}.")


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
    configured = (plan.configured or cfg).flat()  # data.max_seq_length as given; derived.max_seq_length as resolved
    run.log_params(tracking.mask_params({**configured, **derived_params(plan), **memory.params()}))
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
    if checkpoint is None:  # Ray Train V2's result holds its checkpoint manager's latest, which can miss the last report
        raise no_final_checkpoint(folder, metrics, cfg.run.name)
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
                                          tags={"run_name": cfg.run.name, **_final_metric_tags(metrics), **_base_tags(cfg)})
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


def warn_if_node_local(tracking_uri: str) -> None:
    """Warn when the MLflow store is a file on this machine and the cluster has other nodes: rank 0
    logs metrics from its own node, where that file exists only on a filesystem all nodes mount."""
    import ray

    if not ray.is_initialized() or not tracking_uri.startswith(("sqlite:", "file:", "/", ".", "~")):
        return
    nodes = sum(1 for node in cluster_nodes() if node["Alive"])
    if nodes > 1:
        logger.warning("MLflow store %s is a file, and the Ray cluster has %d nodes: workers on other nodes can log to it "
                       "only if every node mounts it at the same path. Otherwise set MLFLOW_TRACKING_URI (or tracking.uri) "
                       "to a tracking server that the nodes reach; infra/ starts one.", tracking_uri, nodes)


def run_tags(cfg: SFTConfig, commit: str | None) -> dict[str, str]:
    tags = {"task": cfg.data.task, "model": tracking.mask_text(cfg.model.name_or_path), "method": cfg.adapter.method,
            "stage": str(cfg.deepspeed.stage), **_base_tags(cfg)}
    if commit:
        tags["mlflow.source.git.commit"] = commit.removesuffix("-dirty")
    return tags


def _base_tags(cfg: SFTConfig) -> dict[str, str]:
    """Says that the adapter was trained on a quantized base (and loads onto one the same way)."""
    return {"base_quantization": cfg.model.quantization} if cfg.model.quantization != "none" else {}


def _final_metric_tags(metrics: dict[str, Any]) -> dict[str, str]:
    """The run's last reported loss and throughput, readable on the registered version itself."""
    keys = ("train/loss", "eval/loss", "perf/tokens_per_s", "step")
    return {k: f"{metrics[k]:.6g}" for k in keys if isinstance(metrics.get(k), (int, float))}


def derived_params(plan: JobPlan) -> dict[str, Any]:
    """The plan's MLflow params beside the config's: sizes, versions, data reports."""
    cfg, commit = plan.cfg, plan.commit
    params: dict[str, Any] = {
        "derived.world_size": cfg.world_size(),
        "derived.launch": plan.launch,
        "derived.global_batch_size": cfg.global_batch_size(),
        "derived.precision": cfg.precision(),
        "derived.max_seq_length": cfg.data.max_seq_length,
        "derived.deepspeed_config": str(plan.deepspeed_file),
        "versions.python": _platform.python_version(),
        "derived.git_commit": commit or "unknown",
    }
    # Read from package metadata: importing DeepSpeed on the driver would probe accelerators.
    for package in ("zerolab", "torch", "ray", "deepspeed", "transformers", "peft", "mlflow"):
        try:
            params[f"versions.{package}"] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            params[f"versions.{package}"] = zerolab.__version__ if package == "zerolab" else "unknown"
    for split, report in plan.reports.items():
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
    from ray.train.torch import TorchTrainer
    from ray.tune.integration.ray_train import TuneReportCallback

    from zerolab.placement import InDriver
    from zerolab.rendezvous import HeldPortTorchConfig
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
    shards, data_config = worker_datasets(plan.splits, s.num_workers, s.sequence_parallel_size)
    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"plan": worker_plan},
        torch_config=HeldPortTorchConfig(backend="nccl" if s.use_gpu else "gloo"),
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
