"""What every term of the estimate reads: the job, the model's parameters, the DeepSpeed knobs
memory depends on, the option and the micro-batch, with the figures the formulas share.

Notation of the formulas: N world size, P all parameters, T trainable parameters, e bytes per
element of the training precision, B×S tokens per micro-batch (B rows padded to S), h hidden,
I intermediate, V vocabulary, L layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from zerolab import ds_config
from zerolab.config import SFTConfig
from zerolab.memory.batch import BatchShape
from zerolab.memory.calibration import Calibration
from zerolab.memory.shapes import PROJECTIONS, ModelShape, ParamSpec, target_projections
from zerolab.quantization import FOUR_BIT
from zerolab.zero import Option


@dataclass(frozen=True)
class ZeroKnobs:
    """The DeepSpeed JSON values memory depends on, with DeepSpeed's defaults where absent."""

    reduce_bucket_size: int
    overlap_comm: bool
    contiguous_gradients: bool
    prefetch_bucket_size: int
    persistence_threshold: int
    max_reuse_distance: int
    max_live_parameters: int
    pin_memory: bool
    memory_efficient_linear: bool

    @classmethod
    def resolve(cls, cfg: SFTConfig, shape: ModelShape) -> ZeroKnobs:
        zero = ds_config.resolve(cfg, shape).get("zero_optimization", {})
        stage3 = cfg.deepspeed.stage == 3
        offload = [zero.get(k) or {} for k in ("offload_optimizer", "offload_param")]
        return cls(
            reduce_bucket_size=int(zero.get("reduce_bucket_size", 5e8)),
            overlap_comm=bool(zero.get("overlap_comm", stage3)),
            contiguous_gradients=bool(zero.get("contiguous_gradients", True)),
            prefetch_bucket_size=int(zero.get("stage3_prefetch_bucket_size", 5e7)),
            persistence_threshold=int(zero.get("stage3_param_persistence_threshold", 1e5)),
            max_reuse_distance=int(zero.get("stage3_max_reuse_distance", 1e9)),
            max_live_parameters=int(zero.get("stage3_max_live_parameters", 1e9)),
            pin_memory=any(bool(o.get("pin_memory", False)) for o in offload if o.get("device", "none") != "none"),
            memory_efficient_linear=stage3 and bool(zero.get("memory_efficient_linear", True)),
        )


class EstimateContext:
    """One job under one option, as the formulas of :mod:`zerolab.memory.terms`,
    :mod:`zerolab.memory.activations` and :mod:`zerolab.memory.host` read it (``job`` there)."""

    def __init__(self, cfg: SFTConfig, shape: ModelShape, inventory: list[ParamSpec], knobs: ZeroKnobs, option: Option,
                 calibration: Calibration, notes: tuple[str, ...], batch: BatchShape | None = None) -> None:
        self.cfg, self.shape, self.inv, self.knobs, self.option, self.cal = cfg, shape, inventory, knobs, option, calibration
        self.notes = list(notes)
        self.n = cfg.world_size()
        self.gpu = cfg.scaling.use_gpu
        self.stage = option.stage
        self.offload_opt = option.offload != "none"
        self.offload_param = option.offload == "all"
        self.e = 4 if cfg.precision() == "fp32" else 2
        self.peft = cfg.adapter.is_peft()
        self.batch = batch or BatchShape.from_config(cfg)
        # Ulysses sequence parallelism: each rank of a group holds 1/sp of every row's tokens (inside
        # attention: the whole row for 1/sp of the heads, as many bytes).
        self.sp = max(1, cfg.scaling.sequence_parallel_size)
        self.tokens = math.ceil(self.batch.micro_batch.tokens / self.sp)
        self.seq_len = self.batch.micro_batch.seq_len
        # varlen attention runs on GPUs only; elsewhere the model loads with sdpa (zerolab.kernels).
        self.attn = "sdpa" if cfg.model.attn_implementation == "varlen" and not self.gpu else cfg.model.attn_implementation
        # zerolab.kernels imports torch, which importing the estimator does not.
        from zerolab.kernels import fp8_eligible, use_fused_loss, use_liger
        from zerolab.lora_nodes import fuses_swiglu_down

        head_trains = not self.peft or "lm_head" in target_projections(cfg.adapter)[0]
        self.liger = use_liger(cfg.model.kernels, use_gpu=self.gpu)
        # SiLU(gate)·up and down's LoRA as one node: down's input recomputed in the backward.
        self.swiglu_down = fuses_swiglu_down(cfg, self.stage, "down_proj" in target_projections(cfg.adapter)[0])
        # SwiGLU keeps only the gate and up outputs and writes their gradients in their place.
        self.swiglu_in_place = self.liger or self.swiglu_down
        self.fused_loss = use_fused_loss(cfg.model.kernels, use_gpu=self.gpu, head_trains=head_trains)
        # The projections that keep e4m3 copies (zerolab.kernels.fp8_layers).
        self.fp8_shapes = [(i, o) for i, o in shape.linear_shapes().values() if fp8_eligible(i, o, cfg.model.fp8_min_features)] \
            if cfg.model.fp8 and self.gpu and self.peft and self.stage < 3 else []
        # A quantized base (zerolab.quantization): its projections' weights are stored packed.
        self.quantization = cfg.model.quantization if self.peft else "none"
        self.P = sum(p.total for p in inventory)
        self.T = sum(p.total for p in inventory if p.trainable)

    def part(self, numel: int) -> int:
        """Elements of ``numel`` held by one rank under ZeRO partitioning (padded to a multiple of N)."""
        return math.ceil(numel / self.n)

    def quantized(self, p: ParamSpec) -> bool:
        """Whether ``p`` is stored quantized: a base projection's weight under ``model.quantization``
        (transformers quantizes every decoder linear layer, not the head or the embeddings)."""
        return (self.quantization != "none" and not p.adapter and p.module.startswith("layers.")
                and p.name.endswith(".weight") and p.module.removeprefix("layers.") in PROJECTIONS)

    def stored_bytes(self, p: ParamSpec) -> int:
        """Bytes of one of ``p``'s tensors as ZeRO partitions it: numel·e, or a quantized weight's
        packed bytes (4-bit: numel/2; int8: numel), without the constants kept beside it."""
        if self.quantized(p):
            return p.numel // 2 if self.quantization in FOUR_BIT else p.numel
        return p.numel * self.e

    def stored_numel(self, p: ParamSpec) -> int:
        """Elements of ``p``'s tensor as ZeRO counts them (4-bit weights: two per byte, packed into the training dtype)."""
        if not self.quantized(p):
            return p.numel
        return p.numel // (2 * self.e) if self.quantization in FOUR_BIT else p.numel

    def persistent(self, p: ParamSpec) -> bool:
        """ZeRO-3 keeps parameters below stage3_param_persistence_threshold whole on every rank."""
        return self.stored_numel(p) < self.knobs.persistence_threshold

    def largest_trainable(self) -> int:
        return max((p.numel for p in self.inv if p.trainable), default=0)

    def gathers(self) -> bool:
        """Whether ZeRO-3 gathers parameters into new buffers (not with N = 1 and no parameter offload)."""
        return self.stage == 3 and (self.n > 1 or self.offload_param)
