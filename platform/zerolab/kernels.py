"""Faster kernels for training on GPUs, each with a clean fallback where it cannot run.

- ``varlen`` attention (``model.attn_implementation: varlen``): packed rows go through PyTorch's
  FlashAttention variable-length kernel (``torch.nn.attention.varlen``), one causal attention per
  packed sample from the per-sample boundaries the batcher computes (``packed_cu_seqlens``), so
  packed samples never attend to each other and no block of the S×S score matrix outside a
  sample is computed. SDPA with the block-diagonal mask that transformers builds from position
  ids computes every block, and on GPUs takes the slower memory-efficient kernel. Where the kernel
  is missing (CPU, older torch) or fails its numerical self-check, the model loads with ``sdpa``
  instead, which is exact but slower.
- Liger Kernel (``model.kernels``): Triton kernels for RMSNorm, SwiGLU and RoPE, and the fused
  linear + cross-entropy loss, which computes the loss and its gradient chunk by chunk without
  materialising the B·S×V logits (with a 150k vocabulary, the largest tensors of a LoRA step).
  Applied on GPU when the ``liger_kernel`` package imports; everything else keeps Hugging Face's
  modules. The fused loss is skipped when the head itself is trained. Under ZeRO-3 it reads the
  partitioned head's weight outside the head's forward, which DeepSpeed gathers on access.
- LoRA's ``base(x) + scale·B(A(x))`` as one in-place matrix product (``fuse_lora``): peft runs
  B's product, a scale and an add, three passes over the B·S×out output in the forward and one
  more in the backward, for every wrapped projection (about a thousand small kernels per step
  of a 7B model); ``addmm_`` accumulates ``scale·A(x)·Bᵀ`` into the base layer's output in the
  product's own epilogue; without dropout the layer is one autograd node whose backward also
  accumulates the adapter's input gradient into the base product's instead of autograd adding the
  two. Plain LoRA (rsLoRA too) with one active adapter, on any device, below ZeRO-3 (whose hooks
  partition and gather weights around module calls); other layers keep peft's forward, and a
  compiled layer gets the same products without the one-node backward (Inductor fuses its own).
- Regional compilation (``model.compile``, ``compile_layers``): each decoder layer's forward goes
  through ``torch.compile`` (Inductor), which fuses its elementwise work (norms, RoPE, SwiGLU,
  residual adds, LoRA's dropout and scale) into fewer kernels and launches them from generated
  code. All layers run the same code, so one compiled graph (and one for a second, dynamic
  sequence length) serves all of them. Only ``forward`` is compiled: the hooks around the layer's
  call (DeepSpeed's ZeRO-3 gathers, gradient checkpointing) stay eager. Any device, any stage.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import logging
import types
from typing import Any

import torch
import torch.nn.functional as F

from zerolab.batches import CU_SEQLENS_KEY, packed_cu_seqlens

logger = logging.getLogger(__name__)

VARLEN_ATTENTION = "zerolab_varlen"
"""The name under which the varlen attention function is registered with transformers."""


# --- varlen attention -----------------------------------------------------------------------------


def resolve_attention(requested: str, device: torch.device | None = None) -> str:
    """The ``attn_implementation`` to load the model with: ``varlen`` becomes the registered varlen
    function where it runs correctly on ``device`` (default: the current CUDA device), else ``sdpa``."""
    if requested != "varlen":
        return requested
    reason = varlen_unavailable_reason(device)
    if reason:
        logger.info("model.attn_implementation=varlen: %s; using sdpa (exact, slower on packed batches)", reason)
        return "sdpa"
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN_ATTENTION, varlen_attention_forward)
    return VARLEN_ATTENTION


def varlen_unavailable_reason(device: torch.device | None = None) -> str | None:
    """None when the varlen kernel runs and matches SDPA on ``device``; else why not."""
    if not torch.cuda.is_available() or (device is not None and device.type != "cuda"):
        return "no CUDA device"
    device = device or torch.device("cuda", torch.cuda.current_device())
    return _varlen_self_check(str(device))


@functools.lru_cache(maxsize=4)
def _varlen_self_check(device: str) -> str | None:
    """Forward and backward of three packed causal sequences (GQA 4:2) against SDPA per sequence."""
    try:
        from torch.nn.attention import varlen  # noqa: F401
    except ImportError:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen"
    gen = torch.Generator(device=device).manual_seed(0)
    lengths = [37, 64, 27]
    cu = torch.tensor([0, 37, 101, 128], dtype=torch.int32, device=device)
    q, k, v = (torch.randn(128, h, 64, device=device, dtype=torch.bfloat16, generator=gen).requires_grad_()
               for h in (4, 2, 2))
    try:
        out = _varlen_call(q, k, v, cu, max(lengths), 64**-0.5)
        out.float().square().sum().backward()
    except (RuntimeError, TypeError, NotImplementedError) as exc:
        return f"the varlen kernel failed its self-check ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})"
    grads = q.grad.float().clone()
    ref_out, ref_grads = [], []
    for start, n in zip(cu[:-1].tolist(), lengths):
        qs, ks, vs = (t.detach()[start:start + n].float().transpose(0, 1).requires_grad_() for t in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks.repeat_interleave(2, 0), vs.repeat_interleave(2, 0), is_causal=True)
        o.square().sum().backward()
        ref_out.append(o.detach().transpose(0, 1))
        ref_grads.append(qs.grad.transpose(0, 1))
    err_out = (out.float() - torch.cat(ref_out)).norm() / torch.cat(ref_out).norm()
    err_grad = (grads - torch.cat(ref_grads)).norm() / torch.cat(ref_grads).norm()
    if not (err_out < 2e-2 and err_grad < 5e-2):  # bf16 operands land near 1e-3..1e-2
        return f"the varlen kernel disagrees with SDPA (relative error {err_out:.1e} forward, {err_grad:.1e} backward)"
    return None


def _varlen_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int, scale: float) -> torch.Tensor:
    """Causal varlen attention on (T, heads, head_dim) tensors, across torch versions: releases up
    to 2.10 take ``is_causal``, later ones ``window_size=(-1, 0)``; both take fewer K/V heads (GQA)."""
    from torch.nn.attention.varlen import varlen_attn

    params = _varlen_params()
    kwargs: dict[str, Any] = {"scale": scale} if "scale" in params else {}
    if "scale" not in params and abs(scale - q.shape[-1] ** -0.5) > 1e-6:
        raise TypeError(f"this torch's varlen_attn takes no scale, and the model needs {scale} rather than head_dim**-0.5")
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0)
    else:
        kwargs["is_causal"] = True
    if "enable_gqa" in params and k.shape[1] != q.shape[1]:
        kwargs["enable_gqa"] = True
    return varlen_attn(q, k, v, cu, cu, max_len, max_len, **kwargs)


@functools.cache
def _varlen_params() -> frozenset[str]:
    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


def varlen_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                             **kwargs: Any) -> tuple[torch.Tensor, None]:
    """A transformers attention function. Packed micro-batches (``packed_cu_seqlens`` given) run the
    varlen kernel over the flattened B·S tokens, with the row width as the longest-sequence bound (a
    bound is enough and needs no device sync); any other batch goes to SDPA. transformers builds no
    mask for this implementation, so those batches must be right-padded (as zerolab's are): with
    causal attention no real token then sees a padding token."""
    cu = kwargs.get(CU_SEQLENS_KEY)
    if cu is None or dropout:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    b, heads, s, d = query.shape
    # (B, H, S, D) -> (B·S, H, D); the projections' outputs are laid out (B, S, H, D), so these are views.
    q = query.transpose(1, 2).reshape(b * s, heads, d)
    k = key.transpose(1, 2).reshape(b * s, key.shape[1], d)
    v = value.transpose(1, 2).reshape(b * s, value.shape[1], d)
    out = _varlen_call(q, k, v, cu, s, scaling if scaling is not None else d**-0.5)
    return out.view(b, s, heads, d), None


# --- Liger Kernel ---------------------------------------------------------------------------------


def liger_available() -> bool:
    """Whether Liger Kernel can run here: the package is installed and a CUDA device exists."""
    return torch.cuda.is_available() and importlib.util.find_spec("liger_kernel") is not None


def use_liger(kernels: str, *, use_gpu: bool) -> bool:
    """Whether the norms and SwiGLU run fused (what the memory estimate needs to know): Liger's
    kernels on GPU, with ``model.kernels`` ``liger``, or ``auto`` where the package is installed.
    Compiled layers (``model.compile``) take Inductor's kernels instead, which keep as little: the
    0.5B step allocated 16.31 GiB compiled against 16.16 GiB with Liger's (h100-18)."""
    if kernels == "none" or not use_gpu:
        return False
    return kernels == "liger" or importlib.util.find_spec("liger_kernel") is not None


def use_fused_loss(kernels: str, *, use_gpu: bool, head_trains: bool) -> bool:
    """Whether the training loss will be Liger's fused linear + cross-entropy (what the memory
    estimate needs to know): Liger on (``auto``: where the package is installed), on GPU, with a
    frozen head."""
    return use_liger(kernels, use_gpu=use_gpu) and not head_trains


def apply_liger(model: torch.nn.Module, *, fused_loss: bool, layers: bool = True) -> list[str]:
    """Patch ``model`` (a Hugging Face causal LM, before peft wraps it) with Liger's kernels; returns
    what was applied ([] where Liger is unavailable or the architecture unsupported). ``layers=False``
    (decoder layers to be compiled) leaves the norms, RoPE and SwiGLU to Inductor, which fuses them
    itself: Liger's Triton kernels inside a compiled graph defeat Inductor's analysis of what they
    write (torch 2.11 then assumes they write every input) and add minutes to the compile."""
    if not liger_available():
        return []
    try:
        from liger_kernel.transformers import monkey_patch
    except (ImportError, AttributeError, RuntimeError) as exc:  # e.g. a Triton or transformers it does not support
        logger.warning("Liger Kernel is installed but does not import (%s); training without it", exc)
        return []
    patch = getattr(monkey_patch, f"apply_liger_kernel_to_{model.config.model_type}", None)
    if patch is None:
        return []
    options = {"rope": layers, "rms_norm": layers, "swiglu": layers, "cross_entropy": False, "fused_linear_cross_entropy": False}
    accepted = inspect.signature(patch).parameters
    patch(model=model, **{k: v for k, v in options.items() if k in accepted})
    applied = [k for k in ("rope", "rms_norm", "swiglu") if k in accepted and layers]
    if fused_loss and hasattr(model, "lm_head") and hasattr(model, "model"):
        model.forward = types.MethodType(_fused_loss_forward, model)
        applied.append("fused_linear_cross_entropy")
    return applied


def _fused_loss_forward(self: Any, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                        position_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                        num_items_in_batch: torch.Tensor | int | None = None, **kwargs: Any) -> Any:
    """The causal LM's forward with the loss from hidden states and the head's weight, fused
    (training with labels only; evaluation and generation take the model's own forward). Same
    value as transformers' ``ForCausalLMLoss``: labels shifted by one, -100 ignored, the sum
    divided by ``num_items_in_batch`` when given, else the mean."""
    if labels is None or not self.training:
        return type(self).forward(self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                  labels=labels, num_items_in_batch=num_items_in_batch, **kwargs)
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    from transformers.modeling_outputs import CausalLMOutputWithPast

    hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs).last_hidden_state
    targets = F.pad(labels, (0, 1), value=-100)[..., 1:].reshape(-1).to(hidden.device)
    reduction = "mean" if num_items_in_batch is None else "sum"
    # Under ZeRO-3 reading the partitioned head's weight here gathers it (DeepSpeed registers it as
    # an external parameter of the model); it then stays gathered into the next step, which the
    # memory estimate's ZeRO-3 forward-start phase counts.
    loss = liger_fused_linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), self.lm_head.weight, targets,
                                            ignore_index=-100, reduction=reduction)
    if num_items_in_batch is not None:
        loss = loss / num_items_in_batch
    return CausalLMOutputWithPast(loss=loss)


# --- LoRA ---------------------------------------------------------------------------------------


def fuse_lora(model: torch.nn.Module) -> int:
    """Give every plain peft LoRA ``Linear`` of ``model`` the fused forward; returns how many.
    Call after the adapter is applied; under ZeRO-3 the layers keep taking peft's forward."""
    from peft.tuners.lora.layer import Linear

    count = 0
    for module in model.modules():
        if type(module) is Linear:  # not its subclasses (quantized bases, AdaLoRA's SVD layers)
            module.forward = types.MethodType(_lora_addmm_forward, module)
            count += 1
    return count


def _lora_addmm_forward(self: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """peft's LoRA forward, ``base(x) + scale·B(A(dropout(x)))``, with the scaled product of B
    accumulated in place into the base layer's output by one ``addmm_`` (the base layer's
    backward needs its input and weight, never its output, so the in-place update is safe for
    autograd). Anything else — adapters disabled or merged, several active adapters, DoRA and
    other variants, a bias on B, mixed dtypes, a ZeRO-3 partitioned B — takes peft's own forward."""
    names = self.active_adapters
    name = names[0] if len(names) == 1 else None
    a_layer, b_layer = (self.lora_A[name], self.lora_B[name]) if name in self.lora_A else (None, None)
    base = self.base_layer
    if (a_layer is None or args or kwargs or self.disable_adapters or self.merged or name in self.lora_variant
            or b_layer.bias is not None or hasattr(b_layer.weight, "ds_id")
            or not x.dtype == a_layer.weight.dtype == b_layer.weight.dtype == base.weight.dtype):
        return type(self).forward(self, x, *args, **kwargs)
    flat = x.reshape(-1, x.shape[-1])
    # In a compiled layer the plain products below: Inductor derives and fuses their backward
    # itself, and Dynamo on torch 2.11 failed to trace the autograd.Function on CUDA (the adapters
    # then got no gradient at all).
    if not torch.compiler.is_compiling() and isinstance(self.lora_dropout[name], torch.nn.Identity) and not base.weight.requires_grad and (
            base.bias is None or not base.bias.requires_grad):
        out = _LoRALinear.apply(flat, base.weight, base.bias, a_layer.weight, b_layer.weight, self.scaling[name])
    else:
        out = base(flat)
        out.addmm_(a_layer(self.lora_dropout[name](flat)), b_layer.weight.t(), alpha=self.scaling[name])
    return out.view(*x.shape[:-1], out.shape[-1])


class _LoRALinear(torch.autograd.Function):
    """``x·Wᵀ + b + s·(x·Aᵀ)·Bᵀ`` for a frozen ``W`` (no dropout) as one autograd node. Its backward
    accumulates the adapter's share of the input gradient into the base product's (``addmm_``,
    the sum in the product's epilogue) where autograd would add the two branches' gradients in
    a separate pass over the B·S×in tensor, once per wrapped projection."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora_a: torch.Tensor,
                lora_b: torch.Tensor, scale: float) -> torch.Tensor:
        h = x @ lora_a.t()
        out = x @ weight.t() if bias is None else torch.addmm(bias, x, weight.t())
        out.addmm_(h, lora_b.t(), alpha=scale)
        ctx.save_for_backward(x, weight, lora_a, lora_b, h)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, lora_a, lora_b, h = ctx.saved_tensors
        grad_h = (grad @ lora_b).mul_(ctx.scale)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = grad @ weight
            grad_x.addmm_(grad_h, lora_a)
        grad_a = grad_h.t() @ x if ctx.needs_input_grad[3] else None
        grad_b = (grad.t() @ h).mul_(ctx.scale) if ctx.needs_input_grad[4] else None
        return grad_x, None, None, grad_a, grad_b, None


# --- regional compilation ------------------------------------------------------------------------


def compile_layers(layers: list[torch.nn.Module], backend: Any = "inductor") -> int:
    """Compile the ``forward`` of each of ``layers`` (the model's decoder layers) with
    ``torch.compile``; returns how many. Call once the layers are final (adapters applied and
    fused), before ``deepspeed.initialize``. A graph that fails to compile runs eagerly, with
    Dynamo's warning saying why (``suppress_errors``): a job is not lost minutes into its start for
    an optimisation.

    Shapes are dynamic from the first compile: padded batches change their length with every batch
    and the last batch of an epoch has fewer rows, and each new static shape compiled the layer
    again until Dynamo's recompile limit sent the rest of the run back to eager layers (a CPU run of
    the embedded default, by its 60th step). What still compiles separately, once each: the first
    layer (its input from frozen embeddings needs no gradient) and the others; a batch without
    padding (no attention mask); the evaluation's forward without gradients (five graphs in that run).
    """
    torch._dynamo.config.suppress_errors = True
    for layer in layers:
        layer.forward = torch.compile(layer.forward, dynamic=True, backend=backend)
    return len(layers)


__all__ = ["CU_SEQLENS_KEY", "VARLEN_ATTENTION", "apply_liger", "compile_layers", "fuse_lora", "liger_available", "packed_cu_seqlens", "resolve_attention",
           "use_fused_loss", "use_liger", "varlen_attention_forward", "varlen_unavailable_reason"]
