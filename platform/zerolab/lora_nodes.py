"""LoRA's products as autograd nodes of zerolab's own (``model.kernels`` not ``none``), each falling
back to peft's forward where it does not apply.

- The LoRA layer, ``base(x) + scale·B(A(x))`` (:func:`fuse_lora`). peft runs B's product, a scale
  and an add: three passes over the B·S×out output in the forward and one more in the backward,
  for every wrapped projection (about a thousand small kernels per step of a 7B model). Here
  ``addmm_`` sums the two products in a product's own epilogue. Without dropout the layer is one
  autograd node: the adapter's 16-wide product is written first and the compute-bound base product
  accumulates onto it, in the forward and for the input gradient (7B at two 4k rows: +3% over the
  adapter's product accumulating into the base output, which read and wrote the whole output once
  more), instead of autograd adding the two. Plain LoRA (rsLoRA too) with one active adapter, on any
  device, at any ZeRO stage (ZeRO-3 with leaf layers: its per-module hooks would gather a weight
  only around its own module's call); other layers keep peft's forward, and a compiled layer gets
  the same products without the one-node backward (Inductor fuses its own). On a quantized base
  (4-bit or int8) the node runs bitsandbytes' product and dequantizes the weight for its backward
  as bitsandbytes does, keeping nothing of the product beside its saved input, where peft's layer
  is six autograd nodes (bitsandbytes' product, a defensive copy of its output, A's and B's
  products, the scale and the sum), each a round of host work in a QLoRA step that the host
  already bounds (7B at one checkpointed 4k row: the GPU busy 380 of 612 ms). With FP8 base
  products (``zerolab.kernels.fp8_layers``) the node multiplies by the layer's e4m3 copy.
- Sibling projections that read one input — Q/K/V, gate/up — as one node (:func:`fuse_shared_inputs`):
  one product of the input with all their A matrices, one of their stacked adapter gradients with
  it for every A's gradient, and their input gradients summed in place in one buffer, where each
  projection's node made its own and autograd summed them (6 fewer products per attention, 3 per
  MLP, and the sums: 2·B·S×h per attention, B·S×h per MLP, each a read and write of the input
  gradient).
- SwiGLU with down's LoRA as one node (:func:`fuse_swiglu_down`). Down's adapter reads its input
  SiLU(gate)·up for its gradient, so the LoRA node kept that B·S×I tensor beside the gate and up
  outputs SwiGLU keeps; this node keeps gate and up only and recomputes the product in its
  backward, in the pass that takes SwiGLU's gradient (a Triton kernel on GPUs; 7B at two 4k rows:
  8 GiB less, the same speed).

``tests/test_kernels.py`` checks both against peft's forward, on CPU and on CUDA.
"""

from __future__ import annotations

import functools
import types
from typing import Any

import torch
import torch.nn.functional as F

from zerolab.kernels import fp8_weight


def fuse_lora(model: torch.nn.Module) -> int:
    """Give every plain peft LoRA ``Linear`` of ``model``, and every LoRA layer on a quantized
    (4-bit or int8) base, the fused forward; returns how many. Call after the adapter is applied;
    under ZeRO-3 without leaf layers they keep taking peft's forward."""
    from peft.tuners.lora.layer import Linear

    quantized_types = _quantized_lora_types()
    count = 0
    for module in model.modules():
        if type(module) is Linear:  # not its subclasses (AdaLoRA's SVD layers)
            module.forward = types.MethodType(_lora_addmm_forward, module)
            count += 1
        elif type(module) in quantized_types:
            from zerolab.quantized_products import QuantizedProduct  # bitsandbytes is an optional extra

            module.zerolab_base_product = QuantizedProduct(module.base_layer)
            module.forward = types.MethodType(_lora_addmm_forward, module)
            count += 1
    return count


def _quantized_lora_types() -> tuple[type, ...]:
    """peft's LoRA layers on bitsandbytes' 4-bit and int8 bases (none where this process has not
    loaded bitsandbytes: no layer can be one of them)."""
    from zerolab import lean_imports

    if not lean_imports.loaded(lean_imports.BITSANDBYTES):
        return ()
    from peft.tuners.lora import bnb as peft_bnb

    return tuple(t for t in (getattr(peft_bnb, "Linear4bit", None), getattr(peft_bnb, "Linear8bitLt", None)) if t is not None)


def _lora_addmm_forward(self: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """peft's LoRA forward, ``base(x) + scale·B(A(dropout(x)))``, with the scaled product of B
    accumulated in place into the base layer's output by one ``addmm_`` (the base layer's
    backward needs its input and weight, never its output, so the in-place update is safe for
    autograd). Anything else — adapters disabled or merged, several active adapters, DoRA and
    other variants, a bias on B, mixed dtypes, ZeRO-3 weights gathered module by module — takes
    peft's own forward.

    On a quantized base (``zerolab_base_product``, set by :func:`fuse_lora`) the whole layer is one
    autograd node or peft's forward: peft's adds a copy of the base product's output (a
    defensive clone) to the scale and the add, and bitsandbytes' product is a node of its own,
    which keeps its input outside autograd's saved tensors (LLM.int8()'s also a copy of the
    input's outlier columns, ``zerolab.quantized_products``)."""
    siblings = self.__dict__.get("zerolab_siblings")
    if siblings is not None and not args and not kwargs:
        out = siblings.output(self, x)
        if out is not None:
            return out
    if not _takes_fused_forward(self, x, args, kwargs):
        return type(self).forward(self, x, *args, **kwargs)
    flat = x.reshape(-1, x.shape[-1])
    operands = _one_node_operands(self, flat)
    name = self.active_adapters[0]
    if operands is not None:
        out = _LoRALinear.apply(flat, *operands)
    elif "zerolab_base_product" in self.__dict__:
        return type(self).forward(self, x, *args, **kwargs)
    else:
        out = self.base_layer(flat)
        out.addmm_(self.lora_A[name](self.lora_dropout[name](flat)), self.lora_B[name].weight.t(), alpha=self.scaling[name])
    return out.view(*x.shape[:-1], out.shape[-1])


def _takes_fused_forward(self: Any, x: torch.Tensor, args: tuple = (), kwargs: dict | None = None) -> bool:
    """Whether a LoRA layer given :func:`_lora_addmm_forward` computes ``x`` through it rather than
    peft's forward: one active plain LoRA adapter, merged into nothing, without a bias on B, every
    weight whole when the products read it, one dtype throughout."""
    names = self.active_adapters
    name = names[0] if len(names) == 1 else None
    if name not in self.lora_A or args or kwargs or self.disable_adapters or self.merged or name in self.lora_variant:
        return False
    a_layer, b_layer, base = self.lora_A[name], self.lora_B[name], self.base_layer
    # A 4-bit product computes in the layer's compute dtype; LLM.int8()'s returns its input's.
    base_dtype = getattr(base, "compute_dtype", x.dtype) if "zerolab_base_product" in self.__dict__ else base.weight.dtype
    return (b_layer.bias is None and _gathered_with_layer(base.weight, a_layer.weight, b_layer.weight)
            and x.dtype == a_layer.weight.dtype == b_layer.weight.dtype == base_dtype)


def _one_node_operands(self: Any, flat: torch.Tensor) -> tuple | None:
    """For a layer that :func:`_takes_fused_forward`, the operands of :class:`_LoRALinear` after the
    input — (weight, bias, A, B, scale, frozen product) — where the layer is one autograd node: no
    dropout, the base frozen, not inside a compiled graph (Inductor derives and fuses the plain
    products' backward itself, and Dynamo on torch 2.11 failed to trace the autograd.Function on
    CUDA: the adapters then got no gradient at all). None otherwise."""
    name = self.active_adapters[0]
    base = self.base_layer
    if (torch.compiler.is_compiling() or not isinstance(self.lora_dropout[name], torch.nn.Identity) or base.weight.requires_grad
            or (base.bias is not None and base.bias.requires_grad)):
        return None
    quantized = self.__dict__.get("zerolab_base_product")
    weight, frozen = (None, quantized) if quantized is not None else (base.weight, fp8_weight(base, flat))
    return weight, base.bias, self.lora_A[name].weight, self.lora_B[name].weight, self.scaling[name], frozen


def _gathered_with_layer(*weights: torch.Tensor) -> bool:
    """Whether the weights are whole for the forward and, again, for the backward of a product that
    reads them directly: not ZeRO-3 partitioned, or partitioned within a ZeRO-3 leaf module (the
    decoder layer, ``deepspeed.z3_leaf_layers``), which DeepSpeed gathers as a whole before the
    layer's forward and before its backward. Without leaf layers it gathers each module's weights
    around that module's own call, which a product reading ``base.weight`` never makes."""
    return all(not hasattr(w, "ds_id") or hasattr(w, "ds_z3_leaf_module") for w in weights)


class _LoRALinear(torch.autograd.Function):
    """``x·Wᵀ + b + s·(x·Aᵀ)·Bᵀ`` for a frozen ``W`` (no dropout) as one autograd node, its two
    products summed in a product's epilogue (:func:`_lora_product`, :func:`_lora_input_grad`) where
    peft's forward adds them in a separate pass over the B·S×out output and autograd adds their
    input gradients in one over the B·S×in tensor, once per wrapped projection. ``frozen``, where the
    base product is not ``x·Wᵀ`` with a plain weight: its e4m3 copy (:class:`Fp8Weight`) or a
    quantized base's product (``zerolab.quantized_products.QuantizedProduct``, ``weight`` None);
    either gives ``product(x, bias)`` and ``input_grad(grad)``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, lora_a: torch.Tensor,
                lora_b: torch.Tensor, scale: float, frozen: Any = None) -> torch.Tensor:
        out, hs = _lora_product(x, weight, bias, lora_a, lora_b, scale, frozen)
        ctx.save_for_backward(x, weight, lora_a, lora_b, hs)
        ctx.scale, ctx.frozen = scale, frozen
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, lora_a, lora_b, hs = ctx.saved_tensors
        grad_h = (grad @ lora_b).mul_(ctx.scale)
        grad_x = _lora_input_grad(grad, weight, grad_h, lora_a, ctx.frozen) if ctx.needs_input_grad[0] else None
        grad_a = grad_h.t() @ x if ctx.needs_input_grad[3] else None
        grad_b = grad.t() @ hs if ctx.needs_input_grad[4] else None
        return grad_x, None, None, grad_a, grad_b, None, None


def _lora_product(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, lora_a: torch.Tensor,
                  lora_b: torch.Tensor, scale: float, frozen: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``x·Wᵀ + b + s·(x·Aᵀ)·Bᵀ`` and the scaled adapter activation ``s·x·Aᵀ`` (B·S×r, which B's
    gradient reads). With a plain weight the adapter's product comes first and the base product
    accumulates onto it (``addmm_``, beta 1): the base product is compute-bound and reads the
    adapter's output in its epilogue at little cost, where the adapter's 16-wide product
    accumulating into the base output read and wrote the whole B·S×out tensor."""
    hs = (x @ lora_a.t()).mul_(scale)
    return _base_plus_adapter(x, weight, bias, hs, lora_b, frozen), hs


def _base_plus_adapter(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, hs: torch.Tensor,
                       lora_b: torch.Tensor, frozen: Any) -> torch.Tensor:
    """``x·Wᵀ + b + hs·Bᵀ`` for the scaled adapter activation ``hs``, the two products summed in one's epilogue."""
    if frozen is not None:
        return frozen.product(x, bias).addmm_(hs, lora_b.t())
    out = hs @ lora_b.t() if bias is None else torch.addmm(bias, hs, lora_b.t())
    return out.addmm_(x, weight.t())


def _lora_input_grad(grad: torch.Tensor, weight: torch.Tensor | None, grad_h: torch.Tensor, lora_a: torch.Tensor,
                     frozen: Any) -> torch.Tensor:
    """``grad·W + grad_h·A``, the input gradient of :func:`_lora_product` (``grad_h`` = s·grad·B), the
    two summed as there: onto the adapter's share by the base product's epilogue."""
    if frozen is not None:
        return frozen.input_grad(grad).addmm_(grad_h, lora_a)
    return (grad_h @ lora_a).addmm_(grad, weight)


SHARED_INPUT_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Projections of one module that read the same input: attention's Q/K/V, the MLP's gate and up."""


def fuse_shared_inputs(model: torch.nn.Module) -> int:
    """Make the plain LoRA layers without dropout of each module's :data:`SHARED_INPUT_GROUPS` that
    take the fused forward (two or more of a group) siblings: the first of them called computes all
    of their outputs as one autograd node (:class:`_SharedInputLoRA`) and keeps the others' for
    their own calls with the same input; returns how many groups. Call after :func:`fuse_lora`.
    7B at two packed 4k rows on one H200: +2.1% (docs/benchmark.md).

    The module's forward is not changed: Hugging Face's attention calls ``q_proj``, ``k_proj`` and
    ``v_proj`` on one tensor, the MLP ``gate_proj`` and ``up_proj``, in whatever order. Kept outputs
    go only to a sibling called with the very tensor they were computed from, unchanged since, and
    are dropped when the module's forward ends or fails. Where a module feeds its siblings different
    tensors, each sibling computes its own output for the rest of that forward; so does every sibling
    where the node does not apply (see :meth:`_Siblings.output`), taking the one-layer node or peft's
    forward as before."""
    count = 0
    for module in model.modules():
        for names in SHARED_INPUT_GROUPS:
            layers = [getattr(module, name, None) for name in names]
            layers = [layer for layer in layers if getattr(getattr(layer, "forward", None), "__func__", None) is _lora_addmm_forward
                      and _plain_lora_without_dropout(layer)]
            if len(layers) > 1:
                siblings = _Siblings(layers)
                for layer in layers:
                    layer.__dict__["zerolab_siblings"] = siblings  # not a submodule: no state of its own
                module.register_forward_hook(siblings.reset, always_call=True)
                count += 1
    return count


class _Siblings:
    """LoRA layers that read one input (:func:`fuse_shared_inputs`) and, within one forward of their
    module, the outputs computed for those of them not yet called: ``(input, its version, {layer:
    output})``, or :data:`_APART` once the module has fed them different tensors."""

    def __init__(self, layers: list[Any]) -> None:
        self.layers = layers
        self.kept: tuple[torch.Tensor, int, dict[Any, torch.Tensor]] | object | None = None

    def reset(self, *_: Any) -> None:
        """Drop what is kept (a forward hook of the siblings' module: after each of its forwards)."""
        self.kept = None

    def output(self, layer: Any, x: torch.Tensor) -> torch.Tensor | None:
        """``layer``'s output for ``x``: kept from a sibling's call with this very tensor, or computed
        with all the siblings' in one node; None where that node does not apply (inside a compiled
        graph, any sibling that would not be a one-layer node, adapter scales that differ) or where
        the siblings of this forward read different tensors."""
        kept = self.kept
        if kept is _APART:
            return None
        if kept is not None:
            if kept[0] is x and kept[1] == _version(x) and layer in kept[2]:
                out = kept[2].pop(layer)
                if not kept[2]:
                    self.kept = None
                return out
            self.kept = _APART
            return None
        flat = x.reshape(-1, x.shape[-1])
        operands = []
        for sibling in self.layers:
            ops = _one_node_operands(sibling, flat) if _takes_fused_forward(sibling, x) else None
            if ops is None or (operands and ops[4] != operands[0][4]):
                return None
            operands.append(ops)
        scale = operands[0][4]
        flat_operands = [t for weight, bias, a, b, _, frozen in operands for t in (weight, bias, a, b, frozen)]
        outs = _SharedInputLoRA.apply(flat, scale, *flat_operands)
        outputs = {sibling: out.view(*x.shape[:-1], out.shape[-1]) for sibling, out in zip(self.layers, outs)}
        out = outputs.pop(layer)
        self.kept = (x, _version(x), outputs)
        return out


def _version(t: torch.Tensor) -> int:
    """``t``'s version counter (how many in-place changes it has had); an inference tensor has none."""
    return -1 if t.is_inference() else t._version


_APART = object()
"""What :class:`_Siblings` keeps once its module has fed the siblings different tensors in one forward."""


class _SharedInputLoRA(torch.autograd.Function):
    """``x·Wᵢᵀ + bᵢ + s·(x·Aᵢᵀ)·Bᵢᵀ`` for the frozen ``Wᵢ`` of sibling layers that read ``x`` (no
    dropout, one scale ``s``) as one autograd node: one product of ``x`` with every ``Aᵢ`` stacked, and
    in the backward one of the stacked adapter gradients with ``x`` (every ``Aᵢ``'s gradient, a row
    block of it) and one with the stacked ``Aᵢ`` that starts the input gradient, onto which each
    base product's input gradient accumulates in place. ``operands``: ``(W, b, A, B, frozen)`` per
    layer, as :class:`_LoRALinear` takes them."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float, *operands: Any) -> tuple[torch.Tensor, ...]:
        layers = [operands[i:i + 5] for i in range(0, len(operands), 5)]
        a_all = torch.cat([a for _, _, a, _, _ in layers])
        hs_all = (x @ a_all.t()).mul_(scale)
        outs, start = [], 0
        for weight, bias, a, b, frozen in layers:
            outs.append(_base_plus_adapter(x, weight, bias, hs_all[:, start:start + a.shape[0]], b, frozen))
            start += a.shape[0]
        ctx.save_for_backward(x, a_all, hs_all, *[t for weight, _, _, b, _ in layers for t in (weight, b)])
        ctx.scale, ctx.frozen, ctx.ranks = scale, [frozen for *_, frozen in layers], [a.shape[0] for _, _, a, _, _ in layers]
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, a_all, hs_all, *weights_and_bs = ctx.saved_tensors
        weights, bs = weights_and_bs[0::2], weights_and_bs[1::2]
        grad_h_all = torch.cat([g @ b for g, b in zip(grads, bs)], dim=1).mul_(ctx.scale)
        grad_x = None
        if ctx.needs_input_grad[0]:
            for g, frozen in zip(grads, ctx.frozen):
                if frozen is not None:
                    grad_x = frozen.input_grad(g) if grad_x is None else grad_x.add_(frozen.input_grad(g))
            grad_x = grad_h_all @ a_all if grad_x is None else grad_x.addmm_(grad_h_all, a_all)
            for g, weight, frozen in zip(grads, weights, ctx.frozen):
                if frozen is None:
                    grad_x.addmm_(g, weight)
        grad_a_all = grad_h_all.t() @ x if any(ctx.needs_input_grad[4::5]) else None
        result: list[torch.Tensor | None] = [grad_x, None]
        start = 0
        for i, (g, rank) in enumerate(zip(grads, ctx.ranks)):
            grad_a = grad_a_all[start:start + rank] if ctx.needs_input_grad[4 + 5 * i] else None
            grad_b = g.t() @ hs_all[:, start:start + rank] if ctx.needs_input_grad[5 + 5 * i] else None
            result += [None, None, grad_a, grad_b, None]
            start += rank
        return tuple(result)


def fuse_swiglu_down(model: torch.nn.Module) -> int:
    """Give every SwiGLU MLP of ``model`` (``down(SiLU(gate(x))·up(x))``: Hugging Face's, or Liger's
    forward on it) whose down projection takes the fused LoRA forward one autograd node for SiLU(gate)·up
    and down's product (:class:`_SwiGLULoRADown`); returns how many. Call after :func:`fuse_lora`.

    Down's adapter needs its input, SiLU(gate)·up (B·S×I), for its gradient, so the fused LoRA node
    kept it beside the gate and up outputs that SwiGLU's backward keeps: e·I bytes per token and
    layer, a sixth of a 7B layer's activations (8.1 GiB at two 4k rows). The node keeps the gate and
    up outputs only and recomputes the product in its backward, in the same pass that takes SwiGLU's
    gradient (one Triton kernel on GPUs, writing the gate and up gradients in place of their
    outputs, as Liger's does). Elsewhere the MLP keeps its forward: another activation, adapter
    dropout, DoRA, a compiled layer."""
    count = 0
    for module in model.modules():
        down = getattr(module, "down_proj", None)
        if (hasattr(module, "gate_proj") and hasattr(module, "up_proj") and down is not None
                and getattr(getattr(module, "config", None), "hidden_act", None) in ("silu", "swish")
                and getattr(down.forward, "__func__", None) is _lora_addmm_forward and _plain_lora_without_dropout(down)):
            module.__dict__["zerolab_mlp_forward"] = module.forward
            module.forward = types.MethodType(_swiglu_down_forward, module)
            count += 1
    return count


def _plain_lora_without_dropout(layer: Any) -> bool:
    """Whether ``layer``'s one active adapter is plain LoRA (no variant such as DoRA) without dropout."""
    names = layer.active_adapters
    return (len(names) == 1 and names[0] in layer.lora_A and names[0] not in layer.lora_variant
            and isinstance(layer.lora_dropout[names[0]], torch.nn.Identity))


def fuses_swiglu_down(cfg: Any, stage: int, down_targeted: bool) -> bool:
    """Whether a job's MLPs take :func:`fuse_swiglu_down`'s node (what the memory estimate needs to
    know): zerolab's kernels on (``model.kernels`` not ``none``), plain LoRA or rsLoRA without
    dropout on the down projection, layers not compiled, and under ZeRO-3 leaf decoder layers."""
    return (cfg.model.kernels != "none" and cfg.adapter.method in ("lora", "rslora") and cfg.adapter.dropout == 0
            and down_targeted and not cfg.model.compile and (stage < 3 or cfg.deepspeed.z3_leaf_layers))


def _swiglu_down_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """The MLP's forward through :class:`_SwiGLULoRADown` where down's LoRA layer would be one node
    (:func:`_takes_fused_forward`, :func:`_one_node_operands`); the MLP's own forward otherwise."""
    down = self.down_proj
    flat = x.reshape(-1, x.shape[-1])
    operands = _one_node_operands(down, flat) if _takes_fused_forward(down, x) else None
    if operands is None:
        return self.__dict__["zerolab_mlp_forward"](x)
    out = _SwiGLULoRADown.apply(self.gate_proj(flat), self.up_proj(flat), *operands)
    return out.view(*x.shape[:-1], out.shape[-1])


class _SwiGLULoRADown(torch.autograd.Function):
    """``a·Wᵀ + b + s·(a·Aᵀ)·Bᵀ`` with ``a = SiLU(gate)·up`` for a frozen ``W`` as one autograd node
    that keeps ``gate`` and ``up``, not ``a`` (see :func:`fuse_swiglu_down`); the rest as
    :class:`_LoRALinear`. The backward overwrites the saved gate and up outputs with their gradients."""

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float, frozen: Any = None) -> torch.Tensor:
        out, hs = _lora_product(swiglu(gate, up), weight, bias, lora_a, lora_b, scale, frozen)
        ctx.save_for_backward(gate, up, weight, lora_a, lora_b, hs)
        ctx.scale, ctx.frozen = scale, frozen
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        gate, up, weight, lora_a, lora_b, hs = ctx.saved_tensors
        grad = grad.contiguous()
        grad_h = (grad @ lora_b).mul_(ctx.scale)
        grad_act = _lora_input_grad(grad, weight, grad_h, lora_a, ctx.frozen)
        grad_b = grad.t() @ hs if ctx.needs_input_grad[5] else None
        act = swiglu_backward_(gate, up, grad_act)  # gate, up ← their gradients; grad_act ← SiLU(gate)·up
        grad_a = grad_h.t() @ act if ctx.needs_input_grad[4] else None
        return gate, up, None, None, grad_a, grad_b, None, None


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate)·up as Hugging Face's and Liger's SwiGLU compute it: SiLU in float32, rounded to
    the inputs' dtype, times ``up``. One Triton pass on GPUs."""
    if gate.is_cuda and _triton_swiglu_kernels() is not None:
        gate, up = gate.contiguous(), up.contiguous()
        out = torch.empty_like(gate)
        n = gate.numel()
        _triton_swiglu_kernels()[0][(_blocks(n),)](gate, up, out, n, BLOCK=_BLOCK)
        return out
    return F.silu(gate) * up


def swiglu_backward_(gate: torch.Tensor, up: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """SwiGLU's backward for ``grad``, the gradient of SiLU(gate)·up, in place and in one pass:
    ``gate`` and ``up`` become their gradients (as in Liger's kernel, float32 inside) and ``grad``
    becomes SiLU(gate)·up, recomputed as :func:`swiglu` does; returns ``grad``. Triton on GPUs."""
    if (gate.is_cuda and _triton_swiglu_kernels() is not None and gate.is_contiguous() and up.is_contiguous()
            and grad.is_contiguous()):
        n = gate.numel()
        _triton_swiglu_kernels()[1][(_blocks(n),)](gate, up, grad, n, BLOCK=_BLOCK)
        return grad
    g = gate.float()
    sig = torch.sigmoid(g)
    silu = g * sig
    act = silu.to(up.dtype) * up
    d_up = grad * silu
    d_gate = grad * (silu * (1 - sig) + sig) * up
    gate.copy_(d_gate)
    up.copy_(d_up)
    return grad.copy_(act)


_BLOCK = 1024
"""Elements per program of the SwiGLU kernels."""


def _blocks(n: int) -> int:
    return -(-n // _BLOCK)


@functools.cache
def _triton_swiglu_kernels() -> Any:
    """(forward, in-place backward) Triton kernels of SwiGLU over flat element ranges; None without Triton."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def _swiglu_forward_kernel(gate_ptr, up_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(up_ptr + offs, mask=mask, other=0.0)
        tl.store(out_ptr + offs, (g * tl.sigmoid(g)).cast(u.dtype) * u, mask=mask)

    @triton.jit
    def _swiglu_backward_kernel(gate_ptr, up_ptr, grad_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        dy = tl.load(grad_ptr + offs, mask=mask, other=0.0)
        g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(up_ptr + offs, mask=mask, other=0.0)
        sig = tl.sigmoid(g)
        silu = g * sig
        tl.store(grad_ptr + offs, silu.cast(u.dtype) * u, mask=mask)
        tl.store(up_ptr + offs, dy * silu, mask=mask)
        tl.store(gate_ptr + offs, dy * (silu * (1 - sig) + sig) * u, mask=mask)

    return _swiglu_forward_kernel, _swiglu_backward_kernel


__all__ = ["SHARED_INPUT_GROUPS", "fuse_lora", "fuse_shared_inputs", "fuse_swiglu_down", "fuses_swiglu_down", "swiglu", "swiglu_backward_"]
