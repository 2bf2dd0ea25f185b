"""The model and its DeepSpeed engine, as every worker builds them: the model with its adapter
(:func:`build_model`), then ``deepspeed.initialize`` with zerolab's optimizer and schedule
(:func:`initialize_engine`), and the changes zerolab makes to DeepSpeed's ZeRO optimizers and
ZeRO-3 modules on the way (each named for what it does, each checked by ``tests/test_train_step.py``).

The one piece of DeepSpeed state that outlives a call, transformers' ZeRO-3 loading switch, is held
by a :class:`Zero3Loading` the caller owns and closes."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from zerolab import adapters, kernels, long_rows, lora_nodes
from zerolab.config import SFTConfig
from zerolab.models import decoder_layers, load_model, load_model_config
from zerolab.sequence_parallel import UlyssesAttention
from zerolab.worker_log import log_rank0

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class Zero3Loading:
    """transformers' ZeRO-3 loading switch. While its ``HfDeepSpeedConfig`` lives, ``from_pretrained``
    partitions weights as they load (``deepspeed.zero.Init``), so no rank ever holds the whole model;
    transformers keeps only a weak reference to it, so this object holds it from :meth:`enable` until
    :meth:`close`."""

    def __init__(self) -> None:
        self.hf_config: Any = None

    def enable(self, ds_config: dict) -> None:
        from transformers.integrations import HfDeepSpeedConfig

        self.hf_config = HfDeepSpeedConfig(ds_config)

    def close(self) -> None:
        """Turn the switch off: a process that trains again (the job's own, a reused Tune actor) would
        otherwise load its next model partitioned, whatever its stage."""
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        self.hf_config = None
        unset_hf_deepspeed_config()


def build_model(cfg: SFTConfig, ds_config: dict, total_steps: int, *, zero3: Zero3Loading,
                ulysses: UlyssesAttention | None = None, device: torch.device | None = None) -> torch.nn.Module:
    """The model with its adapter. Under ZeRO 0-2 it goes to ``device`` (where
    ``deepspeed.initialize`` would move it) as it loads (``zerolab.models.load_model``), before peft
    wraps it: DoRA's set-up, which reads every wrapped weight to compute its norm, made the whole
    memory-mapped checkpoint resident on the host (7B: 14.4 GiB RSS per worker against LoRA's 6.2).

    Under ZeRO-3 it turns ``zero3`` on (the caller keeps it open while it trains, and closes it).
    A quantized base (``model.quantization``) loads through bitsandbytes (``zerolab.quantization``).

    Long rows (``zerolab.long_rows``): with ``model.tiled_mlp`` each decoder layer's MLP runs over
    sequence tiles, and with ``model.offload_checkpoints`` each layer's checkpoint goes to host memory.

    With ``scaling.sequence_parallel_size`` > 1 it turns ``ulysses`` on (the sequence-parallel
    groups and attention, ``zerolab.sequence_parallel``) before the model loads; the caller closes it."""
    if ulysses is not None and cfg.scaling.sequence_parallel_size > 1:
        ulysses.enable(cfg.scaling.sequence_parallel_size, kernels.resolve_attention(cfg.model.attn_implementation),
                       load_model_config(cfg.model), packing=cfg.data.packing, micro_batch_size=cfg.train.micro_batch_size)
    dtype = DTYPES[cfg.precision()]
    quantized = cfg.model.quantization != "none"
    if cfg.deepspeed.stage == 3 and not quantized:
        zero3.enable(ds_config)  # from_pretrained partitions the weights as they load
    # On CPU the model is where it loads. ZeRO-3 partitions the weights as they load, except a
    # quantized base's: transformers loads those whole, quantized on the device through a device
    # map, and ``deepspeed.initialize`` partitions them.
    on_device = device is not None and device.type != "cpu" and (cfg.deepspeed.stage < 3 or quantized)
    model = load_model(cfg.model, dtype, device if on_device else None)
    if cfg.deepspeed.stage == 3 and quantized:
        zero3.enable(ds_config)  # only now: transformers refuses a device map while it is on
    head_trains = not cfg.adapter.is_peft() or "lm_head" in cfg.adapter.target_modules
    fused_loss = kernels.use_fused_loss(cfg.model.kernels, use_gpu=cfg.scaling.use_gpu, head_trains=head_trains)
    if cfg.model.kernels != "none" and cfg.scaling.use_gpu:
        applied = kernels.apply_liger(model, fused_loss=fused_loss, layers=not cfg.model.compile)
        log_rank0("Liger kernels: %s", ", ".join(applied) or ("none (compiled layers)" if kernels.liger_available() else
                                                               "not available (liger_kernel not installed: pip install -e '.[gpu]')"))
    # Training needs no KV cache, and with one transformers ignores the per-sample position ids
    # of packed batches: packed samples would attend to each other.
    model.config.use_cache = False
    if cfg.model.gradient_checkpointing and cfg.adapter.is_peft():
        model.enable_input_require_grads()
    model = adapters.apply_adapter(model, cfg.adapter, total_steps)
    if cfg.model.kernels != "none":
        lora_nodes.fuse_lora(model)
        groups = 0 if cfg.model.compile else lora_nodes.fuse_shared_inputs(model)  # compiled layers take the plain products
        if groups:
            log_rank0("LoRA projections that share an input as one node: %d groups (Q/K/V, gate/up)", groups)
        mlps = lora_nodes.fuse_swiglu_down(model)
        if mlps:
            log_rank0("SwiGLU and down's LoRA as one node in %d MLPs (down's input recomputed in the backward)", mlps)
    if cfg.model.fp8:
        layers, reason = kernels.use_fp8(model, device, cfg.model.fp8_min_features)
        log_rank0("FP8 base products: %s", f"{layers} frozen linear layers" if layers else f"off, {reason}")
    if cfg.model.tiles_mlp():
        log_rank0("tiled MLP: %d decoder layers' MLPs over %s tiles of each micro-batch's tokens", long_rows.tile_mlps(model, cfg.model.tiled_mlp),
                  "hidden-size" if cfg.model.tiled_mlp == "auto" else cfg.model.tiled_mlp)
    if cfg.model.offload_checkpoints:
        offload = long_rows.offload_checkpoints(model)
        log_rank0("checkpoint offload: the inputs of %d of %d decoder layers go to host memory between the forward and "
                  "the backward pass", offload.num_layers - 1, offload.num_layers)
    if cfg.model.compile:
        log_rank0("torch.compile: %d decoder layers (the first steps compile)", kernels.compile_layers(decoder_layers(model)))
    return model


def initialize_engine(model: torch.nn.Module, cfg: SFTConfig, ds_config: dict, total_steps: int, *, mpu: Any = None) -> Any:
    """``deepspeed.initialize`` with zerolab's optimizer and schedule; ``mpu``: the sequence-parallel
    groups (``UlyssesAttention.mpu``), from which DeepSpeed reduces gradients over all ranks and
    averages them over the data-parallel ones.

    Under ZeRO-0 in bf16/fp16, DeepSpeed wraps the optimizer in its FP16 optimizer, which runs one
    step with zero gradients when it is built to create the optimizer state. AdamW counts that
    step, so its bias correction was one step off for the whole run (the first update 0.74× that
    of ZeRO 1-3, where no such step runs). The state is dropped here and the first real step
    creates it; a resumed run loads its own.

    Under ZeRO-3 with ``deepspeed.z3_leaf_layers`` the decoder layers become leaf modules first
    (:func:`make_zero3_leaf_layers`). A quantized base's layers keep nothing of their input or weight
    between their forward and backward, and under ZeRO-3 compute from the weights it gathers for
    them, keeping no whole copy beside the partitions
    (:func:`zerolab.quantized_products.keep_nothing_between_products`).
    """
    import deepspeed
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    zero3 = ds_config.get("zero_optimization", {}).get("stage") == 3
    if zero3 and cfg.deepspeed.z3_leaf_layers:
        layers = make_zero3_leaf_layers(model)
        log_rank0("ZeRO-3: %d decoder layers (%s) gathered as one leaf module each", len(layers),
                  type(layers[0]).__name__ if layers else "none found")
    if cfg.model.quantization != "none":
        from zerolab.quantized_products import keep_nothing_between_products  # bitsandbytes is an optional extra

        log_rank0("%d quantized layers keep nothing between their forward and backward%s", keep_nothing_between_products(model),
                  ", computing from their gathered weights" if zero3 else "")
    with _deepcompile_passes_left_out(ds_config):
        engine, _, _, _ = deepspeed.initialize(
            model=model,
            optimizer=build_optimizer(model, cfg),
            lr_scheduler=lambda optimizer: _build_scheduler(optimizer, cfg, total_steps),
            config=ds_config,
            mpu=mpu,
            dist_init_required=False,
        )
    if isinstance(engine.optimizer, (FP16_Optimizer, FP16_UnfusedOptimizer)):
        engine.optimizer.optimizer.state.clear()
    if batch_zero_step_checks(engine.optimizer) or batch_zero3_grad_norm(engine.optimizer):
        log_rank0("ZeRO-%d: the step's gradient checks in one multi-tensor norm", ds_config["zero_optimization"]["stage"])
    if zero3 and keep_one_rank_zero3_gathered(engine.optimizer):
        log_rank0("ZeRO-3 on one rank: every parameter stays gathered in its partition's memory, across the "
                  "optimizer step too (zerolab.ds_config.whole_partition_persists)")
    return engine


@contextlib.contextmanager
def _deepcompile_passes_left_out(ds_config: dict) -> Iterator[None]:
    """Build DeepSpeed's engine without registering DeepCompile's graph passes where the config
    leaves DeepCompile off (zerolab's configs always do).

    The engine registers them while it is built whenever torch could run DeepCompile, and
    registering imports DeepCompile's backend, which loads AOTAutograd and TorchInductor's lowering:
    0.9 s on the 2-core CPU machine, 2-3 s of ``deepspeed.initialize`` on an H100 host, before a
    first step that compiles nothing. Only ``engine.compile`` with DeepCompile on reads the passes."""
    if (ds_config.get("compile") or {}).get("deepcompile"):
        yield
        return
    import deepspeed.runtime.engine as ds_engine

    supported = ds_engine.is_deepcompile_supported
    ds_engine.is_deepcompile_supported = lambda: False
    try:
        yield
    finally:
        ds_engine.is_deepcompile_supported = supported


def batch_zero_step_checks(optimizer: Any) -> bool:
    """Under ZeRO-1/2 in bf16, let the gradient norm alone decide whether a step is skipped, and take
    it with one multi-tensor kernel; returns whether it applied.

    Before each step DeepSpeed's ZeRO-1/2 optimizer tests every gradient for inf/NaN (six kernels and
    an add each, then an all-reduce and a host synchronisation), then takes the norm of every gradient
    on its own in float64 (a copy and a reduction each): some 3,500 kernel launches per step for the
    392 adapter matrices of a 7B LoRA, which the GPU waits for, since the synchronisation emptied its
    queue. The norm already settles the first question: a non-finite gradient makes it non-finite,
    DeepSpeed masks that to its invalid-norm value and skips the step (``check_grad_overflow``, on by
    default in bf16), as its ZeRO-3 does without the per-gradient test. So the test is dropped and the
    norm becomes ``torch._foreach_norm`` over the step's gradients with float32 accumulation, their
    squares summed in float32 (DeepSpeed: float64 norms and sum, then float32; the two norms agree
    within 1e-3 in the test named below).

    Not applied where the norm does not decide (fp16's loss scaling, ``check_grad_overflow=false``,
    ``compute_grad_norm=false``) or is taken elsewhere (optimizer offload). Nothing else of the step
    changes; ``tests/test_train_step.py`` checks the step against DeepSpeed's own on CPU.
    """
    from deepspeed.runtime.utils import mask_nan_or_inf_with_val_inplace
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if (not isinstance(optimizer, DeepSpeedZeroOptimizer) or optimizer.dtype != torch.bfloat16 or optimizer.cpu_offload
            or not optimizer.compute_grad_norm or not optimizer.check_grad_overflow):
        return False

    def check_overflow(partition_gradients: bool = True) -> None:
        optimizer.overflow = False

    def get_grad_norm_direct(gradients: list, params: list, norm_type: float = 2) -> torch.Tensor:
        grads = [g for g in gradients if not getattr(g, "_zero_padding", False)]
        if float(norm_type) != 2.0 or not grads or optimizer.model_parallel_world_size > 1:
            return DeepSpeedZeroOptimizer.get_grad_norm_direct(optimizer, gradients, params, norm_type)
        total = _global_l2_norm(grads, optimizer.dp_process_group)
        mask_nan_or_inf_with_val_inplace(total, device=optimizer.device)
        return total

    optimizer.check_overflow = check_overflow
    optimizer.get_grad_norm_direct = get_grad_norm_direct
    return True


def _global_l2_norm(tensors: list[torch.Tensor], group: Any) -> torch.Tensor:
    """The L2 norm of this rank's ``tensors`` and every other rank's of ``group`` together: one
    multi-tensor kernel for the per-tensor norms (float32 accumulation), their squares summed and
    all-reduced."""
    total = torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32)).square().sum()
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return total.sqrt()


def batch_zero3_grad_norm(optimizer: Any) -> bool:
    """ZeRO-3's gradient norm in one multi-tensor kernel (bf16, optimizer on the GPU, no model or
    expert parallelism); returns whether it applied.

    DeepSpeed's ZeRO-3 optimizer takes the norm of each gradient partition on its own in float64 (a
    cast and a reduction each: ~800 launches per 7B LoRA step) before it sums them; here
    ``torch._foreach_norm`` in float32, as :func:`batch_zero_step_checks` does for ZeRO-1/2, with
    DeepSpeed's all-reduce over the partition group and its −1 for a non-finite norm (which skips
    the step). Anything else, and other norm types, take DeepSpeed's own method;
    ``tests/test_train_step.py`` checks the step against DeepSpeed's own on CPU."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    if (not isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3) or optimizer.dtype != torch.bfloat16 or optimizer.offload_optimizer
            or optimizer.model_parallel_group is not None):
        return False

    def get_grad_norm_direct(gradients: list, params: list, norm_type: float = 2) -> torch.Tensor:
        if float(norm_type) != 2.0 or not gradients or optimizer._autoep_expert_parallel_group(params) is not None:
            return DeepSpeedZeroOptimizer_Stage3.get_grad_norm_direct(optimizer, gradients, params, norm_type)
        total = _global_l2_norm(gradients, optimizer._get_param_partition_group(params[0]))
        return torch.where(total.isfinite(), total, torch.full_like(total, -1.0))

    optimizer.get_grad_norm_direct = get_grad_norm_direct
    return True


def keep_one_rank_zero3_gathered(optimizer: Any) -> bool:
    """Leave ZeRO-3's parameters gathered across the optimizer step where each already is its own
    partition: one rank whose every parameter persists (:func:`zerolab.ds_config.whole_partition_persists`);
    returns whether it applied.

    Before each step DeepSpeed's ZeRO-3 optimizer releases every parameter (``_partition_all_parameters``:
    the parameter's tensor swapped for an empty one, a stream recorded for each) and after it
    gathers the persistent ones again, which on one rank points each parameter back at its
    partition (``NoGatherHandle``): some 1,500 parameter swaps per 7B LoRA step, host time the GPU
    waits for, that end where they began. During the step, where every parameter is gathered and its
    tensor is its partition's memory, which the step updates in place, the release is skipped (the
    active-module marks it would clear are cleared), and the gather then finds nothing to do; should
    any parameter not be both, the step releases them as DeepSpeed does. Checkpoints are saved and
    loaded from released parameters, as DeepSpeed writes them: only the step skips."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    params = list(optimizer.module.parameters())
    if optimizer.partition_count != 1 or not all(p.ds_persist for p in params):
        return False
    step = optimizer.step

    def keep_gathered() -> None:
        if not all(p.ds_status == ZeroParamStatus.AVAILABLE and p.data.data_ptr() == p.ds_tensor.data_ptr()
                   for p in params):
            type(optimizer)._partition_all_parameters(optimizer)
            return
        for p in params:
            p.ds_active_sub_modules.clear()

    def step_keeping_gathered(*args: Any, **kwargs: Any) -> Any:
        optimizer._partition_all_parameters = keep_gathered
        try:
            return step(*args, **kwargs)
        finally:
            del optimizer._partition_all_parameters

    optimizer.step = step_keeping_gathered
    return True


def make_zero3_leaf_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Mark the model's decoder layers as ZeRO-3 leaf modules (before ``deepspeed.initialize``);
    returns them.

    DeepSpeed then hooks each layer instead of every module inside it: the layer's partitioned
    weights are gathered in one coalesced all-gather when the layer starts (forward, backward, and
    the recomputation under gradient checkpointing) and released after it, where per-module hooks
    gathered and released each weight on its own (a 7B LoRA step: ~800 all-gathers and the GPU idle
    a third of the step in the hooks). Trainable parameters of a leaf (adapters, or every weight in
    full fine-tuning) have their gradients reduced together by a full backward hook on the layer,
    which fires once the gradient of the layer's positional inputs is computed; when none of them
    requires a gradient, torch fires it at the gradient of the layer's *output*, before the layer's
    own backward has produced them. With frozen embeddings that is the first layer's input, so a
    pre-hook makes it require a gradient (the first layer then also computes its input gradient, as
    every other layer does); a training layer that gets no positional tensor input is an error.
    """
    from deepspeed.utils import set_z3_leaf_modules

    layers = decoder_layers(model)
    if not layers:
        return []
    set_z3_leaf_modules(model, [type(layers[0])])
    for layer in layers:
        if any(p.requires_grad for p in layer.parameters()):
            layer.register_forward_pre_hook(_input_requires_grad)
    return layers


def _input_requires_grad(layer: torch.nn.Module, args: tuple) -> None:
    if not torch.is_grad_enabled():
        return
    inputs = [a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
    if not inputs:
        raise RuntimeError(f"{type(layer).__name__} is called without a positional tensor input, so DeepSpeed's ZeRO-3 "
                           "leaf module could not reduce its gradients after its backward pass; set "
                           "deepspeed.z3_leaf_layers=false")
    if not any(a.requires_grad for a in inputs):
        inputs[0].requires_grad_(True)


def build_optimizer(model: torch.nn.Module, cfg: SFTConfig) -> torch.optim.Optimizer:
    """AdamW over trainable parameters; no weight decay on biases, norms and DoRA magnitudes (1-D).

    Torch's fused AdamW on GPU (no DeepSpeed JIT build on the critical path); DeepSpeedCPUAdam when
    optimizer states are offloaded, since DeepSpeed rejects other optimizers with offload.
    """
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.train.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if cfg.deepspeed.offload_optimizer:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, lr=cfg.train.lr, betas=(0.9, 0.999), adamw_mode=True)
    return torch.optim.AdamW(groups, lr=cfg.train.lr, betas=(0.9, 0.999), fused=cfg.scaling.use_gpu or None)


def _build_scheduler(optimizer: torch.optim.Optimizer, cfg: SFTConfig, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    warmup = int(cfg.train.warmup_ratio * total_steps)
    kind = cfg.train.lr_scheduler

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = (step - warmup) / max(1, total_steps - warmup)
        if kind == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
        if kind == "linear":
            return max(0.0, 1.0 - progress)
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)

