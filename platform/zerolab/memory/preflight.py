"""Preflight: refuse a job that cannot fit the machine it would run on, naming the estimate, the
limit and the options that would fit."""

from __future__ import annotations

from typing import Any

from zerolab.config import SFTConfig
from zerolab.errors import UserError
from zerolab.memory.batch import ShardLengths
from zerolab.memory.calibration import DEFAULT_CALIBRATION, Calibration
from zerolab.memory.errors import MemoryEstimateError
from zerolab.memory.estimator import estimate
from zerolab.memory.limits import Limits
from zerolab.memory.options import RELATIVE_STEP_TIME, Estimate, Fit, PlanRow
from zerolab.memory.planner import plan_options, recommend, worst_case_by_config
from zerolab.memory.units import format_count


class MemoryPreflightError(UserError, MemoryEstimateError):
    """The job cannot fit the memory it would run on. ``estimate``, ``limits``, ``fit`` and
    ``fitting`` (the options that would fit, fastest first) are kept for callers."""

    remedies = ("force",)

    def __init__(self, message: str, *, estimate: Estimate, limits: Limits, fit: Fit, fitting: list[PlanRow]) -> None:
        super().__init__(message)
        self.estimate, self.limits, self.fit, self.fitting = estimate, limits, fit, fitting


def preflight(cfg: SFTConfig, model_config: Any, limits: Limits | None = None, *,
              calibration: Calibration = DEFAULT_CALIBRATION, data: ShardLengths | None = None) -> Estimate:
    """Estimate ``cfg`` and check it against ``limits`` (default: this machine, :meth:`Limits.detect`).
    With ``data`` (the job's shards) the check uses the data-aware estimate, so a job that fits by
    its real micro-batches is not refused by the worst case the config allows. Returns the
    estimate when it fits (or when a limit is unknown); raises :class:`MemoryPreflightError` naming
    the estimate (and the worst case by config next to it), the limit and the options that would fit."""
    limits = limits if limits is not None else Limits.detect()
    est = estimate(cfg, model_config, calibration=calibration, data=data)
    fit = est.fits(limits)
    if fit.fits:
        return est
    rows = plan_options(cfg, model_config, limits, calibration=calibration, data=data)
    fitting = sorted((r for r in rows if r.fit is not None and r.fit.fits),
                     key=lambda r: RELATIVE_STEP_TIME[(r.option.stage, r.option.offload)])
    problems = "; ".join(r.replace(" — too much", "") for r in fit.reasons if "too much" in r or r.startswith("GPUs:"))
    lines = [
        f"memory preflight: {est.option.label} on {limits.describe()} does not fit: {problems}.",
        f"  estimate: {est.summary(limits)}; {est.shape.describe()}; {format_count(est.trainable_params)} trainable "
        f"({est.precision}), {est.batch.describe() if est.batch else ''}, world size {est.world_size}"
        f"{', gradient checkpointing' if est.gradient_checkpointing else ''}.",
    ]
    by_config = worst_case_by_config(cfg, model_config, est, limits, calibration=calibration)
    if by_config:
        lines.append(f"  {by_config}.")
    if fitting:
        lines.append("  options that fit (fastest first): " + "; ".join(
            f"{' '.join(r.option.overrides())} → {r.estimate.summary(limits)}" for r in fitting if r.estimate))
    else:
        rec = recommend(cfg, model_config, limits, rows=rows, calibration=calibration, data=data)
        if rec is not None:
            lines.append(f"  no stage or offload option fits as configured; this would: {' '.join(rec.overrides)} "
                         f"{' '.join(rec.option.overrides())} ({rec.reason})")
        else:
            lines.append("  nothing fits this machine, not even micro-batch 1 with gradient checkpointing: use more or larger GPUs, "
                         "shorten data.max_seq_length, or train an adapter instead of the full model.")
    lines.append("  The table of every option: jobs/estimate.py with the same config.")
    raise MemoryPreflightError("\n".join(lines), estimate=est, limits=limits, fit=fit, fitting=fitting)
