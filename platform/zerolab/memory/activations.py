"""Activation terms: what the forward pass saves for the backward pass, the loss region and the
transients around them, for one micro-batch of B·S tokens."""

from __future__ import annotations

import math
from collections.abc import Sequence

from zerolab.memory.context import EstimateContext
from zerolab.memory.shapes import target_projections
from zerolab.memory.units import pow2


def activation_bytes_per_layer(job: EstimateContext) -> int:
    """Bytes one decoder layer saves for backward, per token, without checkpointing.

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
    s, e = job.shape, job.e
    h, inter, s_len = s.hidden_size, s.intermediate_size, job.seq_len
    full = not job.peft
    attn = job.attn
    targets, _ = target_projections(job.cfg.adapter)
    targets = [t for t in targets if t != "lm_head"]
    dropout = job.peft and job.cfg.adapter.dropout > 0
    mask_bytes = 1 if job.gpu else e
    # Flash kernels (flash_attention_2, varlen) take fewer K/V heads; so does SDPA without a mask
    # (varlen's unpacked batches), but transformers repeats K/V for SDPA with one.
    gqa_repeat = attn not in ("flash_attention_2", "varlen") and s.num_kv_heads != s.num_heads

    def input_kept(group: Sequence[str]) -> bool:
        if full or job.knobs.memory_efficient_linear:
            return True
        return not dropout and any(t in targets for t in group)

    total = 2 * _norm_bytes(job, trains=full)
    kv = s.q_dim if gqa_repeat else s.kv_dim
    total += e * (s.q_dim + 2 * kv)
    if attn == "eager":
        # fp32 softmax probabilities and their cast to e; o_proj's input is a transposed copy.
        total += (4 + (e if e != 4 else 0)) * s.num_heads * s_len + e * s.q_dim * input_kept(("o_proj",))
    else:
        total += e * s.q_dim + 4 * s.num_heads  # the kernel's output (o_proj's input) and log-sum-exp
        total += e * s_len if attn == "sdpa" else 0
    total += (2 if job.liger else 3) * e * inter
    total += e * h * input_kept(("q_proj", "k_proj", "v_proj")) + e * h * input_kept(("gate_proj", "up_proj"))
    total += e * inter * input_kept(("down_proj",))
    rank = job.cfg.adapter.adalora_init_r if job.cfg.adapter.method == "adalora" else job.cfg.adapter.r
    for name in targets:
        fan_in, fan_out = s.linear_shapes()[name]
        if dropout:
            total += (e + mask_bytes) * fan_in
        total += e * rank
        if job.cfg.adapter.method == "dora":
            total += 2 * e * fan_out
        elif job.cfg.adapter.method == "adalora":
            total += e * fan_out  # its product ÷ the rank, a (1,) tensor: the division keeps the dividend
    return total


def activations(job: EstimateContext) -> int:
    """Activations saved for the backward pass of one micro-batch of B·S tokens. Without
    checkpointing: L × the per-layer bytes (less what the first layer of an adapter run skips).
    With checkpointing (non-reentrant, per decoder layer) each layer keeps only its input
    (:func:`checkpointed_inputs`). Both add the final norm (as a layer's norm, when the head or
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
    layers = s.num_layers * activation_bytes_per_layer(job) - _first_layer_saving(job)
    return job.tokens * (layers + other)


def checkpointed_inputs(job: EstimateContext) -> int:
    """With gradient checkpointing, what the decoder layers keep between the forward and the
    backward pass: each layer's input, L·B·S·e·h, on the GPU (0 without checkpointing). At long
    rows this is the largest activation term (7B: 196 KiB per token, 49 GiB at 256K tokens); it
    is what offloading the checkpoints to host memory (ALST) would move off the GPU."""
    if not job.cfg.model.gradient_checkpointing:
        return 0
    return job.tokens * job.shape.num_layers * job.e * job.shape.hidden_size


def backward_gradients(job: EstimateContext) -> int:
    """Gradients in flight while a decoder layer's backward pass runs, on top of what it saved:
    the gradient of the residual stream reaching it (e·h per token) and the MLP's, the largest:
    the gradient of down_proj's input (e·I) and, from Hugging Face's SiLU × up, the gradients
    of the gate and up outputs (2·e·I more; Liger's SwiGLU writes them in place of its saved
    inputs). Derived from what autograd allocates, not yet measured: negligible beside the loss
    region at short rows, a tenth of the per-token bytes at long ones."""
    e, s = job.e, job.shape
    return job.tokens * (e * s.hidden_size + (1 if job.liger else 3) * e * s.intermediate_size)


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
    activations, B·S × the per-layer bytes, live on top of the saved inputs (0 otherwise)."""
    return job.tokens * activation_bytes_per_layer(job) if job.cfg.model.gradient_checkpointing else 0


def logits_and_loss(job: EstimateContext) -> int:
    """The loss region at the start of the backward pass, per micro-batch of B·S tokens: logits
    (e·V), their fp32 log-softmax saved by cross-entropy (4·V; the fp32 upcast of the logits is
    freed once it is computed), then in the backward the gradient of the log-probabilities and
    of the fp32 logits (4·V each): (e + 12)·V per token. When the head trains the backward then
    holds logits, their gradient and the head's weight gradient: 2·e·V per token + V·h·e.

    With Liger's fused linear + cross-entropy (``zerolab.kernels``) no logits are kept: the
    forward computes the gradient of the hidden states (e·h per token, kept for the backward)
    and the fp32 per-token loss (4), going through the tokens in chunks of
    2^⌈log2(B·S / ⌈V/h⌉)⌉ rows whose logits (e·V each) are computed in place, plus the matrix
    product's output of the chunk's input gradient."""
    v = job.shape.vocab_size
    if job.fused_loss:
        h = job.shape.hidden_size
        chunk = min(job.tokens, pow2(math.ceil(job.tokens / math.ceil(v / h))))
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
