"""Formatting: the component × option table and the longest-row report that ``jobs/estimate.py`` prints."""

from __future__ import annotations

from zerolab.memory.limits import Limits
from zerolab.memory.options import Estimate, PlanRow
from zerolab.memory.planner import LongerRow
from zerolab.memory.units import GIB
from zerolab.zero import Option


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


SEQUENCE_PARALLEL_NOTE = ("more GPUs: ZeRO partitions weights, gradients and optimizer states, but each GPU still holds "
                          "the activations of a whole row; only splitting each row's tokens over the GPUs "
                          "(sequence parallelism: scaling.sequence_parallel_size) makes a row longer than one GPU holds")


def format_longest_row(tokens: int | None, option: Option, *, multiple: int, max_positions: int | None = None,
                       longer: list[LongerRow] | None = None, rope_fix: tuple[str, ...] = (), split: int = 1) -> str:
    """The longest-row report: the longest ``data.max_seq_length`` that fits under ``option``
    (:func:`~zerolab.memory.planner.longest_row`), whether it passes the positions the model reaches
    (``max_positions``; ``rope_fix``: the overrides of a RoPE scaling that reaches it), and with
    ``longer`` the settings that make a longer one fit (``split``: the job's ``scaling.sequence_parallel_size``)."""
    if tokens is None:
        lines = [f"longest row with {option.label}: none fits, not even {multiple:,} tokens at micro-batch 1"]
    else:
        lines = [f"longest row with {option.label}: {tokens:,} tokens at micro-batch 1, packed (--set data.max_seq_length={tokens}; "
                 f"the longest multiple of {multiple:,} that fits outside the estimate's 10% margin)"]
        if max_positions is not None and tokens > max_positions:
            fix = f" (--set {' --set '.join(rope_fix)})" if rope_fix else ""
            lines.append(f"  that is past the {max_positions:,} positions the model reaches: rows longer than that need RoPE "
                         f"scaling to keep positions right{fix}")
    if longer is not None:
        lines.append("longer rows:" if longer else "longer rows: every setting that shortens a row's cost is on already")
        for row in longer:
            figure = "none fits" if row.tokens is None else f"{row.tokens:,} tokens"
            gain = f" ({row.tokens / tokens:.1f}×)" if row.tokens and tokens else ""
            lines.append(f"  with {row.what}: {figure}{gain} (--set {' --set '.join(row.overrides)})")
        lines.append(f"  {SEQUENCE_PARALLEL_NOTE}" if split == 1 else
                     f"  more GPUs: each row is split over {split} GPUs already (scaling.sequence_parallel_size); a larger split, "
                     "as far as the model's attention heads allow, holds a longer row")
    return "\n".join(lines)
