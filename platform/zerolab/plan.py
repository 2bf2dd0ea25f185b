"""Plan: what the driver resolves for a job before anything is launched, once — the model's
config and linear modules, the DeepSpeed JSON, the tokenized data with its reports, the cluster's
limits and the memory estimate — into a :class:`JobPlan` that the checks, the MLflow record, the
trainer and every Tune trial read (workers re-resolve nothing)."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from zerolab import ds_config, memory, quantization, tracking
from zerolab.clock import StartupClock
from zerolab.cluster import CLUSTER_ANSWER_S, cluster_nodes, cluster_resources, connect_ray, reserved_resources, resolve_launch
from zerolab.config import ConfigError, SFTConfig
from zerolab.data import (
    DataError,
    PreparedSplit,
    SplitReport,
    dataset_paths,
    needs_ray_data,
    prepare_split,
    resolve_max_seq_length,
    shard_rows,
)
from zerolab.errors import EnvironmentProblem
from zerolab.memory import Limits, ShardLengths
from zerolab.memory.shapes import max_position_embeddings, rope_scaling_fix

logger = logging.getLogger("zerolab")


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
    deepspeed_file: Path
    """The file it was resolved from."""
    splits: dict[str, PreparedSplit]
    """Tokenized rows of each split (with their fingerprint and token counts)."""
    memory: MemoryCheck
    commit: str | None
    launch: str = "workers"
    """``driver`` (the job's own process trains: Ray Train's local mode) or ``workers``."""
    configured: SFTConfig | None = None
    """The config as given, before ``cfg`` resolved ``data.max_seq_length: auto`` from the data."""

    @property
    def reports(self) -> dict[str, SplitReport]:
        return {name: split.report for name, split in self.splits.items()}



def plan_job(cfg: SFTConfig, *, force: bool = False, clock: StartupClock | None = None,
             shared_data: dict[str, PreparedSplit] | None = None, launch: str | None = None) -> JobPlan:
    """Resolve ``cfg`` against its model, data and cluster (Ray connected): raises ConfigError,
    DataError, ModelLoadError or MemoryPreflightError (unless ``force``) for what cannot run.
    ``shared_data``: a sweep's splits for this trial (:func:`prepare_data`); ``launch``: where it
    trains, when already resolved (``cluster.resolve_launch``)."""
    from zerolab import kernels
    from zerolab.models import load_model_config, resolve_model_path

    quantization.check_available(cfg.model.quantization)
    kernels.check_available(cfg.model.kernels, use_gpu=cfg.scaling.use_gpu)
    model_path = resolve_model_path(cfg.model.name_or_path)
    model_config = load_model_config(cfg.model)
    deepspeed_file = ds_config.config_path(cfg)
    resolved_ds = check_against_model(cfg, model_config, deepspeed_file)
    splits = prepare_data(cfg, model_path, shared_data)
    configured, cfg = cfg, resolve_max_seq_length(cfg, splits)
    if clock:
        clock.mark("model config and data")
    memory = check_memory(cfg, model_config, force=force, datasets=splits)
    if clock:
        clock.mark("memory estimate")
    return JobPlan(cfg, model_path, model_config, resolved_ds, deepspeed_file, splits, memory, tracking.git_commit(),
                   launch or resolve_launch(cfg), configured=configured)



def check_resources(cfg: SFTConfig, launch: str) -> None:
    """Refuse a job the cluster cannot place (Ray Train would otherwise wait for resources forever).
    A worker group cannot use what the job's own process holds (``ray job submit
    --entrypoint-num-gpus/--entrypoint-num-cpus``): that is left out of what the cluster has."""
    import ray

    s = cfg.scaling
    if launch == "driver" and s.use_gpu and os.environ.get("DS_ACCELERATOR", "cuda") != "cuda":
        raise EnvironmentProblem(f"scaling.use_gpu=true, but this process has DS_ACCELERATOR={os.environ['DS_ACCELERATOR']}, "
                                 "which DeepSpeed would train with; unset it, or set scaling.use_gpu=false to train on CPUs.")
    if not ray.is_initialized():  # one worker, in this process, on this machine (cluster.needs_ray)
        import torch

        if s.use_gpu and not torch.cuda.device_count():
            raise EnvironmentProblem("scaling.use_gpu=true but this machine has no CUDA GPU that this process can see; run on a "
                                     "GPU machine, or set scaling.use_gpu=false to train on CPUs.")
        return
    resources = cluster_resources()
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
                "were started without them). Run on a GPU machine/cluster, or set scaling.use_gpu=false to "
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


    calibration = memory.DEFAULT_CALIBRATION if ray.is_initialized() else memory.without_ray()
    try:
        limits = cluster_limits(cfg)
        data = shard_lengths(datasets, cfg.data_parallel_size()) if datasets else None
        try:
            est = memory.preflight(cfg, model_config, limits, calibration=calibration, data=data)
        except memory.MemoryPreflightError as exc:
            if not force:
                raise
            logger.warning("launching anyway, as asked: %s", exc)
            est = exc.estimate
    except memory.MemoryPreflightError:
        raise
    except memory.MemoryEstimateError as exc:
        logger.warning("no memory estimate for this job, so no preflight check: %s", exc)
        return MemoryCheck(note=str(exc))
    by_config = memory.worst_case_by_config(cfg, model_config, est, limits, calibration=calibration)
    logger.info("memory estimate: %s on %s (%s)%s", est.summary(limits), limits.describe(), est.batch.describe(),
                f"; {by_config}" if by_config else "")
    for note in est.notes:
        logger.info("memory estimate: %s", note)
    return MemoryCheck(est, limits, by_config=by_config)



def shard_lengths(datasets: dict[str, PreparedSplit], world_size: int) -> Any:
    """The token length of every row of each rank's shards (a ``zerolab.memory.ShardLengths``), as
    :func:`zerolab.data.shard_rows` deals them to the workers."""

    def by_rank(split: PreparedSplit, equal: bool) -> list[list[int]]:
        return [split.lengths[rows].tolist() for rows in shard_rows(split.num_rows, world_size, equal=equal)]

    return ShardLengths(by_rank(datasets["train"], True), by_rank(datasets["eval"], False) if "eval" in datasets else [])



def job_shard_lengths(cfg: SFTConfig) -> Any:
    """The job's shards (``shard_lengths``) from its data as a run would prepare it (its files, or
    the task's generated ones; the tokenized-data cache when unchanged), without starting workers
    (Ray is connected where the data takes Ray Data)."""
    from zerolab.models import resolve_model_path

    if needs_ray_data(cfg):
        connect_ray(cfg)
    splits = prepare_data(cfg, resolve_model_path(cfg.model.name_or_path))
    return shard_lengths(splits, cfg.data_parallel_size())



def cluster_limits(cfg: SFTConfig) -> Any:
    """GPU memory and host RAM of the Ray nodes that can run this job's workers, measured on each
    node by a zero-resource task (the driver may sit on a machine without GPUs), the driver's own
    node in-process (a task's new worker process costs seconds): the smallest GPU and the smallest
    RAM among them, so the check holds wherever Ray places the workers."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy


    if not ray.is_initialized():  # the job trains in this process (cluster.needs_ray)
        return Limits.detect()

    @ray.remote(num_cpus=0)
    def detect() -> Limits:
        return Limits.detect_with_nvml()

    nodes = [n for n in cluster_nodes() if n["Alive"] and (not cfg.scaling.use_gpu or n["Resources"].get("GPU", 0) > 0)
             and n["Resources"].get("CPU", 0) >= cfg.scaling.cpus_per_worker]
    here = ray.get_runtime_context().get_node_id()
    probes = [detect.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote()
              for n in nodes if n["NodeID"] != here]
    try:
        found = ray.get(probes, timeout=CLUSTER_ANSWER_S)
    except ray.exceptions.GetTimeoutError:
        raise EnvironmentProblem(f"{len(probes)} Ray node(s) did not run the job's memory probe (a task that takes no resources) "
                                 f"within {CLUSTER_ANSWER_S:g} s: a node is unreachable or cannot start a worker process. "
                                 "`ray status` shows the nodes; remove or restart the sick one, then relaunch.") from None
    found += [Limits.detect_with_nvml() for n in nodes if n["NodeID"] == here]
    gpu = [f.gpu_mem_bytes for f in found if f.gpu_mem_bytes] if cfg.scaling.use_gpu else []
    host = [f.host_mem_bytes for f in found if f.host_mem_bytes]
    per_node = max((f.gpus_per_node or 0) for f in found) if cfg.scaling.use_gpu and found else None
    return Limits(gpu_mem_bytes=min(gpu) if gpu else None, gpus_per_node=per_node or None,
                  host_mem_bytes=min(host) if host else None, num_nodes=max(1, len(found)),
                  source=f"detected on {len(found)} Ray node(s)")



def check_against_model(cfg: SFTConfig, model_config: Any, deepspeed_file: Path) -> dict[str, Any]:
    """Checks that need the model's architecture (``model_config``, see ``zerolab.models.load_model_config``);
    returns the resolved DeepSpeed config. Problems from both are reported together."""
    from zerolab.models import linear_module_names
    from zerolab.sequence_parallel import head_problems

    problems: list[str] = head_problems(cfg.scaling.sequence_parallel_size, model_config, cfg.model.name_or_path)
    linear = linear_module_names(cfg.model, model_config)
    if cfg.adapter.is_peft() and list(cfg.adapter.target_modules) != ["all-linear"]:
        missing = [m for m in cfg.adapter.target_modules if m not in linear]
        if missing:
            problems.append(
                f"adapter.target_modules: {missing} are not linear modules of {cfg.model.name_or_path}; "
                f"choose from {sorted(linear)} or use [all-linear]"
            )
    problems.extend(_position_problems(cfg, model_config))
    resolved: dict[str, Any] = {}
    try:
        resolved = ds_config.resolve(cfg, model_config, deepspeed_file)
    except ConfigError as exc:
        problems.extend(exc.problems)
    if problems:
        raise ConfigError(problems)
    return resolved



def _position_problems(cfg: SFTConfig, model_config: Any) -> list[str]:
    """A set ``data.max_seq_length`` past the positions the model reaches: its ``max_position_embeddings``,
    times ``model.rope_factor`` with ``model.rope_scaling`` (``auto`` stops there by itself)."""
    length = cfg.data.max_seq_length
    reach = max_position_embeddings(model_config, cfg.model)
    if length == "auto" or reach is None or length <= reach:
        return []
    m = cfg.model
    where = ("its max_position_embeddings" if m.rope_scaling == "none"
             else f"model.rope_scaling={m.rope_scaling} with model.rope_factor={m.rope_factor:g}")
    return [f"data.max_seq_length: {length:,} tokens is past the {reach:,} positions {m.name_or_path} reaches ({where}), where "
            f"its positions would be ones it never trained on; set {' and '.join(rope_scaling_fix(length, model_config, m))} "
            f"(RoPE scaling to {length:,} tokens), or lower data.max_seq_length to {reach} or less"]


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
    if train.rows_used < cfg.data_parallel_size():
        raise DataError(
            f"data.train_path: {train.rows_used} usable rows cannot be split over "
            f"{cfg.data_parallel_size()} data-parallel shards (scaling.num_workers / scaling.sequence_parallel_size); "
            "add data or use fewer workers"
        )
    need = cfg.train.micro_batch_size * cfg.data_parallel_size()
    if train.rows_used < need and not cfg.data.packing:
        logger.warning("only %d training rows for a global micro-batch of %d", train.rows_used, need)
    return splits
