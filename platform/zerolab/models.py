"""Model and tokenizer loading: any Hugging Face causal LM by hub id or path, or the built-in tiny one.

``builtin:tiny-qwen2`` is a few-layer Qwen2 with random weights and a byte-level BPE tokenizer
trained on the tasks' generated text with a ChatML chat template. It is built from code on first
use into ``$ZEROLAB_CACHE`` (default ``~/.cache/zerolab``) and then loads through the same
``from_pretrained`` code as a real model, so nothing is downloaded in tests or in the default run.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from huggingface_hub.errors import StrictDataclassError

import zerolab.lean_imports  # noqa: F401  # isort: skip  (before transformers: its models then load without scikit-learn)
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from zerolab import cache_dir
from zerolab.checkpoint_files import CHECKPOINT_FILES_KEY, checkpoint_file_sizes
from zerolab.config import BUILTIN_TINY_MODEL, ModelSpec
from zerolab.errors import UserError
from zerolab.kernels import resolve_attention
from zerolab.quantization import bnb_config, keep_training_layout
from zerolab.tasks import TASKS, math_sum, ner_json

logger = logging.getLogger(__name__)

LOAD_ERRORS = (OSError, ValueError, StrictDataclassError)
"""What transformers raises for a model folder or hub id it cannot load (missing files, a config that
fails its own checks)."""

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""Qwen2.5's ChatML layout without its default system prompt."""

_TINY_VERSION = "v2"
_TINY_SHAPE = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)


class ModelLoadError(UserError, RuntimeError):
    """The model or tokenizer could not be loaded; the message says what to do."""


def resolve_model_path(name_or_path: str) -> str:
    """A loadable id or folder: builds the built-in tiny model on first use, passes others through."""
    if name_or_path == BUILTIN_TINY_MODEL:
        return str(build_tiny_model())
    if name_or_path.startswith("builtin:"):
        raise ModelLoadError(f"model.name_or_path: unknown built-in model '{name_or_path}'; the built-in one is '{BUILTIN_TINY_MODEL}'")
    if _looks_like_path(name_or_path) and not Path(name_or_path).expanduser().exists():
        raise ModelLoadError(f"could not load the model '{name_or_path}': there is no folder '{name_or_path}'; check model.name_or_path")
    return name_or_path


KNOWN_CONFIGS: dict[str, dict[str, Any]] = {
    "Qwen/Qwen2.5-0.5B": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                              num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "Qwen/Qwen2.5-1.5B": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                              num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "Qwen/Qwen2.5-3B": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                            num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "Qwen/Qwen2.5-7B": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                            num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "Qwen/Qwen2.5-14B": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40,
                             num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
    "Qwen/Qwen2.5-32B": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                             num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
    "Qwen/Qwen2.5-72B": dict(hidden_size=8192, intermediate_size=29568, num_hidden_layers=80, num_attention_heads=64,
                             num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
}
"""Shapes of the Qwen2.5 models the shipped job configs use (from their config.json; the
-Instruct variants share them), so that estimates work offline. Keys: hub ids without -Instruct."""


def load_model_config(spec: ModelSpec) -> Any:
    """The Hugging Face config of the model ``spec`` names: a local folder, ``builtin:tiny-qwen2``
    (built on first use), a hub id found in the local Hugging Face cache, a hub id in
    :data:`KNOWN_CONFIGS` (a dict, no network), or else the hub. Where the checkpoint's weights files
    are at hand (:func:`~zerolab.checkpoint_files.checkpoint_file_sizes`) their sizes are recorded on
    it, under :data:`~zerolab.checkpoint_files.CHECKPOINT_FILES_KEY`, for the memory estimate's
    model load. No weights are read. Raises ModelLoadError."""
    path = resolve_model_path(spec.name_or_path)
    kwargs = dict(revision=spec.revision, trust_remote_code=spec.trust_remote_code)
    config: Any = None
    if not Path(path).expanduser().exists():
        try:
            config = AutoConfig.from_pretrained(path, local_files_only=True, **kwargs)
        except LOAD_ERRORS:
            known = KNOWN_CONFIGS.get(path.removesuffix("-Instruct"))
            if known is not None:
                # Saved by transformers 4.4x (the 3B and 7B config.json files name 4.43.1): files of at most 5 GB.
                config = {"model_type": "qwen2", "dtype": "bfloat16", "transformers_version": "4.43.1", **known}
    if config is None:
        try:
            config = AutoConfig.from_pretrained(path, **kwargs)
        except LOAD_ERRORS as exc:
            raise ModelLoadError(load_failure(spec.name_or_path, "model config", exc)) from exc
    sizes = checkpoint_file_sizes(path, spec.revision)
    if sizes is not None:
        if isinstance(config, dict):
            config[CHECKPOINT_FILES_KEY] = sizes
        else:
            setattr(config, CHECKPOINT_FILES_KEY, sizes)
    return config


def _looks_like_path(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~")) or name.count("/") > 1


def build_tiny_model(root: Path | None = None) -> Path:
    """Build (once) and return the folder of the tiny Qwen2 model and its tokenizer.

    Deterministic: the same code gives the same tokenizer and weights, so every node of a
    cluster can build its own copy. Concurrent builders are serialised with a file lock.
    """
    from filelock import FileLock

    target = (root or cache_dir()) / f"tiny-qwen2-{_TINY_VERSION}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if (target / "config.json").is_file():
            return target
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".building-"))
        try:
            tokenizer = _train_tiny_tokenizer()
            tokenizer.save_pretrained(tmp)
            from transformers import Qwen2Config, Qwen2ForCausalLM

            config = Qwen2Config(
                vocab_size=len(tokenizer),
                max_position_embeddings=2048,
                tie_word_embeddings=True,
                bos_token_id=None,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
                **_TINY_SHAPE,
            )
            torch.manual_seed(0)
            model = Qwen2ForCausalLM(config)
            _pretrain_tiny(model, tokenizer)
            model.generation_config.eos_token_id = tokenizer.eos_token_id
            model.generation_config.pad_token_id = tokenizer.pad_token_id
            model.save_pretrained(tmp)
            tmp.rename(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    logger.info("built %s at %s", BUILTIN_TINY_MODEL, target)
    return target


def _pretraining_text(rng: random.Random) -> str:
    """Plain text a base model would have seen: sums and entity sentences, no chat format, no
    answer prefix. Fine-tuning has to teach the format; the content is already familiar."""

    if rng.random() < 0.6:
        x = rng.randint(2, math_sum.MAX_X)
        a = rng.randint(0, x)
        return f"{x}={a} + {x - a}"
    row = ner_json.generate(1, rng.randrange(1 << 30))[0]
    return f"{row['text']} {json.dumps(row['label'], ensure_ascii=False)}"


def _pretrain_tiny(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, steps: int = 600, batch_size: int = 32) -> None:
    """A short causal-LM pre-training on ``_pretraining_text``, single-threaded so that every
    machine that builds the model gets the same weights."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rng = random.Random(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 30) * (1 - s / steps))
    model.train()
    try:
        for _ in range(steps):
            texts = [_pretraining_text(rng) + tokenizer.eos_token for _ in range(batch_size)]
            batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
            labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
            loss = model(**batch, labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
    finally:
        torch.set_num_threads(threads)
    model.eval()
    logger.info("pre-trained %s: final loss %.3f", BUILTIN_TINY_MODEL, loss.item())


def _train_tiny_tokenizer() -> PreTrainedTokenizerBase:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast


    corpus: list[str] = []
    # The tasks the built-in model was made for: a task added later leaves its tokenizer (and weights) as they are.
    for task in (TASKS[name] for name in ("math_sum", "ner_json", "custom")):
        corpus.append(task.system_prompt)
        if task.generate is None:
            continue
        for row in task.generate(2000, 1234):
            corpus.extend(v if isinstance(v, str) else json.dumps(v, ensure_ascii=False) for v in row.values())
    # Role names and JSON punctuation appear in every rendered sample: give them their own tokens.
    corpus.extend(["system\n", "user\n", "assistant\n", '{"', '": ["', '"], "', '"]}'] * 500)

    tok = Tokenizer(models.BPE())
    # Digits one by one (as Qwen2 does): numbers stay learnable for a small model.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=1024, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML_TEMPLATE,
        model_max_length=2048,
    )


def load_tokenizer(spec: ModelSpec) -> PreTrainedTokenizerBase:
    path = resolve_model_path(spec.name_or_path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, revision=spec.revision, trust_remote_code=spec.trust_remote_code)
    except LOAD_ERRORS as exc:
        raise ModelLoadError(load_failure(spec.name_or_path, "tokenizer", exc)) from exc
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if not tokenizer.chat_template:
        raise ModelLoadError(
            f"model.name_or_path: the tokenizer of '{spec.name_or_path}' has no chat template, so prompts "
            "cannot be rendered the way the model expects; use an instruct/chat model or add a chat_template "
            "to its tokenizer_config.json"
        )
    return tokenizer


def load_model(spec: ModelSpec, dtype: torch.dtype, device: torch.device | None = None) -> PreTrainedModel:
    """The model in ``dtype`` (its linear layers quantized where ``spec.quantization`` says so), on
    ``device`` when given. A checkpoint saved in ``dtype`` loads lazily
    from its memory-mapped files and each tensor is copied to the device, so the host holds only
    the pages being read; one in another dtype is converted tensor by tensor on its way to the
    device (7B bf16 checkpoint in fp32: 16 GiB of host RSS, against 44 GiB when converted whole on
    the host first)."""

    path = resolve_model_path(spec.name_or_path)
    quantization = bnb_config(spec.quantization, dtype)
    try:
        config = AutoConfig.from_pretrained(path, revision=spec.revision, trust_remote_code=spec.trust_remote_code)
        apply_rope_scaling(config, spec)
        # bitsandbytes quantizes each tensor as it reaches the device (a quantized model cannot be moved after).
        by_map = device is not None and (quantization is not None or saved_dtype(config) not in (None, dtype))
        model = AutoModelForCausalLM.from_pretrained(
            path,
            config=config,
            revision=spec.revision,
            dtype=dtype,
            attn_implementation=resolve_attention(spec.attn_implementation),
            trust_remote_code=spec.trust_remote_code,
            **({"quantization_config": quantization} if quantization is not None else {}),
            **({"device_map": {"": str(device)}} if by_map else {}),
        )
    except (OSError, ValueError, ImportError) as exc:
        raise ModelLoadError(load_failure(spec.name_or_path, "model", exc)) from exc
    if device is not None and not by_map:
        model.to(device)
    if quantization is not None:
        keep_training_layout(model)
    if spec.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    return model


def apply_rope_scaling(config: Any, spec: ModelSpec) -> None:
    """Set ``spec.rope_scaling`` (with ``rope_factor`` and, for yarn, the trained length) on a
    transformers ``config`` as it loads; nothing for ``none``. transformers 5 keeps RoPE's settings in
    ``config.rope_parameters`` (``rope_theta`` and the model's own scaling among them), which this
    updates and has transformers validate."""
    if spec.rope_scaling == "none":
        return
    params = dict(getattr(config, "rope_parameters", None) or {})
    for stale in ("type", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow", "short_factor",
                  "long_factor", "low_freq_factor", "high_freq_factor", "mscale", "mscale_all_dim"):
        params.pop(stale, None)  # another scaling's settings (the config's own) would not validate for this one
    params.update(rope_type=spec.rope_scaling, factor=float(spec.rope_factor))
    if spec.rope_scaling == "yarn":
        params["original_max_position_embeddings"] = spec.rope_original_max_position_embeddings or config.max_position_embeddings
    config.rope_parameters = params
    if hasattr(config, "validate_rope"):
        config.validate_rope()


def saved_dtype(config: Any) -> torch.dtype | None:
    """The dtype a model's weights are saved in, from its transformers config (None if it names none)."""
    saved = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(saved, str):
        saved = getattr(torch, saved, None)
    return saved if isinstance(saved, torch.dtype) else None


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks: the children of the ``nn.ModuleList`` of one module class that
    holds the most parameters (a causal LM's decoder layers, inside a peft wrapper too; not the
    experts list within a mixture-of-experts layer, which holds fewer); empty if there is none."""
    best: list[torch.nn.Module] = []
    most = 0
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) and len({type(m) for m in module}) == 1:
            n = sum(int(getattr(p, "ds_numel", p.numel())) for p in module.parameters())
            if n > most:
                best, most = list(module), n
    return best


def linear_module_names(spec: ModelSpec, config: Any = None) -> set[str]:
    """Names (last path component) of the model's nn.Linear modules, built on the meta device from
    ``config`` (a transformers config, or a dict of one) when given, else from the model's own."""
    if config is None:
        try:
            config = AutoConfig.from_pretrained(resolve_model_path(spec.name_or_path), revision=spec.revision,
                                                trust_remote_code=spec.trust_remote_code)
        except LOAD_ERRORS as exc:
            raise ModelLoadError(load_failure(spec.name_or_path, "model config", exc)) from exc
    elif isinstance(config, dict):
        config = AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=spec.trust_remote_code)
    return {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}


def load_failure(name: str, what: str, exc: Exception) -> str:
    if Path(name).expanduser().exists():
        hint = f"the folder '{name}' does not hold a loadable Hugging Face {what} (config.json, tokenizer files, weights); point model.name_or_path at the saved model folder"
    else:
        hint = (
            f"'{name}' is not a local folder, so it was looked up as a Hugging Face hub id; if this machine has no "
            "network, download the model elsewhere (huggingface-cli download) and set model.name_or_path to its "
            "folder, or check the id's spelling and your HF_TOKEN for gated models"
        )
    return f"could not load the {what} '{name}': {hint}. (cause: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
