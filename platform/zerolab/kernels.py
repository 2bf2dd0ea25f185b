"""Faster kernels for training on GPUs, each with a clean fallback where it cannot run.

- ``varlen`` attention (``model.attn_implementation: varlen``): packed rows go through PyTorch's
  FlashAttention variable-length kernel (``torch.nn.attention.varlen``), one causal attention per
  packed sample from the per-sample boundaries the batcher computes (``packed_cu_seqlens``), so
  packed samples never attend to each other and no block of the S×S score matrix outside a
  sample is computed. Rows of one sample each (long rows) need no boundaries and take SDPA's
  causal attention, cuDNN's kernel on Hopper GPUs, which is faster there. SDPA with the
  block-diagonal mask that transformers builds from position ids computes every block, and on
  GPUs takes the slower memory-efficient kernel. Where the kernel
  is missing (CPU, older torch) or fails its numerical self-check, the model loads with ``sdpa``
  instead, which is exact but slower.
- Liger Kernel (``model.kernels``): Triton kernels for RMSNorm, SwiGLU and RoPE, and the fused
  linear + cross-entropy loss, which computes the loss and its gradient chunk by chunk without
  materialising the B·S×V logits (with a 150k vocabulary, the largest tensors of a LoRA step).
  Applied on GPU when the ``liger_kernel`` package imports; everything else keeps Hugging Face's
  modules. The fused loss is skipped when the head itself is trained. Under ZeRO-3 it reads the
  partitioned head's weight outside the head's forward, which DeepSpeed gathers on access.
- LoRA's products as one autograd node, and SwiGLU with down's LoRA as one: ``zerolab.lora_nodes``.
- Regional compilation (``model.compile``, ``compile_layers``): each decoder layer's forward goes
  through ``torch.compile`` (Inductor), which fuses its elementwise work (norms, RoPE, SwiGLU,
  residual adds, LoRA's dropout and scale) into fewer kernels and launches them from generated
  code. All layers run the same code, so one compiled graph (and one for a second, dynamic
  sequence length) serves all of them. Only ``forward`` is compiled: the hooks around the layer's
  call (DeepSpeed's ZeRO-3 gathers, gradient checkpointing) stay eager. Any device, any stage.
- FP8 products of the frozen base weights (``model.fp8``, :func:`use_fp8`): every frozen linear
  layer with at least ``model.fp8_min_features`` inputs and outputs keeps, beside its bf16 weight, an
  e4m3 copy and its transpose with one scale per tensor (two bytes per weight), made once on its
  device; the forward quantizes its input per row (one Triton pass on GPUs) and multiplies in FP8
  with ``torch._scaled_mm`` (rowwise scales, bf16 output); the backward quantizes the output
  gradient the same way and multiplies it by the transpose. The adapters, norms, attention and
  loss stay bf16: only the two products a frozen weight takes part in change. The bf16 weight
  stays for everything else (DoRA's norms, merges). H100-class GPUs (compute capability 8.9+), ZeRO 0-2.
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
from zerolab.errors import EnvironmentProblem

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
    bound is enough and needs no device sync); so do padding-free batches in transformers' own
    format (``cu_seq_lens_q`` with ``max_length_q``, as TRL's collator makes them), with their
    longest sample as the bound. Any other batch goes to SDPA: padded batches with their mask, and
    packed rows that hold one sample each (long rows), for which the batcher gives no boundaries,
    causal without a mask, where SDPA takes cuDNN's fused attention on Hopper GPUs (torch 2.11;
    1.6-1.7× FlashAttention-2's varlen kernel on 32K-128K rows of an H200, docs/benchmark.md#attention-kernels).
    transformers builds no mask for this implementation, so those batches must be right-padded (as
    zerolab's are): with causal attention no real token then sees a padding token."""
    cu, bound = kwargs.get(CU_SEQLENS_KEY), None
    if cu is None and kwargs.get("cu_seq_lens_q") is not None:
        cu, bound = kwargs["cu_seq_lens_q"], kwargs.get("max_length_q")
    if cu is None or dropout:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    b, heads, s, d = query.shape
    # (B, H, S, D) -> (B·S, H, D); the projections' outputs are laid out (B, S, H, D), so these are views.
    q = query.transpose(1, 2).reshape(b * s, heads, d)
    k = key.transpose(1, 2).reshape(b * s, key.shape[1], d)
    v = value.transpose(1, 2).reshape(b * s, value.shape[1], d)
    out = _varlen_call(q, k, v, cu, bound or s, scaling if scaling is not None else d**-0.5)
    return out.view(b, s, heads, d), None


# --- Liger Kernel ---------------------------------------------------------------------------------


def _liger_installed() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def liger_available() -> bool:
    """Whether Liger Kernel can run here: the package is installed and a CUDA device exists."""
    return torch.cuda.is_available() and _liger_installed()


def check_available(kernels: str, *, use_gpu: bool) -> None:
    """Refuse ``model.kernels=liger`` on GPUs where Liger Kernel is not installed (before anything loads)."""
    if kernels == "liger" and use_gpu and not _liger_installed():
        raise EnvironmentProblem(
            "model.kernels=liger runs Liger Kernel's Triton kernels, which are not installed here; install zerolab's gpu extra "
            "(pip install -e '.[gpu]', or pip install liger-kernel), or set model.kernels=auto to train without them.")


def use_liger(kernels: str, *, use_gpu: bool) -> bool:
    """Whether the norms and SwiGLU run fused (what the memory estimate needs to know): Liger's
    kernels on GPU, with ``model.kernels`` ``liger``, or ``auto`` where the package is installed.
    Compiled layers (``model.compile``) take Inductor's kernels instead, which keep as little: the
    0.5B step allocated 16.31 GiB compiled against 16.16 GiB with Liger's (h100-18)."""
    if kernels == "none" or not use_gpu:
        return False
    return kernels == "liger" or _liger_installed()


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
    """The causal LM's forward with the loss from hidden states and the head's weight, fused, where
    labels are given: training, and the evaluation loss, which the model's own forward would take
    from every token's logits in float32 (10 bytes per token and vocabulary entry: 50 GB for one
    32k row of a 152k vocabulary, which the memory estimate of a job with the fused loss does not
    count). Without labels (generation) the model's own forward, with logits. Same value as
    transformers' ``ForCausalLMLoss``: labels shifted by one, -100 ignored, the sum divided by
    ``num_items_in_batch`` when given, else the mean; ``shift_labels`` (sequence parallelism's
    slices, shifted before slicing) are taken as they are."""
    if labels is None:
        return type(self).forward(self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                  labels=labels, num_items_in_batch=num_items_in_batch, **kwargs)
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    from transformers.modeling_outputs import CausalLMOutputWithPast

    shift_labels = kwargs.pop("shift_labels", None)
    hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs).last_hidden_state
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=-100)[..., 1:]
    hidden, targets = _target_rows(hidden.reshape(-1, hidden.shape[-1]), shift_labels.reshape(-1).to(hidden.device))
    reduction = "mean" if num_items_in_batch is None else "sum"
    chunks = {}
    if _takes_chunk_mem_const(liger_fused_linear_cross_entropy):  # older Liger keeps its own chunks
        chunks["chunk_mem_const"] = fused_loss_chunk(hidden.shape[0], self.lm_head.out_features, hidden.shape[1])[0]
    # Under ZeRO-3 reading the partitioned head's weight here gathers it (DeepSpeed registers it as
    # an external parameter of the model); it then stays gathered into the next step, which the
    # memory estimate's ZeRO-3 forward-start phase counts.
    loss = liger_fused_linear_cross_entropy(hidden, self.lm_head.weight, targets, ignore_index=-100, reduction=reduction, **chunks)
    if num_items_in_batch is not None:
        loss = loss / num_items_in_batch
    return CausalLMOutputWithPast(loss=loss)


def _target_rows(hidden: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The hidden states (tokens × h) and targets of the tokens that have a target, where some have
    none: the head's product and the cross-entropy then run over those rows only. Masked prompts and
    padding contribute nothing to the loss and get a zero gradient either way; the benchmark's mix
    has a target at 14% of its tokens, and the head's two products (logits and their input
    gradient, 4·V·h per token) are about 7.5% of the 7B step's FLOPs when they run at every token.
    Finding the rows waits for the device, as Liger's own count of the targets (``.item()``) does
    right after it."""
    rows = targets.ne(-100).nonzero().squeeze(1)
    if rows.numel() in (0, targets.numel()):  # no target at all, or none to drop: the rows as they are
        return hidden, targets
    return hidden.index_select(0, rows), targets.index_select(0, rows)


@functools.cache
def _takes_chunk_mem_const(fused_loss: Any) -> bool:
    """Whether Liger's fused loss function takes ``chunk_mem_const`` (0.8.5 does), asked once per function."""
    return "chunk_mem_const" in inspect.signature(fused_loss).parameters


FUSED_LOSS_MIN_CHUNK_ROWS = 1024
"""The fewest rows a chunk of the fused loss takes (all of them where there are fewer). Each chunk's
two products (its logits, and their product with the head for the input gradient) read the whole
head, V·h weights; with fewer rows than about the GPU's FLOPs per byte (≈ 165 on an H200) they wait
on that read instead of computing. Liger sizes its chunks to keep their logits about as large as the
hidden states, which over the target tokens of the benchmark's 7B micro-batch (about 1,120 of
8,192) made 35 chunks of 32 rows: 70 reads of the 1.1 GB head a micro-batch."""


def _liger_chunk_rows(rows: int, vocab: int, hidden: int, mem_const: int) -> int:
    """The rows of each chunk Liger's fused loss (0.8.5) takes over ``rows`` tokens."""
    per_chunk = -(-rows // -(-vocab // (mem_const * hidden)))
    return min(1 << (per_chunk - 1).bit_length(), rows)  # the power of two at or above


def fused_loss_chunk(rows: int, vocab: int, hidden: int) -> tuple[int, int]:
    """(Liger's ``chunk_mem_const``, the rows of each chunk) for the fused loss over ``rows`` tokens:
    Liger's own chunks where they have at least :data:`FUSED_LOSS_MIN_CHUNK_ROWS` rows, else the
    smallest memory constant whose chunks have as many, or all the rows. The memory estimate counts
    the chunk of the whole micro-batch, which is never smaller."""
    want = min(rows, FUSED_LOSS_MIN_CHUNK_ROWS)
    const = 1
    while _liger_chunk_rows(rows, vocab, hidden, const) < want:
        const += 1
    return const, _liger_chunk_rows(rows, vocab, hidden, const)


# --- FP8 base products ----------------------------------------------------------------------------

E4M3_MAX = 448.0
"""The largest finite ``float8_e4m3fn`` value: scales map each row's (or tensor's) absolute maximum to it."""


def fp8_unavailable_reason(device: torch.device | None = None) -> str | None:
    """None when FP8 products run correctly on ``device`` (default: the current CUDA device); else why not."""
    if not torch.cuda.is_available() or (device is not None and device.type != "cuda"):
        return "no CUDA device"
    device = device or torch.device("cuda", torch.cuda.current_device())
    if torch.cuda.get_device_capability(device) < (8, 9):
        name = torch.cuda.get_device_name(device)
        return f"{name} has no FP8 matrix units (compute capability {'.'.join(map(str, torch.cuda.get_device_capability(device)))} < 8.9)"
    return _fp8_self_check(str(device))


@functools.lru_cache(maxsize=4)
def _fp8_self_check(device: str) -> str | None:
    """A frozen 48×64 layer's forward and input gradient in FP8 against float32, with a row count
    (37) that is no multiple of 16, as packed rows and padded batches have."""
    gen = torch.Generator(device=device).manual_seed(0)
    layer = torch.nn.Linear(64, 48, device=device, dtype=torch.bfloat16).requires_grad_(False)
    x = torch.randn(37, 64, device=device, dtype=torch.bfloat16, generator=gen).requires_grad_()
    grad = torch.randn(37, 48, device=device, dtype=torch.bfloat16, generator=gen)
    try:
        out = _Fp8Linear.apply(x, Fp8Weight(layer.weight), layer.bias)
        out.backward(grad)
    except (RuntimeError, TypeError, NotImplementedError) as exc:
        return f"FP8 products failed their self-check ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})"
    ref_x = x.detach().float().requires_grad_()
    ref = F.linear(ref_x, layer.weight.float(), layer.bias.float())
    ref.backward(grad.float())
    err_out = (out.float() - ref).norm() / ref.norm()
    err_grad = (x.grad.float() - ref_x.grad).norm() / ref_x.grad.norm()
    if not (err_out < 0.1 and err_grad < 0.1):  # e4m3 keeps 3 mantissa bits: 2-4% lands here
        return f"FP8 products disagree with float32 ones (relative error {err_out:.1e} forward, {err_grad:.1e} input gradient)"
    return None


class Fp8Weight:
    """A frozen weight (out×in) in e4m3, and its transpose laid out for the backward's product, with
    one scale for the whole tensor (which both share). Made once per device from the bf16 weight;
    transposing the e4m3 copy at every backward instead cost more than FP8 saved (7B's gate
    projection on an H100: 0.49 ms, against a bf16 input-gradient product of 0.74 ms)."""

    def __init__(self, weight: torch.Tensor) -> None:
        with torch.no_grad():
            amax = weight.abs().amax().float().clamp_(min=1e-12)
            self.scale = amax / E4M3_MAX  # dequantization multiplier: weight ≈ data · scale
            self.data = _to_e4m3(weight, self.scale)
            self.data_t = self.data.t().contiguous()
        out_features, in_features = weight.shape
        # _scaled_mm's rowwise mode takes a scale per output column of each product.
        self._scale_out = self.scale.expand(1, out_features).contiguous()
        self._scale_in = self.scale.expand(1, in_features).contiguous()

    @property
    def device(self) -> torch.device:
        return self.data.device

    def product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x·Wᵀ + b`` for ``x`` (rows × in), in x's dtype."""
        xq, x_scale = quantize_rows(x)
        return torch._scaled_mm(xq, self.data.t(), scale_a=x_scale, scale_b=self._scale_out, bias=bias,
                                out_dtype=x.dtype, use_fast_accum=True)

    def input_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """``grad·W`` for ``grad`` (rows × out): the input gradient (the second operand column-major)."""
        gq, g_scale = quantize_rows(grad)
        return torch._scaled_mm(gq, self.data_t.t(), scale_a=g_scale, scale_b=self._scale_in, out_dtype=grad.dtype)


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` (rows × cols) in e4m3 with one float32 scale per row (rows × 1), the dequantization
    multiplier: ``t ≈ q · scale``. One Triton pass per row on GPUs; torch operations elsewhere."""
    t = t.contiguous()
    if t.is_cuda and _triton_rows_kernel() is not None:
        q = torch.empty_like(t, dtype=torch.float8_e4m3fn)
        scale = torch.empty(t.shape[0], 1, device=t.device, dtype=torch.float32)
        if t.shape[0]:
            _triton_rows_kernel()[(t.shape[0],)](t, q, scale, t.shape[1], BLOCK=1024, num_warps=4)
        return q, scale
    amax = torch.linalg.vector_norm(t, ord=float("inf"), dim=1, keepdim=True).float().clamp_(min=1e-12)
    scale = amax / E4M3_MAX
    return _to_e4m3(t, scale), scale


def _to_e4m3(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``t / scale`` in e4m3, saturated (a value past ±448 would become NaN)."""
    return (t.float() / scale).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


@functools.cache
def _triton_rows_kernel() -> Any:
    """The rowwise e4m3 quantization kernel (None without Triton): each program reads its row
    twice, for the absolute maximum and then to scale and cast it, and writes the row's scale."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def _rows_to_e4m3(x_ptr, q_ptr, scale_ptr, cols, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        x_row, q_row = x_ptr + row * cols, q_ptr + row * cols
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, cols, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            v = tl.load(x_row + offs, mask=offs < cols, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(v))
        scale = tl.maximum(tl.max(amax, axis=0), 1e-12) / 448.0
        tl.store(scale_ptr + row, scale)
        for start in range(0, cols, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            v = tl.load(x_row + offs, mask=offs < cols, other=0.0).to(tl.float32) / scale
            v = tl.minimum(tl.maximum(v, -448.0), 448.0)
            tl.store(q_row + offs, v.to(tl.float8e4nv), mask=offs < cols)

    return _rows_to_e4m3


class _Fp8Linear(torch.autograd.Function):
    """A frozen linear layer's ``x·Wᵀ + b`` with both of its products (forward, input gradient) in FP8."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fp8: Fp8Weight, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.fp8 = fp8
        return fp8.product(x, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        return (ctx.fp8.input_grad(grad.contiguous()) if ctx.needs_input_grad[0] else None), None, None


def fp8_weight(layer: torch.nn.Module, flat: torch.Tensor) -> Fp8Weight | None:
    """``layer``'s e4m3 weight for a product with ``flat`` (made on first use on the weight's
    device), or None where the product stays bf16: FP8 not enabled on the layer, a trainable
    weight or bias, or another dtype or device."""
    if not getattr(layer, "zerolab_fp8", False):
        return None
    weight, bias = layer.weight, layer.bias
    if (weight.requires_grad or (bias is not None and bias.requires_grad) or flat.dtype != weight.dtype
            or flat.device != weight.device):
        return None
    cached = layer.__dict__.get("_fp8_weight")
    if cached is None or cached.device != weight.device:
        cached = layer.__dict__["_fp8_weight"] = Fp8Weight(weight)
    return cached


def _fp8_linear_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1])
    fp8 = fp8_weight(self, flat)
    if fp8 is None:
        return F.linear(x, self.weight, self.bias)
    out = _Fp8Linear.apply(flat, fp8, self.bias)
    return out.view(*x.shape[:-1], out.shape[-1])


def fp8_eligible(in_features: int, out_features: int, min_features: int) -> bool:
    """Whether a frozen layer of these sizes takes FP8 products (``_scaled_mm`` needs multiples of 16)."""
    return min(in_features, out_features) >= min_features and in_features % 16 == 0 and out_features % 16 == 0


def fp8_layers(model: torch.nn.Module, min_features: int) -> int:
    """Give every frozen ``nn.Linear`` of ``model`` that is :func:`fp8_eligible` (except the output
    head, whose product the fused loss makes) FP8 products; returns how many. Call after the
    adapter is applied (peft's LoRA layers then call their base layer, which is one of them) and
    ``zerolab.lora_nodes.fuse_lora``. The e4m3 copies are made here, on the weights' device, before the first
    step's activations take memory around them (again on a layer's first forward if its weight
    has moved)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    count = 0
    for module in model.modules():
        if (type(module) is torch.nn.Linear and module is not head and not module.weight.requires_grad
                and fp8_eligible(module.in_features, module.out_features, min_features)):
            module.zerolab_fp8 = True
            module.forward = types.MethodType(_fp8_linear_forward, module)
            module.__dict__["_fp8_weight"] = Fp8Weight(module.weight)
            count += 1
    return count


def use_fp8(model: torch.nn.Module, device: torch.device | None, min_features: int) -> tuple[int, str | None]:
    """FP8 base products on ``model`` where ``device`` runs them: (layers, None), or (0, why not)."""
    reason = fp8_unavailable_reason(device)
    return (0, reason) if reason else (fp8_layers(model, min_features), None)


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


__all__ = ["CU_SEQLENS_KEY", "E4M3_MAX", "VARLEN_ATTENTION", "Fp8Weight", "apply_liger", "compile_layers",
           "fp8_eligible", "fp8_layers", "fp8_weight",
           "fp8_unavailable_reason", "liger_available", "packed_cu_seqlens", "quantize_rows", "resolve_attention", "use_fp8", "use_fused_loss", "use_liger", "varlen_attention_forward", "varlen_unavailable_reason"]
