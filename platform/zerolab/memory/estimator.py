"""The estimate: one job under one option, its device components and phases composed from
:mod:`~zerolab.memory.terms` and :mod:`~zerolab.memory.activations`, its host figures from
:mod:`~zerolab.memory.host`."""

from __future__ import annotations

import dataclasses
from typing import Any

from zerolab.batches import auto_max_seq_length
from zerolab.config import SFTConfig
from zerolab.memory.activations import (
    activations,
    attention_quadratic,
    backward_gradients,
    dora_transient,
    logits_and_loss,
    mlp_tile_forward,
    recomputed_layer,
    saved_per_layer,
)
from zerolab.memory.batch import BatchShape, ShardLengths
from zerolab.memory.calibration import DEFAULT_CALIBRATION, Calibration
from zerolab.memory.context import EstimateContext, ZeroKnobs
from zerolab.memory.host import host_components
from zerolab.memory.options import Estimate
from zerolab.memory.shapes import ModelShape, max_position_embeddings, parameter_inventory, target_projections
from zerolab.memory.terms import (
    cached_blocks,
    deepspeed_buffers,
    dequantized_transient,
    flat_gradient_copy,
    fp8_transient,
    fp8_weights,
    framework,
    gather_pending,
    gathered,
    gathered_at_start,
    gathered_most,
    gradient_norm_copy,
    gradients,
    int8_product_transient,
    master_weights,
    offload_gradient_buffer,
    optimizer_states,
    quantized_load,
    reserved_share,
    stream_pools,
    weights,
)
from zerolab.memory.units import GIB
from zerolab.zero import Option


def estimate(cfg: SFTConfig, model_config: Any, *, calibration: Calibration = DEFAULT_CALIBRATION,
             data: ShardLengths | None = None) -> Estimate:
    """Predict the memory of ``cfg`` on the model described by ``model_config`` (a transformers
    config, a dict of its fields, or a :class:`ModelShape`).

    With ``data`` (the token lengths of the job's shards, for ``cfg``'s world size) every term
    that depends on tokens or sequence length takes the largest micro-batch the workers will
    really run (:meth:`ShardLengths.batch_shape`) and the shards' real tokens; without it, or
    when ``cfg`` has another world size than ``data`` was split for, the worst case by config:
    ``micro_batch_size`` × ``data.max_seq_length`` tokens (:meth:`BatchShape.from_config`).
    ``data.max_seq_length: auto`` is resolved from ``data`` (without it: MemoryEstimateError).
    Raises ConfigError when the DeepSpeed JSON does not resolve and MemoryEstimateError for
    unsupported models.
    """
    shape = model_config if isinstance(model_config, ModelShape) else ModelShape.from_config(model_config)
    if cfg.data.max_seq_length == "auto" and data is not None and data.longest_row:
        # As zerolab.data.resolve_max_seq_length does on the driver (jobs resolve it there: the
        # shards here miss the rows that equal train shards drop).
        length = auto_max_seq_length(data.longest_row, max_position_embeddings(model_config, cfg.model))
        cfg = cfg.replace(data=dataclasses.replace(cfg.data, max_seq_length=length))
    knobs = ZeroKnobs.resolve(cfg, shape)
    option = Option.of(cfg)
    inventory = parameter_inventory(shape, cfg.adapter)
    _, unknown = target_projections(cfg.adapter)
    notes = []
    if unknown:
        notes.append(f"adapter.target_modules {unknown} are not projections this estimator knows; they were left out")
    if shape.model_type not in ("qwen2", "llama", "mistral"):
        notes.append(f"model_type {shape.model_type!r} estimated as a Llama/Qwen2-style decoder")
    batch = data.batch_shape(cfg) if data is not None and data.world_size == cfg.data_parallel_size() else BatchShape.from_config(cfg)
    return build_estimate(EstimateContext(cfg, shape, inventory, knobs, option, calibration, tuple(notes), batch))


def device_components(job: EstimateContext) -> tuple[dict[str, int], dict[str, int]]:
    """Components and phases. Persistent = weights + master + optimizer states + the offload
    gradient buffer + framework.
    Forward/backward = persistent + gathered + saved activations + max(loss region, recomputed
    layer + the gradients of a layer's backward (with the tiled MLP, its tile's or attention's) + logits, DoRA transient) (+ gradients held across accumulation steps, and ZeRO-3's
    gradient partition buffer, allocated at init). Optimizer
    step = persistent + gradients + DeepSpeed buffers + the last logits (``out`` still holds
    them). ZeRO-0's gradient all-reduce = persistent + gradients + their flat bucket, min(T, 5e8)·e
    (any world size) + the last logits. ZeRO 1-2's gradient norm where DeepSpeed takes it (offload,
    or not bf16) = persistent + gradients (offload: the one gradient going to the host) + its
    float64 copy (``gradient_norm_copy``) + the last logits. Init (ZeRO 1-2 flatten the trainable parameters into a new buffer) = persistent
    without optimizer states + T·e. ZeRO-3 forward start = persistent + held gradients + the
    parameters gathered then (``gathered_at_start``) + the embeddings' output and the first
    layer's activations, B·S·(e·h + the per-layer bytes), and with the tiled MLP one tile's forward.
    ZeRO-3 with a quantized base: its load, the base whole before ``deepspeed.initialize``
    partitions it (:func:`quantized_load`)."""
    # ``out.logits`` lives until the next forward (the fused loss returns none).
    logits = 0 if job.fused_loss else job.e * job.shape.vocab_size * job.tokens
    saved, recompute, grads_in_flight = activations(job), recomputed_layer(job), backward_gradients(job)
    c = {
        "weights": weights(job) + fp8_weights(job),
        # The most gathered at once, at any moment of the step.
        "gathered parameters": gathered_most(job),
        "gradients": gradients(job),
        "master weights": master_weights(job),
        "optimizer states": optimizer_states(job),
        "activations": saved + recompute,
        "logits and loss": max(logits_and_loss(job), dora_transient(job)),
        "deepspeed buffers": deepspeed_buffers(job),
        "offload gradient buffer": offload_gradient_buffer(job),
        "framework": framework(job),
    }
    persistent = c["weights"] + c["master weights"] + c["optimizer states"] + c["offload gradient buffer"] + c["framework"]
    held_grads = c["gradients"] if job.stage == 3 or job.cfg.train.grad_accum_steps > 1 else 0
    # The loss region comes at the end of the forward pass; a layer's backward (with checkpointing,
    # its recomputed forward first) and DoRA's weight-norm temporaries come while every saved
    # activation is alive, but not with it.
    # A quantized base's dequantized weight lives only within its layer's product (the backward's), as
    # FP8's input copy; LLM.int8()'s working tensors only within the forward's.
    transient = fp8_transient(job) + max(dequantized_transient(job), int8_product_transient(job))
    # DoRA's weight-norm temporaries come inside a layer's forward, beside that layer's activations
    # so far (7B, one H100: the down projection's in² identity and in·out copies on top of the
    # gate and up projections' outputs; lease h100-83).
    dora = dora_transient(job)
    peak_activity = max(logits_and_loss(job), recompute + grads_in_flight + logits + transient, dora + recompute if dora else 0)
    phases = {
        "init": persistent - c["optimizer states"] + (job.T * job.e if job.stage in (1, 2) else 0),
        "forward/backward": persistent + held_grads + gathered(job) + saved + peak_activity,
        "optimizer step": persistent + c["gradients"] + c["deepspeed buffers"] + logits,
    }
    if job.stage == 0:
        # After the backward DeepSpeed flattens the gradients into all-reduce buckets of up to
        # 5e8 elements, on one GPU as well (engine.allreduce_bucket); the step's buffers come later.
        phases["gradient all-reduce"] = persistent + c["gradients"] + flat_gradient_copy(job) + logits
    norm = gradient_norm_copy(job)
    if norm:
        # DeepSpeed's own norm: one gradient slice's float64 copy beside the gradients (under
        # optimizer offload, beside the one on its way to the host).
        held = c["gradients"] if not job.offload_opt else job.largest_trainable() * job.e
        phases["gradient norm"] = persistent + held + norm + logits
    if job.gathers():
        first_layer = job.tokens * (job.e * job.shape.hidden_size + saved_per_layer(job)) + mlp_tile_forward(job)
        phases["forward start"] = persistent + held_grads + gathered_at_start(job) + first_layer
    if quantized_load(job):
        # Loaded whole before anything is partitioned: the peak with many ranks or short rows.
        phases["quantized load"] = c["framework"] + quantized_load(job)
    return c, phases


def build_estimate(job: EstimateContext) -> Estimate:
    """The :class:`Estimate` of ``job``: device components and phases, what sits outside the allocator, host figures."""
    components, phases = device_components(job)
    outside = {}
    if job.gpu:
        outside["CUDA context"] = job.cal.cuda_context_bytes
        if job.n > 1:
            outside["NCCL"] = job.cal.nccl_bytes
    host_worker, host_phases, host_other, host_node = host_components(job, max(phases.values()))
    quadratic = attention_quadratic(job)
    if quadratic > 0.05 * max(phases.values()):
        job.notes.append(f"{job.attn} attention at {job.seq_len:,}-token rows holds {quadratic / GIB:.1f} GiB that grows with the square "
                         f"of the row (its S×S mask and scores); model.attn_implementation=varlen (packed rows, on GPUs) or "
                         f"flash_attention_2 keeps attention memory linear in the row's length")
    if job.stage == 3 and job.n == 1 and not job.offload_param:
        job.notes.append("ZeRO-3 on one GPU partitions nothing: it holds what ZeRO-0 holds, every parameter kept gathered, "
                         "and adds DeepSpeed's per-module hooks (ZeRO-2 is faster there)")
    pools = stream_pools(job, phases)
    if job.stage == 3 and pools and sum(pools.values()) > max(phases.values()) * job.cal.reserved_factor_zero3:
        job.notes.append(f"ZeRO-3: reserved counts the gathered weights' own allocator pool ({pools['all-gather stream'] / GIB:.1f} GiB, "
                         f"with {gather_pending(job) / GIB:.1f} GiB of layers released but still queued on the GPU) beside "
                         f"the main stream's ({pools['main stream'] / GIB:.1f} GiB); within -3.2% .. +5.2% of the reserved memory measured "
                         f"on two H200s and two H100s (docs/memory.md)")
    return Estimate(
        option=job.option, shape=job.shape, world_size=job.n, use_gpu=job.gpu, precision=job.cfg.precision(),
        micro_batch_size=job.batch.micro_batch.rows, seq_len=job.seq_len,
        gradient_checkpointing=job.cfg.model.gradient_checkpointing, total_params=job.P - sum(
            p.total for p in job.inv if p.adapter and not p.trainable), trainable_params=job.T,
        device=components, device_phases=phases, device_outside_allocator=outside,
        device_cached=cached_blocks(job) if job.gpu else {}, reserved_share=reserved_share(job), device_stream_pools=pools,
        host_worker=host_worker,
        host_worker_phases=host_phases, host_other_worker_phases=host_other, host_node=host_node, calibration=job.cal, notes=tuple(job.notes),
        batch=job.batch,
    )
