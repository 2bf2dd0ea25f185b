"""Quantized bases (``model.quantization``): how a frozen base is loaded through bitsandbytes for
QLoRA, what its weights cost, and how export turns it back into plain weights.

A 4-bit base (``nf4``, ``fp4``) packs two weights per byte in blocks of 64 with one absmax constant
each; ``nf4`` quantizes those constants again to 8 bits in blocks of 256 (double quantization, as the
QLoRA paper does). The packed bytes are stored in the training dtype (``bnb_4bit_quant_storage``),
so DeepSpeed's ZeRO-3 partitions and gathers them like any other weight; the quantization state
(absmax, code book, shape) stays on the parameter object, which ZeRO-3 keeps. ``int8`` is
LLM.int8(): int8 rows with one float scale per output row; ZeRO-3 partitions the int8 tensor and
gathers it back whole, the scales staying on the parameter object.

Only the decoder layers' linear layers are quantized: transformers keeps the embeddings and the
output head (``lm_head``) in the training dtype, and norms have no linear weights. The trainable
adapter sits beside each quantized layer in the training dtype. Nothing here calls peft's
``prepare_model_for_kbit_training``, which upcasts every non-int8 tensor to fp32 — the packed 4-bit
storage included, when it is stored as bf16."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any

from zerolab.errors import EnvironmentProblem

if TYPE_CHECKING:  # the memory estimator reads this module's figures without importing torch
    import torch

FOUR_BIT = ("nf4", "fp4")
BLOCK_SIZE = 64
"""Weights per absmax constant of bitsandbytes' 4-bit formats."""
NESTED_BLOCK_SIZE = 256
"""Absmax constants per fp32 constant under double quantization."""


def bytes_per_weight(quantization: str) -> float:
    """Bytes one weight of a quantized linear layer takes on the device, its constants included:
    4-bit: half a byte + the absmax (1 byte per block of 64 with double quantization, else 4) + the
    double quantization's fp32 constant per 256 blocks; int8: one byte (the per-row scales are
    counted by :func:`bytes_per_row`)."""
    if quantization in FOUR_BIT:
        absmax = 1 / BLOCK_SIZE + 4 / (BLOCK_SIZE * NESTED_BLOCK_SIZE) if quantization == "nf4" else 4 / BLOCK_SIZE
        return 0.5 + absmax
    if quantization == "int8":
        return 1.0
    raise ValueError(f"not a quantized format: {quantization!r}")


def bytes_per_row(quantization: str) -> float:
    """Bytes per output row beside the weights: LLM.int8()'s fp32 row scale; none for 4-bit."""
    return 4.0 if quantization == "int8" else 0.0


def check_available(quantization: str) -> None:
    """Refuse a quantized base where bitsandbytes is not installed (before anything loads)."""
    if quantization != "none" and importlib.util.find_spec("bitsandbytes") is None:
        raise EnvironmentProblem(
            f"model.quantization={quantization} loads the base through bitsandbytes, which is not installed here; "
            "install zerolab's quantization extra (pip install -e '.[quantization]', or pip install bitsandbytes), "
            "or set model.quantization=none.")


def bnb_config(quantization: str, dtype: torch.dtype) -> Any:
    """transformers' ``BitsAndBytesConfig`` for ``quantization`` with ``dtype`` the compute (and, for
    4-bit, the storage) dtype; None for ``none``."""
    if quantization == "none":
        return None
    from transformers import BitsAndBytesConfig

    if quantization == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=quantization,
        bnb_4bit_use_double_quant=quantization == "nf4",
        bnb_4bit_compute_dtype=dtype,
        bnb_4bit_quant_storage=dtype,
    )


def keep_training_layout(model: torch.nn.Module) -> None:
    """Keep every 4-bit weight in the layout it was quantized to. On a CPU with AVX-512 bf16,
    bitsandbytes repacks a 4-bit weight for its CPU kernel at the first forward in eval mode (an
    evaluation pass during training): the tensor changes dtype and shape in place, which ZeRO-3's
    partitions and the run's equality of frozen weights do not survive."""
    for layer in quantized_layers(model).values():
        if hasattr(layer, "support_avx512bf16_for_cpu"):
            layer.support_avx512bf16_for_cpu = False


def quantized_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The model's bitsandbytes linear layers by qualified name."""
    if importlib.util.find_spec("bitsandbytes") is None:
        return {}
    import bitsandbytes as bnb

    return {name: m for name, m in model.named_modules() if isinstance(m, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt))}


def dequantize(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Replace every bitsandbytes linear layer of ``model`` by a plain ``nn.Linear`` in ``dtype``
    holding the weights the quantized layer computes with (4-bit: the code book's values times
    their block's absmax; int8: the int8 rows times their row scale / 127), so that an adapter
    trained on the quantized base merges into exactly the weights it was trained against.
    Returns how many layers were replaced."""
    import bitsandbytes as bnb
    import torch

    layers = quantized_layers(model)
    for name, layer in layers.items():
        weight = layer.weight
        if isinstance(layer, bnb.nn.Linear4bit):
            plain_weight = bnb.functional.dequantize_4bit(weight.data, weight.quant_state)
        else:
            scales = weight.SCB if weight.SCB is not None else layer.state.SCB
            plain_weight = weight.data.float() * (scales.float().unsqueeze(1) / 127)
        plain = torch.nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None,
                                device=plain_weight.device, dtype=dtype)
        with torch.no_grad():
            plain.weight.copy_(plain_weight.reshape(plain.weight.shape))
            if layer.bias is not None:
                plain.bias.copy_(layer.bias)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, plain)
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "quantization_config"):
        del config.quantization_config  # a saved config would otherwise tell loaders to quantize again
    if hasattr(model, "is_quantized"):
        model.is_quantized = False
    if hasattr(model, "hf_quantizer"):
        model.hf_quantizer = None
    return len(layers)
