"""A quantized base's products, at every ZeRO stage: each bitsandbytes layer computes from its
weight as it is at that moment (under ZeRO-3, as DeepSpeed gathers it) and keeps nothing between
its forward and its backward outside autograd's saved tensors.

bitsandbytes' own layers keep the input, and under ZeRO-3 the whole weight beside its partition:

- 4-bit (``Linear4bit`` → ``MatMul4Bit``): the autograd context keeps the weight it multiplied by, a
  view of the gathered buffer, as a plain attribute (``ctx.tensors``), not through
  ``save_for_backward``. Gradient checkpointing cannot drop it and DeepSpeed's release frees only the
  parameter's reference, so every layer's gathered weight stays alive from its forward to its
  backward: by the end of the forward pass the whole quantized model is held again, beside the
  partitions.
- int8 (``Linear8bitLt``): the parameter's ``CB`` attribute is its int8 tensor (the same storage as its
  data when it was quantized), which the first forward moves to ``state.CB`` and multiplies by from
  then on. DeepSpeed's partitioning replaces only the parameter's data, so the whole int8 weight
  stays alive for the run, and the gathered weight is never read.

Here each layer's forward runs bitsandbytes' product (the same kernels) from the gathered weight
with no gradient recorded, inside an autograd function that keeps the *parameter*, not its data;
its backward dequantizes the parameter's data as DeepSpeed gathered it again for the layer's
backward (as DeepSpeed's own ``LinearFunctionForZeroStage3`` does for plain linear layers). The
base weights are frozen: only the input (and a trainable bias) get gradients. Nothing of the input
is kept either. bitsandbytes' products keep their input outside ``save_for_backward`` (``ctx.tensors``),
where gradient checkpointing cannot drop it, and LLM.int8()'s also a copy of the input's outlier
columns (``subA``, every column with a value of at least the threshold), which only a trainable
weight's gradient reads: with a frozen int8 base that copy was held from every product's forward
to its backward for nothing (0.5B at two 4k rows without checkpointing: 1.8 GiB, all of down's
columns in a random-init 7B or 14B).

The LoRA layers on a quantized base take these products through the fused LoRA node
(``zerolab.lora_nodes.fuse_lora``: :class:`QuantizedProduct`), the other quantized layers through
:func:`keep_nothing_between_products`."""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

import bitsandbytes as bnb
import torch
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

from zerolab.quantization import quantized_layers


def keep_nothing_between_products(model: torch.nn.Module) -> int:
    """Make every bitsandbytes layer of ``model`` compute from its weight as it is at each call
    (under ZeRO-3, as DeepSpeed gathers it) and hold nothing of the weight or the input between
    products; returns how many layers changed. Call before ``deepspeed.initialize``: an int8 layer's
    cached copy of its weight is dropped here, so ZeRO-3's partitioning frees the whole tensor. The
    products and their input gradients equal bitsandbytes' own (``tests/test_quantization.py``)."""
    layers = quantized_layers(model)
    for layer in layers.values():
        if isinstance(layer, bnb.nn.Linear8bitLt):
            weight = layer.weight
            if weight.SCB is None:  # a forward already moved the row scales to the layer's state
                weight.SCB = layer.state.SCB
            weight.CB = None
            layer.state.reset_grads()  # state.CB and state.SCB: the whole weight and its scales
        layer.forward = types.MethodType(_forward, layer)
    return len(layers)


def _forward(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The layer's forward (bitsandbytes' ``Linear4bit.forward`` / ``Linear8bitLt.forward``) through
    :class:`_GatheredProduct`. A bias is cast, not converted in place: it may be a ZeRO-3 partition."""
    if isinstance(layer, bnb.nn.Linear4bit):
        if not layer.compute_type_is_set:
            layer.set_compute_type(x)
            layer.compute_type_is_set = True
        input_dtype = x.dtype
        if layer.compute_dtype is not None:
            x = x.to(layer.compute_dtype)
        bias = None if layer.bias is None else layer.bias.to(x.dtype)
        return _GatheredProduct.apply(x, bias, layer).to(input_dtype)
    bias = None if layer.bias is None else layer.bias.to(x.dtype)
    return _GatheredProduct.apply(x, bias, layer)


class _GatheredProduct(torch.autograd.Function):
    """``x·Wᵀ + b`` for a bitsandbytes layer's frozen weight ``W``. The context keeps the layer (its
    parameter), not the weight's data."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, bias: torch.Tensor | None, layer: torch.nn.Module) -> torch.Tensor:
        ctx.layer = layer
        return _product(layer, x, bias)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        grad_input = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_input = _input_grad(ctx.layer, grad_output)
        if ctx.needs_input_grad[1]:
            grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(0)
        return grad_input, grad_bias, None


class QuantizedProduct:
    """A quantized layer's frozen product as the fused LoRA node takes it (``zerolab.lora_nodes.fuse_lora``:
    the base product, the adapter's products and their sum as one autograd node): bitsandbytes'
    kernel in the forward, the dequantized weight for the input gradient, the layer kept rather than
    its weight (so also under ZeRO-3 with leaf layers)."""

    def __init__(self, layer: torch.nn.Module) -> None:
        self.layer = layer

    def product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x·Wᵀ + b`` in x's dtype (the layer's compute dtype), recording no gradient."""
        return _product(self.layer, x, None if bias is None else bias.to(x.dtype))

    def input_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """``grad·W``."""
        return _input_grad(self.layer, grad)


def _input_grad(layer: torch.nn.Module, grad_output: torch.Tensor) -> torch.Tensor:
    """The product's input gradient, ``grad·W``, from the weight dequantized as bitsandbytes' backward does."""
    with _whole(layer.weight):
        dense = _dequantized(layer, grad_output.dtype)
    return torch.matmul(grad_output, dense)


def _product(layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """bitsandbytes' product, run where no gradient is recorded (inside an autograd function's
    forward), so that nothing of it is kept: 4-bit, the kernel ``MatMul4Bit`` calls; int8, LLM.int8()'s
    product (``MatMul8bitLt``; on CPU in training ``MatMul8bitFp``) from a state that names the gathered
    weight for this call only."""
    weight = layer.weight
    if isinstance(layer, bnb.nn.Linear4bit):
        return bnb.matmul_4bit(x, weight, quant_state=weight.quant_state, bias=bias)
    state = bnb.MatmulLtState()
    state.CB, state.SCB = weight.data, weight.SCB
    state.threshold = layer.state.threshold
    state.has_fp16_weights = False
    state.is_training = layer.training
    return bnb.matmul(x, state.CB, bias=bias, state=state)


def _dequantized(layer: torch.nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """The weight the layer multiplies by, ``out × in`` in ``dtype``, as bitsandbytes' backward
    makes it: 4-bit, the code book's values times their block's absmax; int8, the rows times their
    scale / 127."""
    weight = layer.weight
    if isinstance(layer, bnb.nn.Linear4bit):
        return bnb.functional.dequantize_4bit(weight.data.view(-1, 1), weight.quant_state).to(dtype)
    return weight.data.to(dtype, copy=True).mul_(weight.SCB.unsqueeze(1).mul(1.0 / 127.0))


@contextlib.contextmanager
def _whole(param: torch.nn.Parameter) -> Iterator[None]:
    """The parameter's whole data for the duration of the block. DeepSpeed's hooks gather a layer's
    parameters before its backward runs, so under ZeRO-3 they are normally there; one found released
    is gathered here and partitioned again after, as DeepSpeed's ``LinearFunctionForZeroStage3`` does
    for plain linear layers."""
    status = getattr(param, "ds_status", None)
    if status is None or status == ZeroParamStatus.AVAILABLE:
        yield
        return
    # DeepSpeed's pre-backward hook waits for a gather in flight before the layer's backward runs.
    assert status == ZeroParamStatus.NOT_AVAILABLE, f"a quantized weight read while DeepSpeed gathers it: {param.ds_summary()}"
    param.all_gather()
    try:
        yield
    finally:
        param.partition()
