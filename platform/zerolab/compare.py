"""Compare runs without the UI: one row per MLflow run, named by the values that differ between the
runs, with its key params next to throughput, peak memory, utilisation, wall time (start-up and
training apart), final loss and eval metrics, written as CSV, Markdown and a PNG chart.

Works on a whole experiment or on the child runs of one parent run (a Tune sweep).
"""

from __future__ import annotations

import csv
import math
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zerolab import tracking
from zerolab.errors import UserError
from zerolab.zero import ZERO_KEYS, Option, label_of

KEY_PARAMS = ("adapter.method", "adapter.r", "deepspeed.stage", "deepspeed.offload_optimizer", "deepspeed.offload_param",
              "train.micro_batch_size", "train.grad_accum_steps", "derived.world_size", "train.lr")
"""Params shown for every run; any other config param that differs between the runs is added."""
CONFIG_SECTIONS = ("model.", "adapter.", "data.", "train.", "deepspeed.", "scaling.")
NOISY_PARAMS = ("data.train.", "data.eval.", "data.seed", "data.train_path", "data.eval_path")
"""Per-run facts (fingerprints, counts, paths) that differ without being a choice worth a column."""


STAGE_KEYS = ("deepspeed.zero", "deepspeed.stage", "deepspeed.offload_optimizer", "deepspeed.offload_param")
"""Params that together say one thing, the ZeRO stage and what it offloads: one part of a run's label."""
SHORT_NAMES = {"adapter.method": "", "adapter.r": "r", "adapter.alpha": "alpha", "train.micro_batch_size": "micro-batch",
               "train.grad_accum_steps": "grad-accum", "derived.world_size": "workers", "scaling.num_workers": "workers"}
"""How a label names a param (empty: the value alone, e.g. ``dora``); others by their last dotted part."""


def stage_label(params: dict[str, Any]) -> str:
    """``ZeRO-3 + offload`` (optimizer and parameters), ``ZeRO-2 + optimizer offload``, ``ZeRO-0``: from
    ``deepspeed.zero`` (a sweep's stage+offload key, e.g. ``3+all``) or the stage and offload params."""
    zero = params.get("deepspeed.zero")
    if zero is not None and str(zero) in ZERO_KEYS:
        return Option.parse(zero).label
    optimizer, param = (str(params.get(k, "")).lower() in ("true", "1") for k in STAGE_KEYS[2:])
    return label_of(params.get("deepspeed.stage", "?"), optimizer, param)


def _value_text(value: Any) -> str:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return str(value)
    return f"{number:g}" if not str(value).lstrip("-").isdigit() else str(value)


def varying_keys(params: list[dict[str, Any]]) -> list[str]:
    """The config keys whose values differ between these runs (a key some runs lack counts), in
    the order of ``KEY_PARAMS`` then alphabetical."""
    keys = {k for p in params for k in p
            if (k.startswith(CONFIG_SECTIONS) or k in KEY_PARAMS or k in STAGE_KEYS) and not k.startswith(NOISY_PARAMS)
            and len({str(x.get(k)) for x in params}) > 1}
    return [k for k in KEY_PARAMS if k in keys] + sorted(keys - set(KEY_PARAMS))


def run_labels(params: list[dict[str, Any]], names: list[str]) -> list[str]:
    """One label per run from the values that differ between them, e.g. ``ZeRO-3 + offload, r=16``:
    the stage and offload as one part, then each other varying key as ``name=value``. Runs that
    nothing tells apart (or a single run) keep their name; labels that still collide get it added."""
    keys = varying_keys(params)
    if not keys:
        return list(names)
    stage = any(k in STAGE_KEYS for k in keys)
    labels = []
    for p in params:
        parts = [stage_label(p)] if stage else []
        for k in keys:
            if k in STAGE_KEYS:
                continue
            short = SHORT_NAMES.get(k, k.rsplit(".", 1)[-1])
            value = _value_text(p.get(k, "-"))
            parts.append(f"{short}={value}" if short else value)
        labels.append(", ".join(parts))
    return [f"{label} ({name})" if labels.count(label) > 1 else label for label, name in zip(labels, names)]


def labels(rows: list[RunRow]) -> list[str]:
    """``run_labels`` of these runs."""
    return run_labels([r.params for r in rows], [r.name for r in rows])


class CompareError(UserError, ValueError):
    """Nothing to compare: unknown experiment or parent run, or no runs in it."""


@dataclass
class RunRow:
    run_id: str
    name: str
    status: str
    params: dict[str, str]
    values: dict[str, float | None] = field(default_factory=dict)
    loss_curve: list[tuple[int, float]] = field(default_factory=list)
    start_unix: float | None = None
    end_unix: float | None = None


def _last(history: list[Any]) -> float | None:
    return max(history, key=lambda m: (m.step, m.timestamp)).value if history else None


def _peak(history: list[Any]) -> float | None:
    return max(m.value for m in history) if history else None


def _steady(history: list[Any]) -> float | None:
    """Median over logged windows after the first (which includes warm-up and compilation)."""
    values = [m.value for m in sorted(history, key=lambda m: m.step)]
    values = values[1:] if len(values) > 2 else values
    return statistics.median(values) if values else None


METRICS = {
    "tokens_per_s": ("perf/tokens_per_s", _steady),
    "step_s": ("perf/step_s", _steady),
    "mfu": ("perf/mfu", _steady),
    "gpu_peak_gib": ("mem/gpu_peak_allocated_gib", _peak),
    "gpu_reserved_gib": ("mem/gpu_peak_reserved_gib", _peak),
    "host_rss_gib": ("mem/host_rss_peak_gib", _peak),
    "train_loss": ("train/loss", _last),
    "eval_loss": ("eval/loss", _last),
}
"""Column -> (MLflow metric, how its history is summarised)."""
UTILISATION = {"cpu_util_pct": re.compile(r"system/.+/cpu_utilization_percentage"),
               "gpu_util_pct": re.compile(r"system/.+/gpu_\d+_utilization_percentage")}
"""Column -> the system metrics (every node, every GPU) whose samples it averages."""
TIMING = ("wall_s", "startup_s", "training_s")
"""The whole run (MLflow's start to end), its start-up (to the end of the first optimizer step:
Ray, data, model load, DeepSpeed) and its training (first step to last)."""


def timing(start_unix: float | None, end_unix: float | None, *, first_step_unix: float | None = None,
           training_s: float | None = None, first_log: tuple[float, int, float] | None = None,
           last_log_unix: float | None = None) -> dict[str, float | None]:
    """``wall_s``, ``startup_s`` and ``training_s`` of one run. The first step's time is the
    recorded ``perf/first_step_unix`` when there is one, else estimated from the first logged
    window ``first_log`` = (its time, its step, its seconds per step) as that time less the steps
    after the first at that pace; training is the recorded ``perf/wall_s``, else first step to the
    last logged window."""
    if not first_step_unix and first_log is not None:
        logged_unix, step, step_s = first_log
        first_step_unix = logged_unix - max(step - 1, 0) * step_s
    first_step_unix = first_step_unix or None
    wall = end_unix - start_unix if start_unix and end_unix else None
    startup = first_step_unix - start_unix if first_step_unix and start_unix else None
    if training_s is None and first_step_unix and last_log_unix:
        training_s = max(last_log_unix - first_step_unix, 0.0)
    return {"wall_s": wall if wall is not None else training_s, "startup_s": startup, "training_s": training_s}


def collect(uri: str, experiment: str, parent: str | None = None) -> list[RunRow]:
    """The runs of ``experiment`` (the children of ``parent``, a run id or run name, when given),
    oldest first."""
    client = tracking.mlflow_client(uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        known = ", ".join(sorted(e.name for e in client.search_experiments())) or "none"
        raise CompareError(f"no MLflow experiment named {experiment!r} at {tracking.mask_text(uri)} (experiments: {known})")
    filter_string = ""
    if parent:
        parent_id = _find_parent(client, uri, exp.experiment_id, parent)
        filter_string = f"tags.`mlflow.parentRunId` = '{parent_id}'"
    runs = client.search_runs([exp.experiment_id], filter_string=filter_string, order_by=["attributes.start_time ASC"],
                              max_results=5000)
    if parent is None:  # a sweep's parent run has no training metrics of its own
        runs = [r for r in runs if "zerolab.sweep" not in r.data.tags]
    if not runs:
        raise CompareError(f"no runs to compare in experiment {experiment!r}" + (f" under parent {parent!r}" if parent else ""))
    rows = []
    for run in runs:
        row = RunRow(run_id=run.info.run_id, name=run.info.run_name or run.info.run_id, status=run.info.status,
                     params=dict(run.data.params))
        for column, (key, summarise) in METRICS.items():
            row.values[column] = summarise(client.get_metric_history(run.info.run_id, key)) if key in run.data.metrics else None
        for key, value in sorted(run.data.metrics.items()):
            if key.startswith("eval/") and key != "eval/loss":
                row.values[key] = value
        for column, pattern in UTILISATION.items():
            keys = [k for k in run.data.metrics if pattern.fullmatch(k)]
            samples = [m.value for k in keys for m in client.get_metric_history(run.info.run_id, k)]
            row.values[column] = statistics.fmean(samples) if samples else None
        row.start_unix = run.info.start_time / 1000 if run.info.start_time else None
        row.end_unix = run.info.end_time / 1000 if run.info.end_time else None
        losses = sorted(client.get_metric_history(run.info.run_id, "train/loss"), key=lambda m: (m.step, m.timestamp)) \
            if "train/loss" in run.data.metrics else []
        row.loss_curve = [(m.step, m.value) for m in losses]
        first_log = None
        if losses and "perf/step_s" in run.data.metrics:
            step_s = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "perf/step_s")}
            if losses[0].step in step_s:
                first_log = (losses[0].timestamp / 1000, losses[0].step, step_s[losses[0].step])
        row.values.update(timing(row.start_unix, row.end_unix, first_step_unix=run.data.metrics.get("perf/first_step_unix"),
                                 training_s=run.data.metrics.get("perf/wall_s"), first_log=first_log,
                                 last_log_unix=losses[-1].timestamp / 1000 if losses else None))
        rows.append(row)
    return rows


def _find_parent(client: Any, uri: str, experiment_id: str, parent: str) -> str:
    runs = client.search_runs([experiment_id], filter_string=f"attributes.run_name = '{parent}'", max_results=1,
                              order_by=["attributes.start_time DESC"])
    if runs:
        return runs[0].info.run_id
    try:
        return tracking.get_run(uri, parent).info.run_id
    except tracking.NotInStore:
        raise CompareError(f"no parent run named or with id {parent!r} in this experiment") from None


def param_columns(rows: list[RunRow]) -> list[str]:
    varying = sorted({k for r in rows for k in r.params
                      if k.startswith(CONFIG_SECTIONS) and not k.startswith(NOISY_PARAMS) and k not in KEY_PARAMS
                      and len({x.params.get(k) for x in rows}) > 1})
    return [k for k in KEY_PARAMS if any(k in r.params for r in rows)] + varying


def columns(rows: list[RunRow]) -> tuple[list[str], list[str]]:
    """The param columns and the metric columns that any of the runs has."""
    metrics = [c for c in [*METRICS, *UTILISATION, *TIMING, *sorted({k for r in rows for k in r.values if k.startswith("eval/")})]
               if any(r.values.get(c) is not None for r in rows)]
    return param_columns(rows), metrics


def table(rows: list[RunRow]) -> tuple[list[str], list[list[str]]]:
    """Header and formatted cells: run (its label: what differs), status, params, metrics, and
    the MLflow run name."""
    params, metrics = columns(rows)
    header = ["run", "status", *params, *metrics, "mlflow_run"]
    cells = [[label, r.status, *(r.params.get(p, "") for p in params), *(format_value(r.values.get(m)) for m in metrics), r.name]
             for r, label in zip(rows, labels(rows))]
    return header, cells


def format_value(value: float | None) -> str:
    """A table cell: empty for a missing value, thousands separators from 100 up, else 4 significant digits."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.4g}"


def markdown(header: list[str], cells: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in cells]
    return "\n".join(lines) + "\n"


def text_table(header: list[str], cells: list[list[str]]) -> str:
    widths = [max(len(h), *(len(row[i]) for row in cells)) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def plot(rows: list[RunRow], path: Path, names: list[str] | None = None) -> Any:
    """The runs at a glance, each named by ``names`` (default: its label, what differs between
    them): loss curves; tokens/s; peak GPU and host memory; wall time split into start-up, training
    and the rest (saving, upload, evaluation); mean GPU and CPU utilisation. Returns the (closed)
    figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = names or labels(rows)
    y = list(range(len(rows)))
    height = 0.4
    fig = plt.figure(figsize=(18, 9.5))
    grid = fig.add_gridspec(2, 3)
    ax_loss, ax_tps = fig.add_subplot(grid[0, :2]), fig.add_subplot(grid[0, 2])
    ax_mem, ax_time, ax_util = (fig.add_subplot(grid[1, i]) for i in range(3))
    for r, name in zip(rows, names):
        if r.loss_curve:
            ax_loss.plot(*zip(*r.loss_curve), marker=".", label=name)
    ax_loss.set(title="train/loss", xlabel="step", ylabel="loss")
    if any(r.loss_curve for r in rows):
        ax_loss.legend(fontsize="small")

    def value(r: RunRow, key: str) -> float:
        return r.values.get(key) or 0.0

    ax_tps.barh(y, [value(r, "tokens_per_s") for r in rows], color="tab:green")
    ax_tps.set(title="non-padding tokens/s (median after warm-up)")
    ax_mem.barh([i - height / 2 for i in y], [value(r, "gpu_peak_gib") for r in rows], height, label="GPU peak allocated")
    ax_mem.barh([i + height / 2 for i in y], [value(r, "host_rss_gib") for r in rows], height, label="host RSS peak (workers)")
    ax_mem.set(title="peak memory (GiB)")
    startup = [value(r, "startup_s") for r in rows]
    training = [value(r, "training_s") for r in rows]
    rest = [max(value(r, "wall_s") - s - t, 0.0) for r, s, t in zip(rows, startup, training)]
    ax_time.barh(y, startup, label="start-up (to the first step)", color="tab:gray")
    ax_time.barh(y, training, left=startup, label="training", color="tab:blue")
    ax_time.barh(y, rest, left=[s + t for s, t in zip(startup, training)], label="saving, upload, eval", color="tab:olive")
    ax_time.set(title="wall time (s)")
    ax_util.barh([i - height / 2 for i in y], [value(r, "gpu_util_pct") for r in rows], height, label="GPU", color="tab:purple")
    ax_util.barh([i + height / 2 for i in y], [value(r, "cpu_util_pct") for r in rows], height, label="CPU", color="tab:orange")
    ax_util.set(title="mean utilisation (%)", xlim=(0, 100))
    for ax in (ax_tps, ax_mem, ax_time, ax_util):
        ax.set(yticks=y, yticklabels=names if ax in (ax_tps, ax_mem) else [""] * len(rows))
        ax.invert_yaxis()
    for ax in (ax_mem, ax_time, ax_util):
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return fig


def write(rows: list[RunRow], out: Path) -> dict[str, Path]:
    """``runs.csv``, ``runs.md`` and ``runs.png`` in ``out``; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    header, cells = table(rows)
    paths = {"csv": out / "runs.csv", "md": out / "runs.md", "png": out / "runs.png"}
    params, metrics = columns(rows)
    with paths["csv"].open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["run_id", "run", "mlflow_run", "status", *params, *metrics])
        w.writerows([r.run_id, label, r.name, r.status, *(r.params.get(p, "") for p in params),
                     *("" if r.values.get(m) is None else r.values[m] for m in metrics)] for r, label in zip(rows, labels(rows)))
    paths["md"].write_text(markdown(header, cells))
    plot(rows, paths["png"])
    return paths
