"""Activation terms: what the forward pass saves for the backward pass, the loss region and the
transients around them, for one micro-batch of B·S tokens."""

from __future__ import annotations

import math
from collections.abc import Sequence

from zerolab.memory.context import EstimateContext
from zerolab.memory.shapes import target_projections

MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def activation_bytes_per_layer(job: EstimateContext) -> int:
    """Bytes one decoder layer saves for backward, per token, without checkpointing or tiling: the
    rest of the layer (:func:`_attention_bytes`) and its MLP (:func:`_mlp_bytes`).

    Each term is a tensor autograd keeps (checked against ``saved_tensors_hooks``):
    RMSNorm ×2: its fp32 input copy and rsqrt, 4h + 4, plus the normalised input when the norm
    weight trains (e·h). Attention: RoPE'd q (e·q_dim); k and v as SDPA gets them — repeated to
    q_dim when a mask is passed (padded or packed batches), else kv_dim; SDPA's output (e·q_dim,
    shared with o_proj's input) and fp32 log-sum-exp (4·heads); the mask SDPA converts per
    layer (e·S) — or, for eager attention, the fp32 probabilities and their cast to e
    ((4 + e)·heads·S) and a copy of the output for o_proj. MLP: gate output, SiLU
    output, up output (3·e·I). Inputs of trained base projections (full fine-tuning: the
    normed input once for q/k/v, once for gate/up, down's input e·I). Adapters per wrapped
    projection (in, out), in the model's dtype like the adapters themselves: with dropout its
    output and mask (e·in + mask·in; the mask is a byte on GPU, e bytes on CPU), without
    dropout the input itself (shared), lora_A's output e·r, DoRA's base and LoRA results
    (2·e·out), and AdaLoRA's scaled product before its division by the rank (e·out; measured
    with a census probe, ``git show 4aa9d6f:bench/activation_census.py``). With Liger's kernels (``zerolab.kernels``) each RMSNorm keeps its
    input in e and the fp32 rsqrt (e·h + 4, also when its weight trains) and SwiGLU keeps the
    gate and up outputs only (2·e·I). Under ZeRO-3 with DeepSpeed's ``memory_efficient_linear``
    (its default) every projection keeps its input, frozen or not: e·h for q/k/v and for
    gate/up, e·I for down, where nothing else keeps them.
    """
    return _attention_bytes(job) + _mlp_bytes(job)


def _attention_bytes(job: EstimateContext) -> int:
    """What a layer keeps per token outside its MLP: its two norms, attention, q/k/v/o's inputs and adapters."""
    s, e = job.shape, job.e
    h, s_len = s.hidden_size, job.seq_len
    attn = job.attn
    # Flash kernels (flash_attention_2, varlen) take fewer K/V heads; so does SDPA without a mask
    # (varlen's unpacked batches), but transformers repeats K/V for SDPA with one.
    gqa_repeat = attn not in ("flash_attention_2", "varlen") and s.num_kv_heads != s.num_heads
    total = 2 * _norm_bytes(job, trains=not job.peft)
    kv = s.q_dim if gqa_repeat else s.kv_dim
    total += e * (s.q_dim + 2 * kv)
    if attn == "eager":
        # fp32 softmax probabilities and their cast to e; o_proj's input is a transposed copy.
        total += (4 + (e if e != 4 else 0)) * s.num_heads * s_len + e * s.q_dim * _input_kept(job, ("o_proj",))
    else:
        total += e * s.q_dim + 4 * s.num_heads  # the kernel's output (o_proj's input) and log-sum-exp
        total += e * s_len if attn == "sdpa" else 0
    total += e * h * _input_kept(job, ("q_proj", "k_proj", "v_proj"))
    return total + _adapter_bytes(job, [t for t in _layer_targets(job) if t not in MLP_PROJECTIONS])


def _mlp_bytes(job: EstimateContext) -> int:
    """What a layer's MLP keeps per token: gate, up and their product's outputs (Liger's SwiGLU and
    zerolab's SwiGLU-down node keep gate and up only), its projections' inputs where kept (down's
    not with the node, which recomputes it: ``zerolab.lora_nodes.fuse_swiglu_down``), its adapters."""
    e, inter, h = job.e, job.shape.intermediate_size, job.shape.hidden_size
    total = (2 if job.swiglu_in_place else 3) * e * inter
    total += e * h * _input_kept(job, ("gate_proj", "up_proj"))
    total += e * inter * (_input_kept(job, ("down_proj",)) and not job.swiglu_down)
    return total + _adapter_bytes(job, [t for t in _layer_targets(job) if t in MLP_PROJECTIONS])


def _layer_targets(job: EstimateContext) -> list[str]:
    return [t for t in target_projections(job.cfg.adapter)[0] if t != "lm_head"]


def _input_kept(job: EstimateContext, group: Sequence[str]) -> bool:
    """Whether the (shared) input of the projections ``group`` is kept for their backward: they
    train (full fine-tuning), ZeRO-3's ``memory_efficient_linear`` keeps it, or an adapter without
    dropout on one of them reads it."""
    if not job.peft or job.knobs.memory_efficient_linear:
        return True
    dropout = job.cfg.adapter.dropout > 0
    return not dropout and any(t in _layer_targets(job) for t in group)


def _adapter_bytes(job: EstimateContext, targets: Sequence[str]) -> int:
    """Per token, what the adapters of ``targets`` keep (see :func:`activation_bytes_per_layer`)."""
    if not job.peft:
        return 0
    e = job.e
    dropout = job.cfg.adapter.dropout > 0
    mask_bytes = 1 if job.gpu else e
    rank = job.cfg.adapter.adalora_init_r if job.cfg.adapter.method == "adalora" else job.cfg.adapter.r
    total = 0
    for name in targets:
        fan_in, fan_out = job.shape.linear_shapes()[name]
        if dropout:
            total += (e + mask_bytes) * fan_in
        total += e * rank
        if job.cfg.adapter.method == "dora":
            total += 2 * e * fan_out
        elif job.cfg.adapter.method == "adalora":
            total += e * fan_out  # its product ÷ the rank, a (1,) tensor: the division keeps the dividend
    return total


def saved_per_layer(job: EstimateContext) -> int:
    """Bytes per token one decoder layer keeps from its forward to its backward pass, without
    checkpointing: :func:`activation_bytes_per_layer`, or with the tiled MLP (``model.tiled_mlp``)
    the rest of the layer and the MLP's input (e·h), which is all the tiled MLP keeps."""
    if not job.cfg.model.tiles_mlp():
        return activation_bytes_per_layer(job)
    return _attention_bytes(job) + job.e * job.shape.hidden_size


def mlp_tile_tokens(job: EstimateContext) -> int:
    """Tokens of one tile of the tiled MLP (``zerolab.long_rows.mlp_tiles``); all of the
    micro-batch's without tiling."""
    if not job.cfg.model.tiles_mlp():
        return job.tokens
    from zerolab.long_rows import mlp_tiles  # imports torch, which the estimator otherwise does not

    return math.ceil(job.tokens / mlp_tiles(job.cfg.model.tiled_mlp, job.tokens, job.shape.hidden_size))


def mlp_tile(job: EstimateContext) -> int:
    """With the tiled MLP, while a layer's backward pass recomputes one tile: the tile's MLP
    activations and their gradients (:func:`_mlp_bytes` and the MLP's gradients of
    :func:`backward_gradients` without tiling, per tile token), plus the MLP input's gradient the
    tiles fill (e·h per token of the micro-batch). 0 without tiling."""
    if not job.cfg.model.tiles_mlp():
        return 0
    e = job.e
    grads = (1 if job.swiglu_in_place else 3) * e * job.shape.intermediate_size
    return mlp_tile_tokens(job) * (_mlp_bytes(job) + grads) + job.tokens * e * job.shape.hidden_size


def activations(job: EstimateContext) -> int:
    """Activations saved for the backward pass of one micro-batch of B·S tokens. Without
    checkpointing: L × the per-layer bytes (:func:`saved_per_layer`, less what the first layer of
    an adapter run skips). With checkpointing (non-reentrant, per decoder layer) each layer keeps
    only its input (:func:`checkpointed_inputs`, on the host but two with checkpoint offload). Both add the final norm (as a layer's norm, when the head or
    the norm trains), RoPE cos/sin (2·e·head_dim), the ids and labels (16 bytes), with packing
    the position ids (8 bytes), and for SDPA and eager attention the boolean B×1×S×S mask that
    transformers builds from the padding or, packed, from the position ids (S bytes per token;
    flash_attention_2 and varlen get no such mask).

    Every term is linear in the tokens B·S except the mask and the attention terms of
    :func:`activation_bytes_per_layer` under SDPA and eager (:func:`attention_quadratic`): no
    length is capped and no constant was fitted per token, so the same formulas hold for
    32K-256K-token rows (measured only up to 4K so far: docs/memory.md)."""
    s, e = job.shape, job.e
    head_trains = not job.peft or "lm_head" in target_projections(job.cfg.adapter)[0]
    other = _norm_bytes(job, trains=head_trains) + 2 * e * s.head_dim + 16
    other += 8 if job.cfg.data.packing else 0
    other += job.seq_len if _builds_mask(job) else 0
    if job.cfg.model.gradient_checkpointing:
        return checkpointed_inputs(job) + job.tokens * other
    layers = s.num_layers * saved_per_layer(job) - _first_layer_saving(job)
    return job.tokens * (layers + other)


def mlp_tile_forward(job: EstimateContext) -> int:
    """With the tiled MLP, during a layer's forward pass: one tile's gate, up and product outputs
    (3·e·I per tile token), freed before the next tile. 0 without tiling."""
    return mlp_tile_tokens(job) * 3 * job.e * job.shape.intermediate_size if job.cfg.model.tiles_mlp() else 0


def checkpointed_inputs(job: EstimateContext) -> int:
    """With gradient checkpointing, what the decoder layers keep on the GPU between the forward and
    the backward pass: each layer's input, L·B·S·e·h (0 without checkpointing). At long rows this is
    the largest activation term (7B: 196 KiB per token, 49 GiB at 256K tokens). With checkpoint
    offload (``model.offload_checkpoints``, GPUs) :func:`checkpoints_on_device` of them stay."""
    if not job.cfg.model.gradient_checkpointing:
        return 0
    return job.tokens * checkpoints_on_device(job) * job.e * job.shape.hidden_size


def offloads_checkpoints(job: EstimateContext) -> bool:
    """Whether the checkpoints go to host memory: ``model.offload_checkpoints`` on GPUs (on a CPU the
    offload is a plain copy within the same memory, and the estimate keeps them where they were)."""
    return job.cfg.model.offload_checkpoints and job.cfg.model.gradient_checkpointing and job.gpu


def checkpoints_on_device(job: EstimateContext) -> int:
    """Layer inputs on the GPU at the peak: all L; with checkpoint offload two (``zerolab.long_rows``):
    the last layer's, which never leaves, while the backward pass starts, then the input of the layer
    being recomputed and the next one's, copied back ahead of it."""
    layers = job.shape.num_layers
    return min(layers, 2) if offloads_checkpoints(job) else layers


def offloaded_checkpoints(job: EstimateContext) -> list[int]:
    """With checkpoint offload, the pinned host copies of a micro-batch's checkpoints: one of
    B·S·e·h bytes per layer but the last (torch's pinned allocator rounds each up to a power of two,
    :func:`zerolab.memory.host.host_components`). Empty otherwise."""
    if not offloads_checkpoints(job):
        return []
    return [job.tokens * job.e * job.shape.hidden_size] * (job.shape.num_layers - 1)


def backward_gradients(job: EstimateContext) -> int:
    """Gradients in flight while a decoder layer's backward pass runs, on top of what it saved.
    Without the tiled MLP: the gradient of the residual stream reaching it (e·h per token) and the
    larger of the MLP's and attention's. The MLP's: the gradient of down_proj's input (e·I) and,
    from Hugging Face's SiLU × up, the gradients of the gate and up outputs (2·e·I more; Liger's
    SwiGLU and zerolab's SwiGLU-down node write them in place of their saved inputs, the node
    down's recomputed input in place of its gradient). Attention's (:func:`_attention_backward`).
    With the tiled MLP the layer's two backward passes come one after the other and the larger
    counts: the MLP's, one tile at a time (:func:`mlp_tile`, which holds the MLP input's gradient
    the tiles fill) beside the residual's gradient; then attention's, by which time the MLP's input
    that the tiled MLP kept (counted in :func:`saved_per_layer`) has been freed for the
    residual's gradient. Derived from what autograd and the kernels allocate: negligible beside the
    loss region at short rows, a tenth of the per-token bytes at long ones (7B, 256K-token rows with
    the tiled MLP: the attention's 9.3 GiB, where the MLP's phase holds 3.9)."""
    e, s = job.e, job.shape
    residual = job.tokens * e * s.hidden_size
    attention = job.tokens * _attention_backward(job)
    if job.cfg.model.tiles_mlp():
        return max(residual + mlp_tile(job), attention)
    return residual + max(job.tokens * (1 if job.swiglu_in_place else 3) * e * s.intermediate_size, attention)


def _attention_backward(job: EstimateContext) -> int:
    """Per token, what attention's backward kernel allocates: the query, key and value gradients at
    the query heads' width (FlashAttention's backward expands K/V to every head and sums them back,
    as SDPA with a mask gets them repeated), its fp32 query-gradient accumulator (4·q_dim) and, with
    fewer K/V heads, the summed key and value gradients (2·e·kv_dim): (3e + 4)·q_dim + 2·e·kv_dim.
    The same figure as the MLP's under Liger on the 7B shape (37,888 bytes per token)."""
    s, e = job.shape, job.e
    return (3 * e + 4) * s.q_dim + (2 * e * s.kv_dim if s.num_kv_heads != s.num_heads else 0)


def attention_quadratic(job: EstimateContext) -> int:
    """The part of the activations that grows with B·S² rather than B·S: SDPA's mask, built once
    (S bytes per token) and converted per layer (e·S per token), eager attention's fp32
    probabilities and their cast ((4 + e)·heads·S per token per layer); per layer for every
    layer without checkpointing, for the recomputed one with it. 0 with flash_attention_2 and
    varlen, whose memory is linear in S."""
    if not _builds_mask(job):
        return 0
    s_len, e = job.seq_len, job.e
    per_layer = (4 + (e if e != 4 else 0)) * job.shape.num_heads * s_len if job.attn == "eager" else e * s_len
    layers = 1 if job.cfg.model.gradient_checkpointing else job.shape.num_layers
    return job.tokens * (s_len + layers * per_layer)


def _builds_mask(job: EstimateContext) -> bool:
    """transformers builds the B×1×S×S mask for SDPA and eager attention, not for flash_attention_2
    or zerolab's varlen function (which runs on the row's sample boundaries)."""
    return job.attn in ("sdpa", "eager")


def _first_layer_saving(job: EstimateContext) -> int:
    """With an adapter and no checkpointing, the first layer's input (the frozen embeddings)
    needs no gradient: its first norm saves nothing and its q/k/v adapters keep no dropout masks."""
    if not job.peft or job.cfg.model.gradient_checkpointing:
        return 0
    h = job.shape.hidden_size
    targets = target_projections(job.cfg.adapter)[0]
    masks = sum(t in targets for t in ("q_proj", "k_proj", "v_proj")) if job.cfg.adapter.dropout > 0 else 0
    return _norm_bytes(job, trains=False) + masks * h * (1 if job.gpu else job.e)


def _norm_bytes(job: EstimateContext, *, trains: bool) -> int:
    """What one RMSNorm keeps per token: Hugging Face's keeps its fp32 input copy and rsqrt (4h + 4),
    plus the normalised input when the norm or what follows it trains (e·h); Liger's its input
    in e and the rsqrt (e·h + 4)."""
    h = job.shape.hidden_size
    if job.liger:
        return job.e * h + 4
    return 4 * h + 4 + (job.e * h if trains else 0)


def recomputed_layer(job: EstimateContext) -> int:
    """Under checkpointing the backward pass re-runs one layer's forward at a time: its full
    activations, B·S × the per-layer bytes (:func:`saved_per_layer`: with the tiled MLP, without the
    MLP's, of which one tile is recomputed later, :func:`mlp_tile`), live on top of the saved inputs
    (0 otherwise)."""
    return job.tokens * saved_per_layer(job) if job.cfg.model.gradient_checkpointing else 0


def logits_and_loss(job: EstimateContext) -> int:
    """The loss region at the start of the backward pass, per micro-batch of B·S tokens: logits
    (e·V), their fp32 log-softmax saved by cross-entropy (4·V; the fp32 upcast of the logits is
    freed once it is computed), then in the backward the gradient of the log-probabilities and
    of the fp32 logits (4·V each): (e + 12)·V per token. When the head trains the backward then
    holds logits, their gradient and the head's weight gradient: 2·e·V per token + V·h·e.

    With Liger's fused linear + cross-entropy (``zerolab.kernels``) no logits are kept: the
    forward computes the gradient of the hidden states (e·h per token, kept for the backward)
    and the fp32 per-token loss (4), going through the tokens in chunks
    (``zerolab.kernels.fused_loss_chunk``: Liger's 2^⌈log2(B·S / ⌈V/h⌉)⌉ rows, at least 1,024) whose
    logits (e·V each) are computed in place, plus the matrix product's output of the chunk's input
    gradient. The loss goes through the tokens with a target only (``zerolab.kernels._target_rows``),
    which the data decides: this counts every token, the bound."""
    v = job.shape.vocab_size
    if job.fused_loss:
        from zerolab.kernels import fused_loss_chunk  # imported with the context already

        h = job.shape.hidden_size
        chunk = fused_loss_chunk(job.tokens, v, h)[1]
        return job.tokens * (job.e * h + 4) + chunk * (job.e * v + job.e * h)
    loss = (job.e + 12) * v * job.tokens
    if not job.peft:
        loss = max(loss, 2 * job.e * v * job.tokens + v * job.shape.hidden_size * job.e)
    return loss


def dora_transient(job: EstimateContext) -> int:
    """DoRA's forward computes the weight norm of each wrapped projection from
    lora_B(lora_A(eye(in))): an in×in identity, the in×out LoRA weight and W + scale·ΔW, freed
    after the module but as large as (in² + 2·in·out)·e for the largest projection."""
    if job.cfg.adapter.method != "dora":
        return 0
    targets = [t for t in target_projections(job.cfg.adapter)[0] if t != "lm_head"]
    shapes = job.shape.linear_shapes()
    return max((job.e * (i * i + 2 * i * o) for i, o in (shapes[t] for t in targets)), default=0)
