"""A trained adapter merged into its base model's weights, written as a model folder that
``AutoModelForCausalLM.from_pretrained`` loads as is, and checked against the unmerged adapter."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from zerolab.config import ModelSpec
from zerolab.errors import EvaluationError
from zerolab.generation import DTYPES, MERGEABLE_METHODS, DType, adapter_method, apply_adapter, check_target_files
from zerolab.quantization import dequantize
from zerolab.reference import Target


def export_merged(target: Target, output: str | Path, *, dtype: DType = "auto", overwrite: bool = False) -> dict[str, Any]:
    """Merge the adapter of ``target`` into its base weights and save a model folder that
    ``AutoModelForCausalLM.from_pretrained`` loads (weights as safetensors, config, generation
    config, tokenizer). The folder is reloaded and checked against the unmerged model's logits.
    An adapter trained on a quantized base (``target.quantization``) merges into that base's
    weights dequantized (:func:`zerolab.quantization.dequantize`), written in ``dtype``.
    Returns what was written and the check's figures."""
    from transformers import AutoModelForCausalLM

    from zerolab.models import load_model, load_tokenizer

    output = Path(output).expanduser()
    if target.tuned_kind != "adapter":
        raise EvaluationError(f"export merges an adapter, but {target.source} is a fully fine-tuned model folder that already loads as is", input="adapter")
    if output.exists() and any(output.iterdir()) and not overwrite:
        raise EvaluationError(f"the output folder {output} exists and is not empty; choose a new folder or let the export overwrite it", input="output")
    assert target.base is not None and target.tuned_path is not None
    check_target_files(target)
    method = adapter_method(target.tuned_path)
    if method not in MERGEABLE_METHODS:
        raise EvaluationError(f"the adapter {target.source} is a {method} adapter, which peft cannot merge into the base weights; "
                              "serve it as an adapter on its base model", input="adapter")
    scaling, factor, original = target.rope  # the merged model's config carries the scaling it was trained with
    spec = ModelSpec(name_or_path=target.base, quantization=target.quantization, rope_scaling=scaling,  # type: ignore[arg-type]
                     rope_factor=factor, rope_original_max_position_embeddings=original)
    torch_dtype = _saved_dtype(spec) if dtype == "auto" else DTYPES[dtype]
    tokenizer = load_tokenizer(spec)
    base = load_model(spec, torch_dtype)
    probe = _probe_ids(tokenizer)
    if target.quantization != "none":
        # The adapter learned its update against the quantized weights: it merges into those,
        # dequantized, so that the merged model computes what was trained (the original weights
        # would differ from them by the quantization error the adapter was trained around).
        with torch.inference_mode():
            expected = apply_adapter(base, target.tuned_path, merge=False).eval()(input_ids=probe).logits.float()
        base = load_model(spec, torch_dtype)
        dequantize(base, torch_dtype)
        model = apply_adapter(base, target.tuned_path, merge=False).eval()
    else:
        model = apply_adapter(base, target.tuned_path, merge=False).eval()
        with torch.inference_mode():
            expected = model(input_ids=probe).logits.float()
    merged = model.merge_and_unload()
    if output.exists() and overwrite:
        shutil.rmtree(output)
    output.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(str(output), safe_serialization=True)
    tokenizer.save_pretrained(str(output))
    del model, merged
    reloaded = AutoModelForCausalLM.from_pretrained(str(output), dtype=torch_dtype).eval()
    with torch.inference_mode():
        got = reloaded(input_ids=probe).logits.float()
    max_diff = float((got - expected).abs().max())
    agreement = float((got.argmax(-1) == expected.argmax(-1)).float().mean())
    # fp32 merging is exact up to rounding; in 16-bit, W + BA is rounded once more than the unmerged sum.
    ok = max_diff < 1e-3 if torch_dtype == torch.float32 else agreement >= 0.9
    if not ok:
        raise EvaluationError(f"the merged model written to {output} gives other logits than the adapter (max |diff| {max_diff:.3g}, next-token agreement {agreement:.1%}); the adapter method may not merge exactly",
                              input="output")
    return {"output": str(output), "dtype": str(torch_dtype).replace("torch.", ""), "max_logit_diff": max_diff,
            "next_token_agreement": agreement, "files": sorted(p.name for p in output.iterdir())}


def _saved_dtype(spec: Any) -> torch.dtype:
    """The dtype the base model's weights are stored in (fp32 when its config does not say)."""
    from transformers import AutoConfig

    from zerolab.models import resolve_model_path

    config = AutoConfig.from_pretrained(resolve_model_path(spec.name_or_path), revision=spec.revision,
                                        trust_remote_code=spec.trust_remote_code)
    saved = getattr(config, "dtype", None)
    if isinstance(saved, str):
        saved = getattr(torch, saved, None)
    return saved if isinstance(saved, torch.dtype) else torch.float32


def _probe_ids(tokenizer: Any) -> torch.Tensor:
    text = tokenizer.apply_chat_template([{"role": "user", "content": "1234="}], tokenize=False, add_generation_prompt=True)
    return tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
