"""DeepSpeed JSON resolution: the files hold topology and memory knobs, the job config owns the rest.

A file in ``ds_configs/`` writes ``"auto"`` for every value the job config owns (batch sizes,
clipping, precision) and for bucket sizes derived from the model's hidden size. :func:`resolve`
fills them in and reports every value that contradicts the job config, so the two never disagree
silently (accelerate's ``fill_match`` does the same for its DeepSpeed plugin).
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zerolab.config import ConfigError, SFTConfig

if TYPE_CHECKING:
    from zerolab.memory.shapes import ModelShape


def _ds_config_dir() -> Path:
    """The repository's ``ds_configs/`` folder (the package lives in ``platform/zerolab``); in a Ray
    worker, where both arrive as ``py_modules`` of the job, the copy on ``sys.path``."""
    beside = Path(__file__).resolve().parents[2] / "ds_configs"
    if beside.is_dir():
        return beside
    shipped = (Path(entry) / "ds_configs" for entry in sys.path if entry)
    return next((p for p in shipped if p.is_dir()), beside)


DS_CONFIG_DIR = _ds_config_dir()


def default_config_path(stage: int, offload: bool) -> Path:
    """``zero{stage}.json``, or ``zero{stage}_offload.json`` where that file exists and offload is on."""
    if offload and (DS_CONFIG_DIR / f"zero{stage}_offload.json").is_file():
        return DS_CONFIG_DIR / f"zero{stage}_offload.json"
    return DS_CONFIG_DIR / f"zero{stage}.json"


def config_path(cfg: SFTConfig) -> Path:
    ds = cfg.deepspeed
    if ds.config:
        return Path(ds.config).expanduser()
    return default_config_path(ds.stage, ds.offload_optimizer or ds.offload_param)


UNCAPPED = 2**62
"""``stage3_max_live_parameters`` for adapter training where the model's shape is unknown: more
elements than any model has."""

LIVE_LAYERS = 3
"""Decoder layers ZeRO-3 may hold gathered beside the embeddings and the head in adapter training."""


def live_parameter_cap(shape: ModelShape) -> int:
    """``stage3_max_live_parameters`` for adapter training: the embeddings and the output head (the
    head stays gathered for the fused loss) plus :data:`LIVE_LAYERS` decoder layers' projections, in
    elements of the bf16 shape (1.79e9 for Qwen2.5-7B). A quantized base stores fewer elements per
    weight, so the same cap holds proportionally more of its layers in the same bytes.

    DeepSpeed prefetches only up to the cap minus what is gathered. Hugging Face's 1e9 is less than
    a 7B model's embeddings, head and one layer together, so its prefetch fell apart into single
    weights (586 gathers per step on two GPUs, where leaf layers make ~60). Without a cap, the
    prefetch passes layers that are still gathered for free and marks them for their backward use,
    so every layer is gathered at the loss: ZeRO-3 then holds the whole frozen model on every GPU
    (docs/memory.md). This cap holds about the reuse distance's layers: on two H200s, 7B LoRA, one
    4k row per GPU, 28.5 GiB per GPU against 38.5 uncapped, and 1.10× the tokens/s (lease h200x4-64,
    docs/benchmark.md)."""
    layer = sum(fan_in * fan_out for fan_in, fan_out in shape.linear_shapes().values())
    outer = shape.vocab_size * shape.hidden_size * (1 if shape.tie_word_embeddings else 2)
    return outer + LIVE_LAYERS * layer


MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")
"""Config keys of mixture-of-experts models, whose layers the dense shape behind
:func:`live_parameter_cap` undercounts (a Mixtral layer alone is above the cap it would give)."""


def resolve(cfg: SFTConfig, model_config: Any, path: Path | None = None) -> dict[str, Any]:
    """The DeepSpeed config dict for this job from ``path`` (default: :func:`config_path`), every
    ``"auto"`` filled for the model of ``model_config`` (a transformers config, a dict of one, or a
    ``ModelShape``): bucket sizes from its hidden size and, for dense Llama/Qwen2-style decoders,
    its :func:`live_parameter_cap` (other models stay uncapped). Raises ConfigError on conflicts."""
    from zerolab.memory.errors import MemoryEstimateError
    from zerolab.memory.shapes import ModelShape

    path = path or config_path(cfg)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError([f"deepspeed.config: no such file '{path}'; give a DeepSpeed JSON path or leave it empty"]) from None
    except json.JSONDecodeError as exc:
        raise ConfigError([f"deepspeed.config: '{path}' is not valid JSON ({exc}); fix the file"]) from None
    get = model_config.get if isinstance(model_config, dict) else lambda k: getattr(model_config, k, None)
    cap: int | None = None
    if not any(get(k) for k in MOE_KEYS):
        try:
            cap = live_parameter_cap(model_config if isinstance(model_config, ModelShape) else ModelShape.from_config(model_config))
        except MemoryEstimateError:
            pass
    return fill(raw, cfg, get("hidden_size") or 1024, source=str(path), shipped=not cfg.deepspeed.config, live_parameters=cap)


def fill(raw: dict[str, Any], cfg: SFTConfig, hidden_size: int, *, source: str = "deepspeed.config",
         shipped: bool = False, live_parameters: int | None = None) -> dict[str, Any]:
    """Fill ``raw``'s "auto" values from the job config; list every contradiction. A ``shipped``
    file (one of ``ds_configs/``, chosen from the stage and offload flags) follows the flags where
    they turn an offload off, e.g. ZeRO-3 with only the optimizer offloaded."""
    out = copy.deepcopy(raw)
    problems: list[str] = []
    t, ds = cfg.train, cfg.deepspeed
    precision = cfg.precision()

    def match(keys: tuple[str, ...], value: Any, owner: str) -> None:
        node = out
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        current = node.get(keys[-1], "auto")
        if current == "auto":
            node[keys[-1]] = value
        elif current != value:
            problems.append(
                f"deepspeed.config: {source} sets {'.'.join(keys)}={current!r} but {owner} gives {value!r}; "
                f'write "auto" there (the job config owns this value) or change {owner.split(" ")[0]}'
            )

    for section in ("optimizer", "scheduler"):
        if section in out:
            problems.append(
                f"deepspeed.config: {source} has an '{section}' section, but zerolab builds the optimizer and "
                f"learning-rate schedule from train.*; remove the section"
            )

    # DeepSpeed's batch check counts data-parallel ranks: the workers over the sequence-parallel size.
    world = cfg.data_parallel_size()
    sp = cfg.scaling.sequence_parallel_size
    match(("train_micro_batch_size_per_gpu",), t.micro_batch_size, "train.micro_batch_size")
    match(("gradient_accumulation_steps",), t.grad_accum_steps, "train.grad_accum_steps")
    match(
        ("train_batch_size",),
        cfg.global_batch_size(),
        f"train.micro_batch_size × train.grad_accum_steps × scaling.num_workers = "
        f"{t.micro_batch_size} × {t.grad_accum_steps} × {world}" if sp == 1 else
        f"train.micro_batch_size × train.grad_accum_steps × scaling.num_workers / scaling.sequence_parallel_size = "
        f"{t.micro_batch_size} × {t.grad_accum_steps} × {cfg.world_size()} / {sp}",
    )
    if sp > 1 or out.get("sequence_parallel_size", 1) != 1:
        match(("sequence_parallel_size",), sp, "scaling.sequence_parallel_size")
    match(("gradient_clipping",), float(t.max_grad_norm), "train.max_grad_norm")
    match(("bf16", "enabled"), precision == "bf16", f"train.precision ({precision})")
    match(("fp16", "enabled"), precision == "fp16", f"train.precision ({precision})")

    zero = out.setdefault("zero_optimization", {})
    match(("zero_optimization", "stage"), ds.stage, "deepspeed.stage")
    for flag, section in ((ds.offload_optimizer, "offload_optimizer"), (ds.offload_param, "offload_param")):
        device = zero.get(section, {}).get("device", "none")
        if flag and device == "none":
            zero[section] = {"device": "cpu", "pin_memory": True}
        elif not flag and device != "none" and shipped:
            del zero[section]
        elif not flag and device != "none":
            problems.append(
                f"deepspeed.config: {source} offloads {section} to {device} but deepspeed.{section}=false; "
                f"set deepspeed.{section}=true or remove the section"
            )
    # DeepSpeed's and Hugging Face's defaults for bucket sizes scale with the hidden size. Adapter
    # training under ZeRO-3 gets three changes: every adapter matrix (at most r × 8h elements for
    # intermediate sizes up to 8h) stays whole on every rank, since gathering several hundred tiny
    # tensors per pass, one collective each, costs far more time than their memory; the frozen
    # weights are prefetched a whole decoder layer ahead (a Llama/Qwen2 layer is ~12-20 h²
    # elements), so the gathers overlap the previous layer's compute instead of waiting for it; and
    # the number of gathered elements is capped by the model's shape (live_parameter_cap).
    #
    # On a single rank whose parameters stay on its device, every parameter is persistent
    # (whole_partition_persists).
    h = hidden_size
    adapter = cfg.adapter.is_peft()
    derived = {
        "reduce_bucket_size": h * h,
        "stage3_prefetch_bucket_size": 20 * h * h if adapter else int(0.9 * h * h),
        "stage3_param_persistence_threshold": (UNCAPPED if whole_partition_persists(cfg, out)
                                               else max(10 * h, 8 * cfg.adapter.r * h + 1) if adapter else 10 * h),
        "stage3_max_live_parameters": (live_parameters or UNCAPPED) if adapter else int(1e9),
    }
    for key, value in derived.items():
        if zero.get(key) == "auto":
            zero[key] = value

    leftover = [k for k, v in _walk(out) if v == "auto"]
    for key in leftover:
        problems.append(f"deepspeed.config: {source} leaves {key}='auto', which zerolab does not fill; give a value")
    total = out["train_micro_batch_size_per_gpu"] * out["gradient_accumulation_steps"] * world
    if not problems and out["train_batch_size"] != total:
        problems.append(f"deepspeed.config: train_batch_size={out['train_batch_size']} must equal micro × grad_accum × data-parallel world = {total}")
    if problems:
        raise ConfigError(problems)
    return out


def whole_partition_persists(cfg: SFTConfig, ds_config: dict[str, Any]) -> bool:
    """Whether ZeRO-3 keeps every parameter gathered (``stage3_param_persistence_threshold`` uncapped):
    on one rank whose parameters stay on its device.

    A rank alone holds each parameter's whole partition, and gathering one on its device is no copy:
    DeepSpeed points the parameter at its partition (``NoGatherHandle``). What a gather and a release
    per decoder layer still cost there is host time: a stream synchronisation per gather, each
    weight's release, and the checks around them, ~1,800 calls a step for a 7B LoRA. Persistent
    parameters are never released between layers, in the same memory: the parameter and its
    partition are one tensor (and :func:`zerolab.engine.keep_one_rank_zero3_gathered` keeps them so
    across the optimizer step). On one H200 at one packed 4k row this took ZeRO-3 from 62-68% to
    80-86% of ZeRO-2's tokens/s (docs/benchmark.md). With ``offload_param`` persistence would keep on the
    device what the offload moves to the host, so it stays off there."""
    zero = ds_config.get("zero_optimization", {})
    return (zero.get("stage") == 3 and cfg.world_size() == 1
            and zero.get("offload_param", {}).get("device", "none") == "none")


def _walk(node: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(node, dict):
        items = []
        for k, v in node.items():
            items.extend(_walk(v, f"{prefix}{k}."))
        return items
    return [(prefix.rstrip("."), node)]
