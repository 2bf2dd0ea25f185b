"""The model: its dimensions and every parameter by module, from its Hugging Face config alone."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from zerolab.checkpoint_files import CHECKPOINT_FILES_KEY
from zerolab.config import AdapterSpec, ModelSpec
from zerolab.memory.errors import MemoryEstimateError
from zerolab.memory.units import format_count

GB = 10**9
"""A gigabyte as ``max_shard_size`` strings count it (huggingface_hub's ``parse_size_to_int``)."""

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The linear modules of a Llama/Qwen2-style decoder layer, in forward order (peft's
``all-linear`` selects exactly these: every linear layer except the output head)."""


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a Llama/Qwen2-style decoder that memory depends on."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool = False
    mlp_bias: bool = False
    model_type: str = "qwen2"
    weights_bytes_per_param: int | None = None
    """Bytes per element of the saved checkpoint (config ``dtype``/``torch_dtype``), None if unknown."""
    checkpoint_file_bytes: tuple[int, ...] | None = None
    """The size of each of the checkpoint's weights files, where they were read
    (``zerolab.models.load_model_config`` records them, under
    :data:`~zerolab.checkpoint_files.CHECKPOINT_FILES_KEY`, for a local folder or a hub id in the
    Hugging Face cache); None where the files are not at hand."""
    checkpoint_shard_bytes: int = 50 * GB
    """The largest shard the checkpoint's files can be where their sizes are unknown: the default
    ``max_shard_size`` of the transformers release that saved it (:func:`default_shard_bytes`)."""

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        """Read a transformers config (or any object or dict with its attribute names)."""
        get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
        model_type = str(get("model_type", "") or "")
        missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
                   if not isinstance(get(k), int)]
        if missing:
            raise MemoryEstimateError(
                f"the memory estimator supports Llama/Qwen2-style decoders; this model config (model_type "
                f"{model_type or 'unknown'!r}) lacks {', '.join(missing)}"
            )
        heads = get("num_attention_heads")
        head_dim = get("head_dim") or get("hidden_size") // heads
        attention_bias = bool(get("attention_bias", False))
        qwen2 = model_type in ("qwen2", "qwen2_moe")
        return cls(
            hidden_size=get("hidden_size"),
            intermediate_size=get("intermediate_size"),
            num_layers=get("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=get("num_key_value_heads") or heads,
            head_dim=head_dim,
            vocab_size=get("vocab_size"),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases and none on o_proj; Llama-style models follow attention_bias.
            qkv_bias=qwen2 or attention_bias,
            o_bias=attention_bias and not qwen2,
            mlp_bias=bool(get("mlp_bias", False)),
            model_type=model_type or "unknown",
            weights_bytes_per_param=_dtype_bytes(get("dtype", None) or get("torch_dtype", None)),
            checkpoint_file_bytes=_file_sizes(get(CHECKPOINT_FILES_KEY, None)),
            checkpoint_shard_bytes=default_shard_bytes(get("transformers_version", None)),
        )

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of each projection of one decoder layer."""
        h, i = self.hidden_size, self.intermediate_size
        return {
            "q_proj": (h, self.q_dim), "k_proj": (h, self.kv_dim), "v_proj": (h, self.kv_dim), "o_proj": (self.q_dim, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h),
        }

    def describe(self) -> str:
        return (f"{self.model_type} {format_count(self.num_params())} params: {self.num_layers} layers, hidden {self.hidden_size}, "
                f"intermediate {self.intermediate_size}, {self.num_heads} heads / {self.num_kv_heads} KV, "
                f"vocab {self.vocab_size}{', tied embeddings' if self.tie_word_embeddings else ''}")

    def num_params(self) -> int:
        return sum(p.total for p in parameter_inventory(self, AdapterSpec(method="full")) if not p.adapter)

    def largest_checkpoint_file(self, bytes_per_param: int) -> int:
        """Bytes of the checkpoint's largest weights file: read where the files are at hand
        (:attr:`checkpoint_file_bytes`), otherwise the largest file of the layout that
        ``save_pretrained`` gives this shape at :attr:`checkpoint_shard_bytes` with
        ``bytes_per_param`` bytes per element (:func:`checkpoint_layout`): the whole checkpoint for
        one that fits one shard."""
        if self.checkpoint_file_bytes:
            return max(self.checkpoint_file_bytes)
        return max(checkpoint_layout(self, bytes_per_param, self.checkpoint_shard_bytes))


@dataclass(frozen=True)
class ParamSpec:
    """``count`` parameters of ``numel`` elements each (one per layer for layer parameters)."""

    name: str
    numel: int
    count: int
    trainable: bool
    adapter: bool
    ndim: int
    module: str
    """The module that uses it (``layers.q_proj``, ``embed_tokens``, ``lm_head``, ``norm``...)."""

    @property
    def total(self) -> int:
        return self.numel * self.count


def target_projections(spec: AdapterSpec) -> tuple[list[str], list[str]]:
    """(the projections peft wraps, the target names this estimator does not know) for ``spec``.
    peft matches a target against the end of each module's name; ``all-linear`` is every linear
    layer but the output head."""
    if not spec.is_peft():
        return [], []
    if list(spec.target_modules) == ["all-linear"]:
        return list(PROJECTIONS), []
    known = [p for p in PROJECTIONS if any(p == t or p.endswith(f".{t}") or t.endswith(p) for t in spec.target_modules)]
    unknown = [t for t in spec.target_modules if not any(t == p or t.endswith(p) for p in PROJECTIONS) and t != "lm_head"]
    if "lm_head" in spec.target_modules:
        known.append("lm_head")
    return known, unknown


def parameter_inventory(shape: ModelShape, spec: AdapterSpec) -> list[ParamSpec]:
    """Every parameter of the model with ``spec``'s adapter applied, grouped by module.

    Base model: embeddings V·h; per layer q (h·q_dim), k and v (h·kv_dim), o (q_dim·h), gate and up
    (h·I), down (I·h), their biases, two RMSNorm weights (h); the final norm (h); the output head
    h·V unless tied to the embeddings. Adapters, per wrapped projection with (in, out) features:
    LoRA/rsLoRA ``lora_A`` r·in and ``lora_B`` out·r; DoRA adds the magnitude vector (out);
    AdaLoRA starts at ``adalora_init_r``: A init_r·in, B out·init_r, E init_r (and a frozen
    ``ranknum``). Only adapter parameters train, or every base parameter with ``full``.
    """
    h, v, layers = shape.hidden_size, shape.vocab_size, shape.num_layers
    full = spec.method == "full"
    out: list[ParamSpec] = [ParamSpec("embed_tokens.weight", v * h, 1, full, False, 2, "embed_tokens")]
    for name, (fan_in, fan_out) in shape.linear_shapes().items():
        out.append(ParamSpec(f"{name}.weight", fan_in * fan_out, layers, full, False, 2, f"layers.{name}"))
        has_bias = shape.qkv_bias if name in ("q_proj", "k_proj", "v_proj") else shape.o_bias if name == "o_proj" else shape.mlp_bias
        if has_bias:
            out.append(ParamSpec(f"{name}.bias", fan_out, layers, full, False, 1, f"layers.{name}"))
    out.append(ParamSpec("input_layernorm.weight", h, layers, full, False, 1, "layers.input_layernorm"))
    out.append(ParamSpec("post_attention_layernorm.weight", h, layers, full, False, 1, "layers.post_attention_layernorm"))
    out.append(ParamSpec("norm.weight", h, 1, full, False, 1, "norm"))
    if not shape.tie_word_embeddings:
        out.append(ParamSpec("lm_head.weight", h * v, 1, full, False, 2, "lm_head"))

    targets, _ = target_projections(spec)
    shapes = {**shape.linear_shapes(), "lm_head": (h, v)}
    for name in targets:
        fan_in, fan_out = shapes[name]
        count = 1 if name == "lm_head" else layers
        module = name if name == "lm_head" else f"layers.{name}"
        if spec.method == "adalora":
            r = spec.adalora_init_r
            out += [ParamSpec(f"{name}.lora_A", r * fan_in, count, True, True, 2, module),
                    ParamSpec(f"{name}.lora_B", fan_out * r, count, True, True, 2, module),
                    ParamSpec(f"{name}.lora_E", r, count, True, True, 2, module),
                    ParamSpec(f"{name}.ranknum", 1, count, False, True, 1, module)]
            continue
        out += [ParamSpec(f"{name}.lora_A", spec.r * fan_in, count, True, True, 2, module),
                ParamSpec(f"{name}.lora_B", fan_out * spec.r, count, True, True, 2, module)]
        if spec.method == "dora":
            out.append(ParamSpec(f"{name}.lora_magnitude_vector", fan_out, count, True, True, 1, module))
    return out


def trainable_params(shape: ModelShape, spec: AdapterSpec) -> int:
    """Trainable parameters: Σ over wrapped projections of r·(in + out) (+ out for DoRA;
    AdaLoRA: init_r·(in + out + 1)) × layers, or every parameter for full fine-tuning."""
    return sum(p.total for p in parameter_inventory(shape, spec) if p.trainable)


def max_position_embeddings(model_config: Any, model: ModelSpec | None = None) -> int | None:
    """The longest row the model takes, None where its config (a transformers config or a dict of
    one) names no length: its ``max_position_embeddings``, or with ``model``'s RoPE scaling
    (``model.rope_scaling``) the trained length (yarn: ``rope_original_max_position_embeddings``
    where given) times ``model.rope_factor``."""
    get = model_config.get if isinstance(model_config, dict) else lambda k, d=None: getattr(model_config, k, d)
    value = get("max_position_embeddings", None)
    if not isinstance(value, int) or value <= 0:
        return None
    return value if model is None else model.positions(value)


def rope_scaling_fix(length: int, model_config: Any, model: ModelSpec) -> tuple[str, ...]:
    """For rows of ``length`` tokens past the positions ``model`` reaches (:func:`max_position_embeddings`),
    the overrides (``key=value``) of a RoPE scaling that reaches them; none where the length is
    within them or the model names no length."""
    reach = max_position_embeddings(model_config, model)
    if reach is None or length <= reach:
        return ()
    trained = max_position_embeddings(model_config)
    if model.rope_scaling == "yarn" and model.rope_original_max_position_embeddings:
        trained = model.rope_original_max_position_embeddings
    kind = "yarn" if model.rope_scaling == "none" else model.rope_scaling
    factor = math.ceil(length / trained)  # type: ignore[operator]
    return f"model.rope_scaling={kind}", f"model.rope_factor={factor:.1f}"


def default_shard_bytes(transformers_version: Any) -> int:
    """The default ``max_shard_size`` of the transformers release that saved a checkpoint (the
    ``transformers_version`` its config.json names): 10 GB before 4.35, 5 GB from 4.35 (the hub's
    recommendation then; transformers PR 26942), 50 GB from 5.0 (PR 42734). Where the version is
    missing or unreadable, 50 GB: no default file of any release is larger. A checkpoint uploaded
    with a larger ``max_shard_size`` than its release's default is the case this cannot see."""
    found = re.match(r"(\d+)\.(\d+)", str(transformers_version or ""))
    if found is None:
        return 50 * GB
    version = (int(found.group(1)), int(found.group(2)))
    return 10 * GB if version < (4, 35) else 5 * GB if version < (5, 0) else 50 * GB


def checkpoint_layout(shape: ModelShape, bytes_per_param: int, max_shard_bytes: int) -> tuple[int, ...]:
    """The weights bytes of each file ``save_pretrained(max_shard_size=max_shard_bytes)`` writes for
    ``shape`` (safetensors headers, a few KiB, left out): the tensors in state-dict order
    (embeddings; per layer q, k, v, o with their biases, gate, up, down, the two norms; the final
    norm; the head unless tied, which is not saved), a new file started where the next tensor would
    take the current one past the limit, a tensor larger than the limit in a file of its own
    (huggingface_hub's ``split_state_dict_into_shards_factory``)."""
    h, layers = shape.hidden_size, shape.num_layers
    biases = {"q_proj": shape.qkv_bias, "k_proj": shape.qkv_bias, "v_proj": shape.qkv_bias, "o_proj": shape.o_bias,
              "gate_proj": shape.mlp_bias, "up_proj": shape.mlp_bias, "down_proj": shape.mlp_bias}
    layer: list[int] = []
    for name, (fan_in, fan_out) in shape.linear_shapes().items():
        layer += [fan_in * fan_out] + ([fan_out] if biases[name] else [])
    layer += [h, h]
    tensors = [shape.vocab_size * h, *(layer * layers), h] + ([] if shape.tie_word_embeddings else [h * shape.vocab_size])
    files: list[int] = []
    current = 0
    for numel in tensors:
        size = numel * bytes_per_param
        if size > max_shard_bytes:
            files.append(size)
            continue
        if current and current + size > max_shard_bytes:
            files.append(current)
            current = 0
        current += size
    if current:
        files.append(current)
    return tuple(files)


def _file_sizes(value: Any) -> tuple[int, ...] | None:
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, int) and v > 0 for v in value):
        return tuple(value)
    return None


def _dtype_bytes(dtype: Any) -> int | None:
    name = str(dtype).removeprefix("torch.") if dtype is not None else ""
    return {"bfloat16": 2, "float16": 2, "float32": 4}.get(name)
