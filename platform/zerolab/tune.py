"""Ray Tune sweeps over any job config key: each trial is one zerolab SFT run (Train V2 pattern:
the trial function builds its own ``TorchTrainer`` with ``TuneReportCallback``).

A sweep file (YAML) says what to vary and how to search::

    name: stage-x-rank            # Tune experiment, MLflow parent run, results folder
    metric: perf/tokens_per_s     # objective: any metric a run reports
    mode: max
    search: grid                  # grid | random | optuna
    num_samples: 1                # grid: repeats of the grid; random/optuna: trials
    scheduler: asha               # none | asha (early stopping on the metric)
    grace_period: 10              # asha: steps before a trial can be stopped
    batch: keep_accum             # micro_batch_size changes: keep_accum | keep_global
    set: {train.max_steps: 40}    # overrides for every trial
    space:
      deepspeed.zero: {grid: ["0", "2", "2+optimizer", "3"]}   # stage and offload in one key
      adapter.r: {grid: [8, 16]}
      train.lr: {loguniform: [1.0e-4, 1.0e-3]}

Every sampled config is validated, and (for grids) checked by the memory estimator, before
``Tuner.fit()``; a trial the estimator says cannot fit is skipped with the reason, not launched.
The first SIGINT or SIGTERM ends a sweep resumably: its unfinished trials are reported INTERRUPTED.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import threading
from collections.abc import Collection, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml
from ray.tune import Callback

from zerolab import compare, memory, tracking
from zerolab.checkpoints import RunFinished
from zerolab.cluster import cluster_resources, connect_ray, may_train_in_driver, shutdown_ray, start_data_stats_actor, worker_resources
from zerolab.compare import format_value, run_labels
from zerolab.config import ConfigError, SFTConfig
from zerolab.data import data_identity
from zerolab.errors import EnvironmentProblem, root_cause
from zerolab.plan import cluster_limits, prepare_data, shard_lengths
from zerolab.run import run_sft
from zerolab.sweep import Sweep, SweepError, base_config, save_definition, sweep_dict, sweep_path, trial_config, validate_space

logger = logging.getLogger("zerolab.tune")

SKIPPED = "skipped"
INTERRUPTED = "INTERRUPTED"
"""A trial's status when the sweep was stopped (SIGINT/SIGTERM) before it finished: ``--resume`` continues it."""


def max_concurrent(cfg: SFTConfig) -> int:
    """Trials that fit the cluster at once: its GPUs (or CPUs) over what one trial's workers take,
    so no trial waits on resources another holds."""
    resources = cluster_resources()
    s = cfg.scaling
    if s.use_gpu:
        return max(1, int(resources.get("GPU", 0)) // s.num_workers)
    return max(1, int(resources.get("CPU", 0) // (s.num_workers * s.cpus_per_worker)))


LAUNCH_KEYS = frozenset({"scaling.num_workers", "scaling.launch", "scaling.use_gpu", "scaling.cpus_per_worker", "run.max_failures"})
"""Search-space keys that change what a trial's process must reserve."""


def trains_in_trial(base: SFTConfig, sweep: Sweep) -> bool:
    """Whether each trial trains in its own Tune actor (``scaling.launch`` auto or driver, one
    worker, no retries, the same for every point): the actor then reserves the worker's CPUs/GPU,
    and Tune reuses it for the next trial, so a trial after the first starts with its imports
    done and no worker group to form."""

    return may_train_in_driver(base) and not any(d.key in LAUNCH_KEYS for d in sweep.space)


def reuses_actors(base: SFTConfig, sweep: Sweep) -> bool:
    """Whether Tune keeps a trial's actor for the next trial: always where trials train in their
    actors (:func:`trains_in_trial`); for trials that drive a worker group where no scheduler stops
    trials early. Their actor imported the training stack to build its trainer, which the next trial
    then finds imported (10-14 s a trial on the 2-core CPU machine). A worker-group trial that ASHA
    stops is still driving its workers when Tune resets its actor for the next trial: Tune (2.60)
    then fails to reuse the actor and the sweep stalls, so such sweeps start an actor per trial."""
    return trains_in_trial(base, sweep) or sweep.scheduler == "none"


@dataclass
class TrialRow:
    trial_id: str
    run_name: str
    params: dict[str, Any]
    status: str
    objective: float | None
    metrics: dict[str, Any]
    note: str = ""


@dataclass(frozen=True)
class SweepData:
    """The base job's splits, prepared once on the sweep's driver and handed to every trial on the
    same data (:func:`zerolab.data.data_identity`); a trial whose params change the data prepares its own."""

    identity: tuple
    splits: dict[str, Any]

    @classmethod
    def prepare(cls, base: SFTConfig) -> SweepData:
        """Raises DataError (or ModelLoadError) for data no trial could train on."""
        from zerolab.models import resolve_model_path

        return cls(data_identity(base), prepare_data(base, resolve_model_path(base.model.name_or_path)))

    def for_trial(self, cfg: SFTConfig) -> dict[str, Any] | None:

        return self.splits if data_identity(cfg) == self.identity else None


def trial_function(config: dict[str, Any], *, base: SFTConfig, sweep: Sweep, data: SweepData, parent_run_id: str, uri: str) -> None:
    """One trial: run the SFT job for these params as a child MLflow run, on the sweep's prepared
    data. A trial the memory estimator refuses reports itself skipped (with the reason) instead of
    launching workers."""
    import ray.tune


    trial_id = ray.tune.get_context().get_trial_id()
    cfg = trial_config(base, sweep, config, run_name=f"{sweep.name}-{trial_id}")
    cfg = cfg.replace(tracking=replace(cfg.tracking, uri=uri, register=False))
    try:
        run_sft(cfg, parent_run_id=parent_run_id, in_tune=True, shared_data=data.for_trial(cfg))
    except RunFinished as exc:
        # Resumed sweeps rerun a trial whose run finished after Tune's last saved result: its
        # run's final metrics are the trial's result; nothing trains again.
        final = tracking.mlflow_client(uri).get_run(exc.record.run_id).data.metrics if exc.record.run_id else {}
        ray.tune.report({**final, "step": exc.record.step or 0})
    except memory.MemoryPreflightError as exc:
        reason = str(exc).splitlines()[0]
        with tracking.tracked_run(uri, cfg.tracking.experiment, cfg.run.name,
                                  tags={"mlflow.parentRunId": parent_run_id, "zerolab.skipped": reason[:5000]}) as skipped:
            skipped.status = "KILLED"
        ray.tune.report({SKIPPED: 1, "reason": reason})


def run_sweep(base: SFTConfig, sweep: Sweep, *, resume: bool = False, out_dir: str | Path | None = None) -> list[TrialRow]:
    """Run (or resume) the sweep; returns the ranked trial rows and writes the results table."""
    from ray import tune
    from ray.tune import RunConfig as TuneRunConfig
    from ray.tune import TuneConfig, Tuner


    base_cfg = base_config(base, sweep)
    points = validate_space(base_cfg, sweep)
    connect_ray(base_cfg, log_to_driver=False)
    uri = tracking.tracking_uri(base_cfg.tracking.uri, base_cfg.run.storage_path)
    stop = SweepStop()
    try:
        data = SweepData.prepare(base_cfg)
        if not trains_in_trial(base_cfg, sweep):
            start_data_stats_actor()
        with tracking.tracked_run(uri, base_cfg.tracking.experiment, sweep.name, tags={"zerolab.sweep": sweep.name}) as parent:
            parent_id = parent.run_id
            logger.info("sweep %s: MLflow parent run %s (%s); %s search over %s", sweep.name, parent_id,
                        "resumed" if parent.resumed else "new", sweep.search, ", ".join(d.key for d in sweep.space))
            if sweep.search == "grid":
                _announce_skips(base_cfg, sweep, points, data)
            concurrent = sweep.max_concurrent_trials or max_concurrent(base_cfg)
            in_trial = trains_in_trial(base_cfg, sweep)
            trainable = tune.with_resources(
                tune.with_parameters(trial_function, base=base_cfg, sweep=sweep, data=data, parent_run_id=parent_id, uri=uri),
                # A trial that trains in its actor reserves its worker's resources; one that drives
                # a worker group leaves them to the workers (Tune needs a non-empty request, and a
                # byte of memory takes nothing they need).
                worker_resources(base_cfg) if in_trial else {"memory": 1})
            parent.log_params({"sweep.search": sweep.search, "sweep.metric": sweep.metric, "sweep.mode": sweep.mode,
                               "sweep.scheduler": sweep.scheduler, "sweep.max_concurrent_trials": concurrent,
                               **{f"sweep.space.{d.key}": f"{d.kind} {list(d.values)}" for d in sweep.space}})
            _log_yaml(uri, parent_id, "search_space.yaml", sweep_dict(sweep))
            experiment_path = sweep_path(base_cfg, sweep)
            logger.info("sweep %s: per-trial scalars and HParams, kept in the sweep folder: tensorboard --logdir %s",
                        sweep.name, tracking.mask_text(experiment_path))
            if resume:
                if not Tuner.can_restore(experiment_path):
                    raise SweepError([f"resume {sweep.name}: no sweep to resume at {experiment_path}; start it anew"])
                tuner = Tuner.restore(experiment_path, trainable=trainable, resume_errored=False, restart_errored=False)
            else:
                save_definition(experiment_path, base, sweep)
                tuner = Tuner(
                    trainable,
                    param_space={d.key: d.tune_domain() for d in sweep.space},
                    tune_config=TuneConfig(
                        num_samples=sweep.num_samples, max_concurrent_trials=concurrent, search_alg=_searcher(sweep),
                        reuse_actors=reuses_actors(base_cfg, sweep),
                        scheduler=_scheduler(sweep, base_cfg),
                        trial_name_creator=lambda t: f"{sweep.name}-{t.trial_id}", trial_dirname_creator=lambda t: t.trial_id,
                    ),
                    run_config=TuneRunConfig(name=sweep.name, storage_path=experiment_path.rsplit("/", 1)[0], verbose=0, callbacks=[OneLinePerTrial(sweep)]),
                )
            with stop.handling():
                grid = tuner.fit()
            rows = _rows(grid, sweep, stop.unfinished(experiment_path))
            cut = sum(r.status == INTERRUPTED for r in rows)
            if stop.signal_name and not cut and len(rows) < sweep.num_samples * len(sweep.grid_points()):
                raise KeyboardInterrupt  # stopped between trials: none to mark, the rest not started yet
            _finish_children(uri, base_cfg.tracking.experiment, rows)
            write_results(rows, sweep, uri, base_cfg.tracking.experiment, parent_id, results_dir(sweep, out_dir))
            if cut:
                logger.warning("sweep %s stopped by %s: %d unfinished trial(s) interrupted; --resume %s continues them",
                               sweep.name, stop.signal_name, cut, sweep.name)
                parent.status = "KILLED"
                return rows
            best = next((r for r in rows if r.status == "FINISHED" and r.objective is not None), None)
            if best is not None:
                _log_yaml(uri, parent_id, "best_config.yaml", trial_config(base_cfg, sweep, best.params, best.run_name).to_dict())
                parent.log_params({"sweep.best_trial": best.trial_id})
                parent.log_metrics({f"best/{sweep.metric}": best.objective}, step=0)
            parent.status = "FINISHED"
            return rows
    finally:
        shutdown_ray()


class SweepStop:
    """Ctrl-C for a sweep. While :meth:`handling` is active, the first SIGINT or SIGTERM asks Tune to
    end the sweep as its own Ctrl-C does: it saves the sweep's state, stops the running trials and
    ``fit()`` returns; ``--resume`` continues the unfinished trials from their last checkpoints. A
    second signal, or one before Tune's loop is ready to stop, raises KeyboardInterrupt at once.

    Tune's own SIGINT handler is off meanwhile: it takes the signal without a trace the sweep could
    read afterwards (it then ends the cut trials TERMINATED, like finished ones), and leaves SIGTERM
    to kill the driver without saving anything."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._tune_stop: Any = None

    def _handle(self, signum: int, frame: Any) -> None:
        tune_stop = signal.getsignal(signal.SIGUSR1)
        if self.signal_name is not None or not callable(tune_stop) or tune_stop is self._tune_stop:
            raise KeyboardInterrupt
        self.signal_name = signal.Signals(signum).name
        logger.warning("%s received: the sweep stops once Tune has saved its state (the running trials are cut short, "
                       "--resume continues them); send it again to abort at once", self.signal_name)
        tune_stop(signum, frame)  # Tune's stop (its handler of SIGUSR1, installed by fit())

    @contextlib.contextmanager
    def handling(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield  # signal handlers can only be set from the main thread: Tune's own then
            return
        self._tune_stop = signal.getsignal(signal.SIGUSR1)  # not yet fit()'s: a previous one's, or none
        previous = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        disabled = os.environ.get("TUNE_DISABLE_SIGINT_HANDLER")
        os.environ["TUNE_DISABLE_SIGINT_HANDLER"] = "1"
        try:
            yield
        finally:
            if disabled is None:
                os.environ.pop("TUNE_DISABLE_SIGINT_HANDLER", None)
            else:
                os.environ["TUNE_DISABLE_SIGINT_HANDLER"] = disabled
            for s, handler in {**previous, signal.SIGUSR1: self._tune_stop}.items():
                signal.signal(s, handler)

    def unfinished(self, experiment_path: str) -> set[str]:
        """The trials the stop cut short: those the state Tune saved (what ``--resume`` reads) has
        pending or running; none when no signal came."""
        if self.signal_name is None:
            return set()
        from ray.tune import ExperimentAnalysis

        return {t.trial_id for t in ExperimentAnalysis(experiment_path).trials if t.status not in ("TERMINATED", "ERROR")}


def resumable(base: SFTConfig, sweep: Sweep) -> bool:
    """Whether ``--resume`` can continue the sweep: Tune saved its state in the sweep folder."""
    from ray.tune import Tuner

    return Tuner.can_restore(sweep_path(base_config(base, sweep), sweep))


def _announce_skips(base: SFTConfig, sweep: Sweep, points: list[dict[str, Any]], data: SweepData) -> None:
    """Before the sweep: which grid points the memory estimator says will not fit (by their data,
    as the trials will check them)."""
    from zerolab.models import ModelLoadError, load_model_config

    limits, model_configs = None, {}
    for point in points:
        try:
            cfg = trial_config(base, sweep, point, f"{sweep.name}-check")
            limits = limits or cluster_limits(cfg)
            model = (cfg.model.name_or_path, cfg.model.revision)
            if model not in model_configs:
                model_configs[model] = load_model_config(cfg.model)
            splits = data.for_trial(cfg)
            memory.preflight(cfg, model_configs[model], limits, data=shard_lengths(splits, cfg.data_parallel_size()) if splits else None)
        except memory.MemoryPreflightError as exc:
            label = ", ".join(f"{k}={v}" for k, v in point.items())
            logger.warning("will skip {%s}: %s", label, str(exc).splitlines()[0])
        except (memory.MemoryEstimateError, ModelLoadError, ConfigError, EnvironmentProblem):
            continue  # an estimate that cannot be made here decides nothing; the trial reports it


def _searcher(sweep: Sweep) -> Any:
    if sweep.search != "optuna":
        return None
    from ray.tune.search.optuna import OptunaSearch

    return OptunaSearch(metric=sweep.metric, mode=sweep.mode, seed=sweep.seed)


def _scheduler(sweep: Sweep, cfg: SFTConfig) -> Any:
    if sweep.scheduler != "asha":
        return None
    from ray.tune.schedulers import ASHAScheduler

    return ASHAScheduler(time_attr="step", metric=sweep.metric, mode=sweep.mode, max_t=max(cfg.train.max_steps or 10**9, 1),
                         grace_period=sweep.grace_period, reduction_factor=sweep.reduction_factor)


class OneLinePerTrial(Callback):
    """One log line per trial result, completion and error instead of Tune's status tables."""

    def __init__(self, sweep: Sweep) -> None:
        self.sweep = sweep

    def on_trial_result(self, iteration, trials, trial, result, **info):
        if result.get(SKIPPED):
            return
        value = result.get(self.sweep.metric)
        shown = f"{value:.4g}" if isinstance(value, (int, float)) else "-"
        logger.info("[%s] step %s  %s=%s  %s", trial.trial_id, result.get("step", "?"), self.sweep.metric, shown, _label(trial.config))

    def on_trial_complete(self, iteration, trials, trial, **info):
        result = trial.last_result or {}
        if result.get(SKIPPED):
            logger.info("[%s] skipped: %s  %s", trial.trial_id, result.get("reason"), _label(trial.config))
        else:
            logger.info("[%s] done  %s", trial.trial_id, _label(trial.config))

    def on_trial_error(self, iteration, trials, trial, **info):
        logger.warning("[%s] FAILED  %s (the sweep goes on)", trial.trial_id, _label(trial.config))


def _label(config: dict[str, Any]) -> str:
    return " ".join(f"{k.split('.')[-1]}={v:.3g}" if isinstance(v, float) else f"{k.split('.')[-1]}={v}" for k, v in config.items())


def _rows(grid: Any, sweep: Sweep, interrupted: Collection[str] = ()) -> list[TrialRow]:
    """One row per trial; those in ``interrupted`` (cut short by a stopped sweep) are INTERRUPTED."""

    rows = []
    for result in grid:
        metrics = dict(result.metrics or {})
        trial_id = metrics.get("trial_id") or Path(result.path).name
        params = {k: v for k, v in (result.config or {}).items()}
        if metrics.get(SKIPPED):
            status, note = "SKIPPED", str(metrics.get("reason", ""))
        elif result.error is not None:
            status, note = "ERROR", root_cause(result.error)
        elif trial_id in interrupted:
            status, note = INTERRUPTED, f"at step {metrics['step']}" if "step" in metrics else "before its first report"
        elif metrics.get("perf/wall_s") is None:
            status, note = "STOPPED", f"stopped early at step {metrics.get('step', '?')} ({sweep.scheduler})"
        else:
            status, note = "FINISHED", ""
        objective = metrics.get(sweep.metric) if status in ("FINISHED", "STOPPED", INTERRUPTED) else None
        rows.append(TrialRow(trial_id, f"{sweep.name}-{trial_id}", params, status, objective, metrics, note))
    return _ranked(rows, sweep)


def _ranked(rows: list[TrialRow], sweep: Sweep) -> list[TrialRow]:
    """Finished trials first, best objective first; then stopped, interrupted, failed and skipped ones."""
    sign = -1 if sweep.mode == "max" else 1
    order = {"FINISHED": 0, "STOPPED": 1, INTERRUPTED: 2, "ERROR": 3, "SKIPPED": 4}
    return sorted(rows, key=lambda r: (order[r.status], sign * r.objective if r.objective is not None else math.inf, r.trial_id))


def _finish_children(uri: str, experiment: str, rows: list[TrialRow]) -> None:
    """Give each trial's MLflow run the status Tune saw (and a row whose run finished, that status).
    Tune ends a trial by stopping its actor, at
    ASHA's decision, right after the last report when the trial reached ``max_t``, or when the sweep
    is stopped, so the run may still say RUNNING (a trial stopped at a report leaves its run open for
    this, see :func:`zerolab.run.run_sft`) or FAILED (an interrupted trial's run ends KILLED, as a
    stopped job's does, and ``--resume`` reopens it); a trial that finished training gets its
    adapter logged from the checkpoint it reported if the actor stopped before doing so."""
    from ray.train import Checkpoint

    client = tracking.mlflow_client(uri)
    exp = client.get_experiment_by_name(experiment)
    wanted = {"FINISHED": "FINISHED", "STOPPED": "KILLED", INTERRUPTED: "KILLED", "ERROR": "FAILED"}
    for row in rows:
        runs = client.search_runs([exp.experiment_id], filter_string=f"tags.`{tracking.RUN_NAME_TAG}` = '{row.run_name}'",
                                  max_results=1)
        if runs and row.status in ("STOPPED", INTERRUPTED) and runs[0].info.status == "FINISHED":
            # Finished, but the sweep was killed before Tune saved the trial's last result.
            row.status, row.note = "FINISHED", ""
        if not runs or row.status not in wanted or runs[0].info.status == wanted[row.status]:
            continue
        run_id = runs[0].info.run_id
        checkpoint = row.metrics.get("checkpoint_path")
        if row.status == "FINISHED" and checkpoint and not any(a.path == "adapter" for a in client.list_artifacts(run_id)):
            with Checkpoint(checkpoint).as_directory() as folder:
                tracking.log_artifact(uri, run_id, Path(folder) / "adapter", "adapter")
        if row.status != INTERRUPTED:  # its run goes on under --resume
            client.set_tag(run_id, "zerolab.trial_status", row.note or row.status)
        client.set_terminated(run_id, wanted[row.status])


RESULT_COLUMNS = (("tokens_per_s", "perf/tokens_per_s"), ("gpu_peak_gib", "mem/gpu_peak_allocated_gib"),
                  ("host_rss_gib", "mem/host_rss_peak_gib"), ("gpu_util_pct", "gpu_util_pct"), ("cpu_util_pct", "cpu_util_pct"),
                  ("train_loss", "train/loss"), ("eval_loss", "eval/loss"), ("wall_s", "wall_s"), ("startup_s", "startup_s"),
                  ("training_s", "training_s"))
"""Table column -> trial metric (utilisation: the mean of the run's MLflow system metrics; wall time:
the whole MLflow run, its start-up to the first step, and its training)."""


def results_table(rows: list[TrialRow], sweep: Sweep) -> tuple[list[str], list[list[str]]]:
    """Ranked: rank, run (its label: the values that differ, e.g. ``ZeRO-3 + offload, r=16``), each
    space key, objective, tokens/s, peak GPU/host memory, utilisation, losses, wall time with
    start-up and training apart (the columns some trial has), status, trial id."""

    keys = [d.key for d in sweep.space]
    extra = [(c, m) for c, m in RESULT_COLUMNS if m != sweep.metric and any(r.metrics.get(m) is not None for r in rows)]
    header = ["rank", "run", *keys, sweep.metric, *[c for c, _ in extra], "status", "trial"]
    cells = []
    names = run_labels([{k: r.params.get(k) for k in keys} for r in rows], [r.trial_id for r in rows])
    for i, (r, name) in enumerate(zip(rows, names), 1):
        status = r.status + (f": {r.note}" if r.note else "")
        cells.append([str(i), name, *(str(r.params.get(k, "")) for k in keys), format_value(r.objective),
                      *(format_value(r.metrics.get(m)) for _, m in extra), status, r.trial_id])
    return header, cells


def write_results(rows: list[TrialRow], sweep: Sweep, uri: str, experiment: str, parent_id: str, out: Path) -> dict[str, Path]:
    """``results.csv``/``results.md`` (ranked) and the comparison chart of the trials' runs, in
    ``out`` and as parent-run artifacts; returns their paths."""
    import csv


    out.mkdir(parents=True, exist_ok=True)
    try:
        runs = compare.collect(uri, experiment, parent_id)
    except compare.CompareError:
        runs = []
    # The figures the comparison chart shows, from each run's whole MLflow history: throughput as the
    # median after warm-up, memory as the peak, utilisation as the mean (Tune keeps the last window).
    by_name = {r.name: r for r in runs}
    summarised = {metric: column for column, (metric, _) in compare.METRICS.items()}
    for row in rows:
        run = by_name.get(row.run_name)
        if run is None:
            continue
        # The trial's own first-step time and training time (Tune's last result) with its MLflow run's span.
        if row.metrics.get("perf/first_step_unix"):
            run.values.update(compare.timing(run.start_unix, run.end_unix, first_step_unix=row.metrics["perf/first_step_unix"],
                                             training_s=row.metrics.get("perf/wall_s") or run.values.get("training_s")))
        row.metrics.update({k: run.values.get(k) for k in (*compare.UTILISATION, *compare.TIMING)})
        row.metrics.update({m: run.values[c] for m, c in summarised.items() if run.values.get(c) is not None})
        if row.objective is not None and sweep.metric in summarised and run.values.get(summarised[sweep.metric]) is not None:
            row.objective = run.values[summarised[sweep.metric]]
    rows[:] = _ranked(rows, sweep)
    header, cells = results_table(rows, sweep)
    paths = {"csv": out / "results.csv", "md": out / "results.md"}
    with paths["csv"].open("w", newline="") as f:
        csv.writer(f).writerows([header, *cells])
    paths["md"].write_text(compare.markdown(header, cells))
    trained = [r for r in runs if r.loss_curve]  # skipped trials have none
    if trained:
        # Named as in the table: by the space's values that differ between the trials shown.
        space = {r.run_name: r.params for r in rows}
        keys = [d.key for d in sweep.space]
        names = compare.run_labels([{k: space.get(r.name, {}).get(k) for k in keys} for r in trained], [r.name for r in trained])
        compare.plot(trained, out / "runs.png", names)
        paths["png"] = out / "runs.png"
    for path in paths.values():
        tracking.log_artifact(uri, parent_id, path, "results")
    return paths


def results_dir(sweep: Sweep, out_dir: str | Path | None = None) -> Path:
    """Where a sweep's results table and chart go: ``out_dir``, else ``sweeps/<name>``."""
    return Path(out_dir) if out_dir else Path("sweeps") / sweep.name


def _log_yaml(uri: str, run_id: str, name: str, data: dict[str, Any]) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / name
        path.write_text(yaml.safe_dump(data, sort_keys=False, allow_unicode=True))
        tracking.log_artifact(uri, run_id, path)
