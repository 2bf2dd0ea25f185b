"""Formatting: the component × option table that ``jobs/estimate.py`` prints."""

from __future__ import annotations

from zerolab.memory.limits import Limits
from zerolab.memory.options import Estimate, PlanRow
from zerolab.memory.units import GIB


def format_table(rows: list[PlanRow], limits: Limits) -> str:
    """The component × option table (GiB) with totals and verdicts, as plain text."""
    shown = [r for r in rows if r.estimate is not None]
    if not shown:
        return "no option is allowed for this config"
    first = shown[0].estimate
    assert first is not None
    device_rows = list(first.device) + ["peak allocated", "peak reserved", *first.device_outside_allocator, "GPU total"]
    host_rows = [k for k in first.host_worker] + ["workers on the node", *first.host_node, "host total per node"]
    header = ["", *[r.option.label.replace(" + offload ", " +off ") for r in shown]]
    lines: list[list[str]] = []

    def value(est: Estimate, key: str, section: str) -> str:
        n = est.workers_per_node(limits)
        if section == "device":
            table = {**est.device, **est.device_outside_allocator, "peak allocated": est.device_peak,
                     "peak reserved": est.device_reserved, "GPU total": est.device_total}
        else:
            table = {**est.host_worker, **est.host_node, "workers on the node": est.host_workers(n), "host total per node": est.host_total(n)}
        return f"{table.get(key, 0) / GIB:.2f}"

    label = "per GPU (GiB)" if first.use_gpu else "per CPU worker, in host RAM (GiB)"
    lines.append([label, *[""] * len(shown)])
    for key in device_rows:
        if not first.use_gpu and key in ("peak reserved", "GPU total"):
            continue
        lines.append([f"  {key}", *[value(r.estimate, key, "device") for r in shown if r.estimate]])
    lines.append(["peak phase", *[r.estimate.device_peak_phase for r in shown if r.estimate]])
    lines.append(["per worker process / node (GiB)", *[""] * len(shown)])
    for key in host_rows:
        lines.append([f"  {key}", *[value(r.estimate, key, "host") for r in shown if r.estimate]])
    lines.append(["verdict", *[r.fit.verdict if r.fit else "" for r in shown]])
    widths = [max(len(row[i]) for row in [header, *lines]) for i in range(len(header))]
    out = ["  ".join(cell.ljust(widths[i]) if i == 0 else cell.rjust(widths[i]) for i, cell in enumerate(row)) for row in [header, *lines]]
    invalid = [f"{r.option.label}: not allowed ({r.invalid})" for r in rows if r.estimate is None]
    return "\n".join(out + invalid)
