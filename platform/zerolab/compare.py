"""Compare runs without the UI: one row per MLflow run with its key params next to throughput,
peak memory, wall time, final loss and eval metrics, written as CSV, Markdown and a PNG chart.

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

KEY_PARAMS = ("adapter.method", "adapter.r", "deepspeed.stage", "deepspeed.offload_optimizer", "deepspeed.offload_param",
              "train.micro_batch_size", "train.grad_accum_steps", "derived.world_size", "train.lr")
"""Params shown for every run; any other config param that differs between the runs is added."""
CONFIG_SECTIONS = ("model.", "adapter.", "data.", "train.", "deepspeed.", "scaling.")
NOISY_PARAMS = ("data.train.", "data.eval.", "data.seed", "data.train_path", "data.eval_path")
"""Per-run facts (fingerprints, counts, paths) that differ without being a choice worth a column."""


class CompareError(ValueError):
    """Nothing to compare: unknown experiment or parent run, or no runs in it."""


@dataclass
class RunRow:
    run_id: str
    name: str
    status: str
    params: dict[str, str]
    values: dict[str, float | None] = field(default_factory=dict)
    loss_curve: list[tuple[int, float]] = field(default_factory=list)


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
        parent_id = _find_parent(client, exp.experiment_id, parent)
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
        wall = run.data.metrics.get("perf/wall_s")
        if wall is None and run.info.end_time:
            wall = (run.info.end_time - run.info.start_time) / 1000
        row.values["wall_s"] = wall
        if "train/loss" in run.data.metrics:
            row.loss_curve = [(m.step, m.value) for m in sorted(client.get_metric_history(run.info.run_id, "train/loss"),
                                                                key=lambda m: m.step)]
        rows.append(row)
    return rows


def _find_parent(client: Any, experiment_id: str, parent: str) -> str:
    runs = client.search_runs([experiment_id], filter_string=f"attributes.run_name = '{parent}'", max_results=1,
                              order_by=["attributes.start_time DESC"])
    if runs:
        return runs[0].info.run_id
    from mlflow.exceptions import MlflowException

    try:
        return client.get_run(parent).info.run_id
    except MlflowException:
        raise CompareError(f"no parent run named or with id {parent!r} in this experiment") from None


def param_columns(rows: list[RunRow]) -> list[str]:
    varying = sorted({k for r in rows for k in r.params
                      if k.startswith(CONFIG_SECTIONS) and not k.startswith(NOISY_PARAMS) and k not in KEY_PARAMS
                      and len({x.params.get(k) for x in rows}) > 1})
    return [k for k in KEY_PARAMS if any(k in r.params for r in rows)] + varying


def columns(rows: list[RunRow]) -> tuple[list[str], list[str]]:
    """The param columns and the metric columns that any of the runs has."""
    metrics = [c for c in [*METRICS, *UTILISATION, "wall_s", *sorted({k for r in rows for k in r.values if k.startswith("eval/")})]
               if any(r.values.get(c) is not None for r in rows)]
    return param_columns(rows), metrics


def table(rows: list[RunRow]) -> tuple[list[str], list[list[str]]]:
    """Header and formatted cells: run, status, params, metrics."""
    params, metrics = columns(rows)
    header = ["run", "status", *params, *metrics]
    cells = [[r.name, r.status, *(r.params.get(p, "") for p in params), *(format_value(r.values.get(m)) for m in metrics)]
             for r in rows]
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


def plot(rows: list[RunRow], path: Path) -> None:
    """Loss curves on the left; tokens/s and peak GPU/host memory per run on the right."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_tps, ax_mem) = plt.subplots(1, 3, figsize=(17, 5), gridspec_kw={"width_ratios": [2, 1, 1]})
    for r in rows:
        if r.loss_curve:
            ax_loss.plot(*zip(*r.loss_curve), marker=".", label=r.name)
    ax_loss.set(title="train/loss", xlabel="step", ylabel="loss")
    if any(r.loss_curve for r in rows):
        ax_loss.legend(fontsize="small")
    names = [r.name for r in rows]
    y = range(len(rows))
    ax_tps.barh(y, [r.values.get("tokens_per_s") or 0 for r in rows], color="tab:green")
    ax_tps.set(title="non-padding tokens/s", yticks=list(y), yticklabels=names)
    ax_tps.invert_yaxis()
    height = 0.4
    ax_mem.barh([i - height / 2 for i in y], [r.values.get("gpu_peak_gib") or 0 for r in rows], height, label="GPU peak allocated")
    ax_mem.barh([i + height / 2 for i in y], [r.values.get("host_rss_gib") or 0 for r in rows], height, label="host RSS peak (workers)")
    ax_mem.set(title="peak memory (GiB)", yticks=list(y), yticklabels=[""] * len(rows))
    ax_mem.invert_yaxis()
    ax_mem.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(rows: list[RunRow], out: Path) -> dict[str, Path]:
    """``runs.csv``, ``runs.md`` and ``runs.png`` in ``out``; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    header, cells = table(rows)
    paths = {"csv": out / "runs.csv", "md": out / "runs.md", "png": out / "runs.png"}
    params, metrics = columns(rows)
    with paths["csv"].open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["run_id", "run", "status", *params, *metrics])
        w.writerows([r.run_id, r.name, r.status, *(r.params.get(p, "") for p in params),
                     *("" if r.values.get(m) is None else r.values[m] for m in metrics)] for r in rows)
    paths["md"].write_text(markdown(header, cells))
    plot(rows, paths["png"])
    return paths
