"""Planning: every ZeRO stage × offload option estimated and checked against the machine, the
fastest that fits recommended, the largest micro-batch that fits, and the longest row."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from zerolab.config import ConfigError, SFTConfig, validate
from zerolab.memory.batch import ShardLengths
from zerolab.memory.calibration import DEFAULT_CALIBRATION, Calibration
from zerolab.memory.estimator import estimate
from zerolab.memory.limits import Limits
from zerolab.memory.options import ALL_OPTIONS, RELATIVE_STEP_TIME, Estimate, PlanRow, Recommendation
from zerolab.memory.shapes import target_projections
from zerolab.zero import Option


def plan_options(cfg: SFTConfig, model_config: Any, limits: Limits | None = None, *,
                 options: Iterable[Option] = ALL_OPTIONS, calibration: Calibration = DEFAULT_CALIBRATION,
                 data: ShardLengths | None = None) -> list[PlanRow]:
    """Estimate ``cfg`` under each option (stage × offload), on ``data``'s shards when given (see
    :func:`estimate`); options the config's own validation rejects (e.g. AdaLoRA beyond ZeRO-0)
    come back with ``invalid`` set and no estimate."""
    limits = limits or Limits()
    base_problems = set(validate(cfg))
    options = list(options)
    if Option.of(cfg) not in options and options == list(ALL_OPTIONS):
        options.append(Option.of(cfg))  # the job's own option, e.g. ZeRO-3 offloading the optimizer alone
    rows = []
    for option in options:
        variant = option.apply(cfg)
        problems = [p for p in validate(variant) if p not in base_problems]
        if not problems:
            try:
                est = estimate(variant, model_config, calibration=calibration, data=data)
            except ConfigError as exc:  # e.g. no shipped DeepSpeed JSON offloads the optimizer alone under ZeRO-3
                problems = exc.problems
        if problems:
            rows.append(PlanRow(option, None, None, invalid=problems[0].split(";", 1)[0]))
            continue
        rows.append(PlanRow(option, est, est.fits(limits)))
    return rows


def recommend(cfg: SFTConfig, model_config: Any, limits: Limits | None = None, *,
              rows: list[PlanRow] | None = None, calibration: Calibration = DEFAULT_CALIBRATION,
              data: ShardLengths | None = None) -> Recommendation | None:
    """The fastest option that fits ``limits`` (ZeRO-2 when it fits; ZeRO-3 and offload only to
    fit), with the reason. When none fits, tries one worker per available GPU (if the job asks
    for more workers than there are GPUs), gradient checkpointing, then halving the micro-batch;
    returns None if even micro-batch 1 with checkpointing does not fit. ``data`` as in
    :func:`estimate` (a variant with fewer workers has other shards: it gets the worst case by config)."""
    limits = limits or Limits()
    rows = rows if rows is not None else plan_options(cfg, model_config, limits, calibration=calibration, data=data)
    best = _fastest_fitting(rows)
    if best is not None:
        return Recommendation(best.option, best.estimate, _reason(best, rows))  # type: ignore[arg-type]
    base, extra = cfg, ()
    gpus = (limits.gpus_per_node or 0) * limits.num_nodes
    if cfg.scaling.use_gpu and limits.gpus_per_node is not None and 0 < gpus < cfg.world_size():
        base = cfg.replace(scaling=dataclasses.replace(cfg.scaling, num_workers=gpus))
        extra = (f"scaling.num_workers={gpus}",)
    attempts: list[tuple[SFTConfig, tuple[str, ...]]] = [(base, extra)] if extra else []
    ckpt = base.replace(model=dataclasses.replace(base.model, gradient_checkpointing=True))
    if not cfg.model.gradient_checkpointing:
        attempts.append((ckpt, (*extra, "model.gradient_checkpointing=true")))
        extra = (*extra, "model.gradient_checkpointing=true")
    batch = cfg.train.micro_batch_size // 2
    while batch >= 1:
        attempts.append((ckpt.replace(train=dataclasses.replace(cfg.train, micro_batch_size=batch)),
                         (*extra, f"train.micro_batch_size={batch}")))
        batch //= 2
    for variant, changes in attempts:
        found = _fastest_fitting(plan_options(variant, model_config, limits, options=[r.option for r in rows],
                                              calibration=calibration, data=data))
        if found is not None:
            what = " and ".join(changes)
            reason = f"no option fits as configured; with {what} {found.option.label} fits ({_fit_figures(found)})"
            return Recommendation(found.option, found.estimate, reason, changes)  # type: ignore[arg-type]
    return None


def largest_micro_batch(cfg: SFTConfig, model_config: Any, limits: Limits, option: Option, *, limit: int = 512,
                        calibration: Calibration = DEFAULT_CALIBRATION, data: ShardLengths | None = None) -> int | None:
    """The largest ``train.micro_batch_size`` (at most ``limit``) with which ``cfg`` under ``option``
    fits ``limits`` outside the estimator's 10% margin (not :attr:`Fit.tight`); None if not even 1
    does. Most tokens per micro-batch is what ZeRO-3 needs most: its gathers cost per micro-batch,
    not per token. Memory grows with the micro-batch, so a doubling search, then bisection, finds it
    in O(log limit) estimates; on ``data`` each size plans the shards' micro-batches again."""
    def fits(batch: int) -> bool:
        variant = option.apply(cfg.replace(train=dataclasses.replace(cfg.train, micro_batch_size=batch)))
        fit = estimate(variant, model_config, calibration=calibration, data=data).fits(limits)
        return fit.fits and not fit.tight

    return _largest(fits, limit)


def _largest(fits: Callable[[int], bool], limit: int) -> int | None:
    """The largest n in 1..``limit`` with ``fits(n)``, for a ``fits`` true up to some n and false
    after it (memory grows with n): doubling from 1, then bisection, O(log limit) calls. None if
    not even 1 fits."""
    if not fits(1):
        return None
    good, bad = 1, None
    while bad is None and good < limit:
        trial = min(2 * good, limit)
        if fits(trial):
            good = trial
        else:
            bad = trial
    while bad is not None and bad - good > 1:
        middle = (good + bad) // 2
        good, bad = (middle, bad) if fits(middle) else (good, middle)
    return good


LONGEST_ROW_LIMIT = 1 << 22
"""The longest row :func:`longest_row` tries: 4M tokens, past ALST's 3.7M on eight GPUs."""


def long_row_config(cfg: SFTConfig, max_seq_length: int) -> SFTConfig:
    """``cfg`` taking rows of ``max_seq_length`` tokens one at a time: micro-batch 1, packed (so
    that the varlen kernel runs on the row's samples and a shorter row leaves room for more)."""
    return cfg.replace(train=dataclasses.replace(cfg.train, micro_batch_size=1),
                       data=dataclasses.replace(cfg.data, max_seq_length=max_seq_length, packing=True))


def longest_row(cfg: SFTConfig, model_config: Any, limits: Limits, option: Option, *, multiple: int = 1024,
                limit: int = LONGEST_ROW_LIMIT, calibration: Calibration = DEFAULT_CALIBRATION) -> int | None:
    """The longest ``data.max_seq_length``, a multiple of ``multiple`` up to ``limit``, with which
    ``cfg`` under ``option`` fits ``limits`` outside the estimator's 10% margin (not
    :attr:`Fit.tight`) at micro-batch 1 with packing (:func:`long_row_config`): the longest
    sample such a job can train. None if not even ``multiple`` tokens fit. Memory grows with the
    row, so powers of two from ``multiple``, then a bisection in steps of ``multiple``, find it
    in O(log(limit / multiple)) estimates. The worst case by config: every row that long."""
    def fits(steps: int) -> bool:
        fit = estimate(option.apply(long_row_config(cfg, steps * multiple)), model_config, calibration=calibration).fits(limits)
        return fit.fits and not fit.tight

    steps = _largest(fits, max(limit // multiple, 1))
    return None if steps is None else steps * multiple


@dataclass(frozen=True)
class LongerRow:
    """A change of settings and the longest row with it (:func:`longer_row_settings`)."""

    what: str
    overrides: tuple[str, ...]
    """The ``--set`` overrides that make it (beyond micro-batch 1 and packing)."""
    option: Option
    tokens: int | None
    """The longest row that fits with them (None: not even the shortest)."""


def longer_row_settings(cfg: SFTConfig, model_config: Any, limits: Limits, option: Option, *, multiple: int = 1024,
                        limit: int = LONGEST_ROW_LIMIT, calibration: Calibration = DEFAULT_CALIBRATION) -> list[LongerRow]:
    """Each setting that shortens what a row costs and that ``cfg`` does not use yet, with the
    longest row it allows (:func:`longest_row`), then all of them together: gradient
    checkpointing (each layer keeps only its input), checkpointing with those inputs offloaded to
    host memory (GPUs), the tiled MLP (no B·S × I tensor whole), those two together (ALST's
    single-GPU pair), Liger's fused loss (no B·S×V logits; GPUs,
    frozen head), varlen attention (no S×S mask; GPUs), a 4-bit base (adapters only), and ZeRO-3
    with parameter and optimizer offload (the weights leave the GPU between uses), and on a node of
    several GPUs, Ulysses sequence parallelism over them (each GPU holds 1/N of the row's tokens).
    Variants that the config's validation or the model's heads refuse are left out."""
    peft, gpu = cfg.adapter.is_peft(), cfg.scaling.use_gpu
    head_trains = not peft or "lm_head" in target_projections(cfg.adapter)[0]
    m = cfg.model
    levers: list[tuple[str, dict[str, Any]]] = []
    if not m.gradient_checkpointing:
        levers.append(("gradient checkpointing", {"gradient_checkpointing": True}))
    if gpu and not m.offload_checkpoints:
        levers.append(("checkpointing with the checkpoints offloaded to host memory",
                       {**({} if m.gradient_checkpointing else {"gradient_checkpointing": True}), "offload_checkpoints": True}))
    if not m.tiles_mlp() and not m.compile:
        levers.append(("the tiled MLP", {"tiled_mlp": "auto"}))
    if gpu and not head_trains and m.kernels != "liger":
        levers.append(("Liger's fused loss and kernels", {"kernels": "liger"}))
    if gpu and m.attn_implementation in ("sdpa", "eager"):
        levers.append(("varlen attention", {"attn_implementation": "varlen"}))
    if peft and m.quantization == "none" and not m.fp8:
        levers.append(("a 4-bit base", {"quantization": "nf4"}))
    alst = [changes for what, changes in levers if "offload_checkpoints" in changes or "tiled_mlp" in changes]
    if len(alst) == 2:  # ALST's single-GPU pair, without changing the model or the option
        levers.append(("the checkpoints offloaded and the tiled MLP together", {**alst[0], **alst[1]}))
    offload = Option(3, "all")
    variants = [(what, changes, {}, option) for what, changes in levers]
    if option != offload:
        variants.append((f"{offload.label} (the weights leave the GPU between uses)", {}, {}, offload))
    sp = _sequence_parallel_size(cfg, model_config, limits)
    if sp > 1:
        split = {"num_workers": max(sp, cfg.scaling.num_workers), "sequence_parallel_size": sp}
        variants.append((f"sequence parallelism over {sp} GPUs (each holds 1/{sp} of the row)", {}, split, option))
    if len(variants) > 1:
        variants.append(("all of these", {k: v for _, c, _, _ in variants for k, v in c.items()},
                         {k: v for _, _, s, _ in variants for k, v in s.items()}, offload))
    base_problems = set(validate(cfg))
    out = []
    for what, changes, scaling, opt in variants:
        variant = opt.apply(cfg.replace(model=dataclasses.replace(m, **changes), scaling=dataclasses.replace(cfg.scaling, **scaling)))
        if any(p not in base_problems for p in validate(long_row_config(variant, multiple))):
            continue
        overrides = tuple(f"model.{k}={str(v).lower()}" for k, v in changes.items()) + tuple(
            f"scaling.{k}={v}" for k, v in scaling.items()) + (tuple(opt.overrides()) if opt != option else ())
        out.append(LongerRow(what, overrides, opt, longest_row(variant, model_config, limits, opt, multiple=multiple, limit=limit,
                                                               calibration=calibration)))
    return out


def _sequence_parallel_size(cfg: SFTConfig, model_config: Any, limits: Limits) -> int:
    """The most GPUs of one node that Ulysses can split a row over for this model (1: none)."""
    gpus = limits.gpus_per_node or 0
    if not cfg.scaling.use_gpu or cfg.scaling.sequence_parallel_size > 1 or gpus < 2:
        return 1
    from zerolab.sequence_parallel import head_problems  # imports torch, which the estimator otherwise does not

    return max((n for n in range(2, gpus + 1) if gpus % n == 0 and not head_problems(n, model_config, "")), default=1)


def _fastest_fitting(rows: list[PlanRow]) -> PlanRow | None:
    fitting = [r for r in rows if r.fit is not None and r.fit.fits]
    if not fitting:
        return None
    return min(fitting, key=lambda r: (RELATIVE_STEP_TIME[(r.option.stage, r.option.offload)], r.estimate.device_total if r.estimate else 0))


def _fit_figures(row: PlanRow) -> str:
    est = row.estimate
    assert est is not None and row.fit is not None
    parts = [r for r in row.fit.reasons if "not checked" not in r]
    return "; ".join(parts) if parts else est.summary()


def _reason(best: PlanRow, rows: list[PlanRow]) -> str:
    faster = [r for r in rows if r.estimate is not None and RELATIVE_STEP_TIME[(r.option.stage, r.option.offload)]
              < RELATIVE_STEP_TIME[(best.option.stage, best.option.offload)]]
    if best.option == Option(2):
        why = ("the fastest option: no parameter gathering, no offload traffic, and a shorter step than ZeRO-0's "
               "(measured on one H100, docs/benchmark.md)")
    elif not faster:
        why = "the fastest option allowed for this config"
    else:
        blocked = ", ".join(f"{r.option.label} ({'not allowed' if r.fit is None else _over(r)})" for r in faster)
        why = f"the fastest option that fits; faster ones do not: {blocked}"
        if best.option.offload != "none":
            why += "; offload makes steps about 2-3× slower"
    return f"{best.option.label} fits ({_fit_figures(best)}) and is {why}"


def _over(row: PlanRow) -> str:
    assert row.fit is not None
    over = [r for r in row.fit.reasons if "too much" in r or r.startswith("GPUs:")]
    return "; ".join(r.replace(" — too much", "") for r in over) or row.fit.verdict


def worst_case_by_config(cfg: SFTConfig, model_config: Any, est: Estimate, limits: Limits | None = None, *,
                         calibration: Calibration = DEFAULT_CALIBRATION) -> str | None:
    """For a data-aware ``est``: the worst case the config allows, as one line, when its figures
    differ (None otherwise, and for ``data.max_seq_length: auto``, which only the data decides)."""
    if not est.data_aware or cfg.data.max_seq_length == "auto":
        return None
    worst = estimate(cfg, model_config, calibration=calibration)
    if worst.summary(limits) == est.summary(limits):
        return None
    assert worst.batch is not None
    return f"worst case by config ({worst.batch.describe().removesuffix(' (the worst case by config)')}): {worst.summary(limits)}"
