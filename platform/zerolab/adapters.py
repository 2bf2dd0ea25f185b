"""peft adapters: apply the configured method, count parameters, save and check the result."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import torch

from zerolab.config import AdapterSpec

logger = logging.getLogger(__name__)


def apply_adapter(model: torch.nn.Module, spec: AdapterSpec, total_steps: int) -> torch.nn.Module:
    """Wrap ``model`` with the adapter of ``spec`` (``full``: unfreeze everything and return it as is)."""
    if spec.method == "full":
        model.requires_grad_(True)
        return model
    from peft import AdaLoraConfig, LoraConfig, get_peft_model

    from zerolab.lean_imports import peft_without_bitsandbytes

    targets: Any = "all-linear" if list(spec.target_modules) == ["all-linear"] else list(spec.target_modules)
    common = dict(task_type="CAUSAL_LM", lora_alpha=spec.alpha, lora_dropout=spec.dropout, target_modules=targets)
    if spec.method == "adalora":
        tinit = max(1, int(spec.adalora_warmup_fraction * total_steps))
        tfinal = max(1, int(spec.adalora_final_fraction * total_steps))
        config = AdaLoraConfig(
            init_r=spec.adalora_init_r, target_r=spec.r, tinit=tinit, tfinal=tfinal, deltaT=1, total_step=total_steps, **common
        )
    else:
        config = LoraConfig(r=spec.r, use_dora=spec.method == "dora", use_rslora=spec.method == "rslora", **common)
    # Adapters in the model's dtype: peft's default makes them fp32, which DeepSpeed casts back to
    # bf16/fp16 under ZeRO 0-2 but not under ZeRO-3, where every adapter product then ran in fp32
    # (no tensor cores) with casts around it: a fifth of a 7B ZeRO-3 step's GPU time. The
    # optimizer keeps fp32 master weights either way.
    with peft_without_bitsandbytes():
        model = get_peft_model(model, config, autocast_adapter_dtype=False)
    # peft gives a layer's adapter its base weight's dtype only where that is a float: on an int8
    # base (LLM.int8()) they stay fp32, and the fused LoRA node takes one dtype throughout.
    dtype = model.get_input_embeddings().weight.dtype
    for p in model.parameters():
        if p.requires_grad and p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
    return model


def numel(p: torch.Tensor) -> int:
    """Element count, also for a parameter partitioned by ZeRO-3 (whose local tensor is empty) and
    for a 4-bit weight (whose tensor packs several weights per element; its quantization state
    keeps the shape it stands for)."""
    quant_state = getattr(p, "quant_state", None)
    if quant_state is not None:
        return math.prod(quant_state.shape)
    return int(getattr(p, "ds_numel", p.numel()))


def parameter_counts(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    trainable = total = 0
    for p in model.parameters():
        n = numel(p)
        total += n
        if p.requires_grad:
            trainable += n
    return trainable, total


def lora_trainable_closed_form(model_config: Any, spec: AdapterSpec) -> int:
    """Trainable parameters of LoRA/rsLoRA (r·(in+out) per target) and DoRA (+ out per target) on a
    Llama/Qwen2-style decoder, from the model config alone."""
    h, inter, layers = model_config.hidden_size, model_config.intermediate_size, model_config.num_hidden_layers
    head_dim = getattr(model_config, "head_dim", None) or h // model_config.num_attention_heads
    kv = model_config.num_key_value_heads * head_dim
    shapes = {
        "q_proj": (h, model_config.num_attention_heads * head_dim),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (model_config.num_attention_heads * head_dim, h),
        "gate_proj": (h, inter),
        "up_proj": (h, inter),
        "down_proj": (inter, h),
    }
    per_layer = 0
    for name in spec.target_modules:
        fan_in, fan_out = shapes[name]
        per_layer += spec.r * (fan_in + fan_out) + (fan_out if spec.method == "dora" else 0)
    return layers * per_layer


class SaveCheckError(RuntimeError):
    """A saved adapter or model is not what was trained (empty, missing tensors, wrong shapes)."""


def full_shape(p: torch.Tensor) -> tuple[int, ...]:
    """The shape of a parameter before ZeRO-3 partitioning (its local tensor is empty)."""
    return tuple(getattr(p, "ds_shape", p.shape))


def verify_saved(folder: str | Path, expected: dict[str, tuple[int, ...]]) -> int:
    """Check the safetensors in ``folder`` hold exactly ``expected`` (name -> shape), none empty
    (unless expected so: AdaLoRA can prune a module to rank 0) or non-finite; returns the count.
    ZeRO-3 adapter saves that wrote un-gathered, empty tensors fail here."""
    from safetensors import safe_open

    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise SaveCheckError(f"{folder}: no .safetensors file was written")
    found: dict[str, tuple[int, ...]] = {}
    for f in files:
        if f.stat().st_size == 0:
            raise SaveCheckError(f"{f}: the file is empty")
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                t = st.get_tensor(key)
                if t.numel() == 0 and math.prod(expected.get(key, (1,))) != 0:
                    raise SaveCheckError(f"{f}: tensor {key} is empty (shape {tuple(t.shape)}); it was saved without being gathered")
                if t.is_floating_point() and not torch.isfinite(t).all():
                    raise SaveCheckError(f"{f}: tensor {key} holds NaN or Inf")
                found[key] = tuple(t.shape)
    missing = sorted(set(expected) - set(found))
    extra = sorted(set(found) - set(expected))
    wrong = sorted(k for k in set(expected) & set(found) if expected[k] != found[k])
    if missing or extra or wrong:
        raise SaveCheckError(
            f"{folder}: saved tensors differ from the trained ones: missing {missing[:5]}, unexpected {extra[:5]}, "
            f"wrong shape {[(k, found[k], expected[k]) for k in wrong[:5]]}"
        )
    return len(found)


def save_trained(model: torch.nn.Module, state: dict[str, torch.Tensor], folder: str | Path, tokenizer: Any) -> int:
    """Save the adapter (PEFT format) or the full model (HF format) from a gathered ``state`` and check it.

    ``state`` holds full tensors: trainable parameters for an adapter, the whole state dict for full
    fine-tuning. Returns the number of tensors written.
    """
    from peft import PeftModel, get_peft_model_state_dict

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name, p in model.named_parameters():
        if name in state and tuple(state[name].shape) != full_shape(p):
            raise SaveCheckError(f"{name}: gathered shape {tuple(state[name].shape)} but the parameter is {full_shape(p)}; ZeRO-3 gathering failed")
    if isinstance(model, PeftModel):
        expected_state = get_peft_model_state_dict(model, state_dict=state)
        model.save_pretrained(str(folder), state_dict=state)
        # peft drops the adapter name from saved keys ("...lora_A.default.weight" -> "...lora_A.weight").
        name = model.active_adapter
        expected = {k.replace(f".{name}.", "."): tuple(v.shape) for k, v in expected_state.items()}
        if not expected:
            raise SaveCheckError("the adapter state is empty: no trainable adapter weights were gathered")
    else:
        if getattr(model.config, "tie_word_embeddings", False):
            # Gathered to the CPU tensor by tensor, the tied head is a copy rather than the embedding
            # itself, and transformers would save both; the tied model has one.
            state = {k: v for k, v in state.items() if k != "lm_head.weight"}
        model.save_pretrained(str(folder), state_dict=state, safe_serialization=True)
        with open(folder / "config.json") as f:
            tied = json.load(f).get("tie_word_embeddings", False)
        expected = {k: tuple(v.shape) for k, v in state.items() if not (tied and k == "lm_head.weight")}
    tokenizer.save_pretrained(str(folder))
    return verify_saved(folder, expected)
