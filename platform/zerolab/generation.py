"""Greedy answers of one model to held-out prompts, with its speed and memory.

The prompts are :class:`Example` rows of an eval file (any training data format) or of the task's
generated eval split. Answers are greedy (no sampling, one beam) with the KV cache, in batches of
prompts rendered by the model's chat template exactly as in training and left-padded, stopping at
end-of-turn or ``max_new_tokens``. Prompts are batched longest first, so a batch holds prompts of
similar length; the batches are fixed before generation, so one process and several Ray Data
actors (``workers``) generate the same batches and give the same answers.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import resource
import shutil
import socket
import tempfile
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal

import torch

from zerolab import cache_dir
from zerolab.cluster import cluster_resources, quiet_ray_data_logging
from zerolab.config import ModelSpec
from zerolab.data import DataError, RowError, list_data_files, parse_file, prompt_and_target
from zerolab.errors import EvaluationError, EvaluationInput
from zerolab.integrity import folder_problems
from zerolab.reference import LoadSpec, Target
from zerolab.tasks import generate_dataset, get_task

logger = logging.getLogger(__name__)

GIB = 1024**3
Device = Literal["auto", "cpu", "cuda"]
DType = Literal["auto", "bf16", "fp16", "fp32"]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

PERF_KEYS = ("wall_s", "load_s", "generate_s", "tokens_per_s", "generated_tokens", "gpu_peak_load_gib",
             "gpu_peak_generate_gib", "host_rss_gib", "host_rss_peak_gib")
"""The figures of :class:`Answers`, in the order a report shows them."""


# --- the prompts ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Example:
    index: int
    messages: list[dict[str, str]]
    """The chat up to the answer: system prompt and user turn(s)."""
    reference: str

    @property
    def prompt(self) -> str:
        """The last user turn: what the task scorer reads (math_sum parses ``x=`` from it)."""
        return next(m["content"] for m in reversed(self.messages) if m["role"] == "user")


def load_examples(path: str, task: str, *, system_prompt: str | None = None, limit: int | None = None) -> list[Example]:
    """The rows of an eval file (any of the training data formats) as prompts and references, in
    file order; the first ``limit`` when given. Malformed rows are skipped with a warning."""

    system = system_prompt if system_prompt is not None else get_task(task).system_prompt
    examples: list[Example] = []
    bad: list[str] = []
    for file in list_data_files(path):
        for row in parse_file({"path": file, "bytes": Path(file).read_bytes()}):
            if limit is not None and len(examples) >= limit:
                break
            if row["error"] is not None:
                bad.append(f"{row['path']}:{row['line']}: {row['error']}")
                continue
            try:
                messages, reference = prompt_and_target(json.loads(row["record"]), system)
            except RowError as exc:
                bad.append(f"{row['path']}:{row['line']}: {exc}")
                continue
            examples.append(Example(index=len(examples), messages=messages, reference=reference))
    if not examples:
        shown = "; ".join(bad[:3]) or "the file is empty"
        raise DataError(f"{path}: no usable eval rows ({shown}); give a JSON/JSONL/Parquet file in one of the training data formats")
    if bad:
        logger.warning("%s: %d malformed rows skipped, e.g. %s", path, len(bad), bad[0])
    return examples


def default_eval_path(task: str, num_rows: int, seed: int) -> str:
    """The task's generated eval split: the same file (and seed) a training run with generated
    data holds out, so a tuned model is scored on the rows its run evaluated."""
    spec = get_task(task)
    if spec.generate is None:
        raise EvaluationError(f"task '{task}' has no generator, so there is no generated eval split; give an eval file", input="data")
    target = cache_dir() / "data" / f"{task}-eval-{num_rows}-seed{seed}.{spec.file_format}"
    return str(target if target.is_file() else generate_dataset(task, num_rows, seed, target))


def plan_batches(examples: Sequence[Example], batch_size: int) -> list[list[int]]:
    """Example indices in batches, longest prompts first (little padding per batch). Deterministic."""
    order = sorted(range(len(examples)), key=lambda i: (-sum(len(m["content"]) for m in examples[i].messages), i))
    return [order[j : j + batch_size] for j in range(0, len(order), batch_size)]


# --- generation ------------------------------------------------------------------------------------


def resolve_device(device: Device) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise EvaluationError("this machine has no CUDA GPU to generate on; use cpu (or auto)", input="device")
    return device


def resolve_dtype(dtype: DType, device: str) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device == "cuda" else torch.float32
    if dtype == "fp16" and device == "cpu":
        raise EvaluationError("half precision (fp16) generation needs a GPU; use fp32 or bf16 on CPU", input="dtype")
    return DTYPES[dtype]


class Generator:
    """One loaded model that answers chat prompts greedily, in batches, and measures itself.

    Also the Ray Data ``map_batches`` callable: each input row is one planned batch
    (``batch_id``, ``messages`` as JSON), each output row its answers and this process's figures.
    """

    def __init__(self, spec: dict[str, Any], *, device: str, dtype: str, max_new_tokens: int, batch_size: int = 1,
                 adapter_files: dict[str, bytes] | None = None) -> None:
        from zerolab.models import load_model, load_tokenizer

        self.spec = LoadSpec(**spec)
        self.device = torch.device(device)
        self.max_new_tokens = max_new_tokens
        self._tmp: str | None = None
        if adapter_files is not None:
            # Shipped through Ray's object store: the driver's folder need not exist on this node.
            self._tmp = tempfile.mkdtemp(prefix="zerolab-adapter-")
            for name, data in adapter_files.items():
                (Path(self._tmp) / name).parent.mkdir(parents=True, exist_ok=True)
                (Path(self._tmp) / name).write_bytes(data)
            self.spec = replace(self.spec, adapter_path=self._tmp)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        start = time.perf_counter()
        scaling, factor, original = self.spec.rope
        model_spec = ModelSpec(name_or_path=self.spec.name_or_path, revision=self.spec.revision,  # type: ignore[arg-type]
                               trust_remote_code=self.spec.trust_remote_code, attn_implementation=self.spec.attn_implementation,
                               quantization=self.spec.quantization, rope_scaling=scaling, rope_factor=factor,
                               rope_original_max_position_embeddings=original)
        self.tokenizer = load_tokenizer(model_spec)
        self.tokenizer.padding_side = "left"
        model = load_model(model_spec, DTYPES[dtype], self.device)
        if self.spec.adapter_path is not None:
            model = apply_adapter(model, self.spec.adapter_path, merge=self.spec.merge)
        self.model = model.eval()
        self.model.config.use_cache = True
        self.load_s = time.perf_counter() - start
        self.gpu_peak_load = self._gpu_peak()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        eos = {self.tokenizer.eos_token_id}
        configured = getattr(self.model.generation_config, "eos_token_id", None)
        eos.update(configured if isinstance(configured, list) else [configured] if configured is not None else [])
        self.eos_ids = sorted(e for e in eos if e is not None)
        self.generate_s = 0.0
        # A short untimed generation at the batch size first: the first calls pay one-off costs
        # (kernel loading and selection, allocator growth) that would otherwise be charged to
        # whichever model runs first.
        self.generate([[{"role": "user", "content": "1"}]] * batch_size, max_new_tokens=2)
        self.generate_s = 0.0
        self.process = f"{socket.gethostname()}:{os.getpid()}"

    def _gpu_peak(self) -> float:
        return torch.cuda.max_memory_allocated(self.device) / GIB if self.device.type == "cuda" else 0.0

    def generate(self, conversations: Sequence[list[dict[str, str]]], max_new_tokens: int | None = None) -> tuple[list[str], list[int]]:
        """Greedy answers to one batch of chats, and the tokens generated for each (end-of-turn included)."""
        from transformers import GenerationConfig

        texts = [self.tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in conversations]
        # Tokenized as in training (data.tokenize_messages): the rendered prompt, no extra special tokens.
        batch = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(self.device)
        config = GenerationConfig(max_new_tokens=max_new_tokens or self.max_new_tokens, do_sample=False, num_beams=1, use_cache=True,
                                  eos_token_id=self.eos_ids, pad_token_id=self.tokenizer.pad_token_id)
        start = time.perf_counter()
        with torch.inference_mode(), _attention_backends(self.device):
            out = self.model.generate(**batch, generation_config=config)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.generate_s += time.perf_counter() - start
        answers, counts = [], []
        for row in out[:, batch["input_ids"].shape[1]:].tolist():
            cut = next((i for i, t in enumerate(row) if t in self.eos_ids), None)
            answer = row if cut is None else row[:cut]
            answers.append(self.tokenizer.decode(answer, skip_special_tokens=True))
            counts.append(len(row) if cut is None else cut + 1)
        return answers, counts

    def figures(self) -> dict[str, float]:
        """This process's load time, generation time and peak memory so far."""
        import psutil

        return {"load_s": self.load_s, "generate_s": self.generate_s, "gpu_peak_load_gib": self.gpu_peak_load,
                "gpu_peak_generate_gib": self._gpu_peak(), "host_rss_gib": psutil.Process().memory_info().rss / GIB,
                "host_rss_peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB}

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        import numpy as np

        answers, counts, figures = [], [], []
        for messages in batch["messages"]:
            a, c = self.generate(json.loads(messages))
            answers.append(json.dumps(a, ensure_ascii=False))
            counts.append(json.dumps(c))
            figures.append(json.dumps({**self.figures(), "process": self.process}))
        return {"batch_id": batch["batch_id"], "answers": np.array(answers, dtype=object),
                "num_tokens": np.array(counts, dtype=object), "figures": np.array(figures, dtype=object)}

    def close(self) -> None:
        import gc

        self.model = None
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
        # peft and transformers modules hold reference cycles: collect them so the next model's
        # memory figures do not include this one.
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _attention_backends(device: torch.device) -> Any:
    """SDPA without cuDNN's kernel on GPU: cuDNN builds an execution plan for every new shape, and
    greedy decoding changes the KV length at every step, so the first model evaluated in a process
    spent seconds building plans that the next one reused (8.5 s vs 1.1 s for 200 prompts of the
    tiny model on an H100). The flash and memory-efficient kernels have no such cost."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


MERGEABLE_METHODS = ("LORA", "ADALORA")
"""peft methods whose adapter ``merge_and_unload`` adds into the weights it adapts (LoRA's
W + s·BA, with rsLoRA's scale s and DoRA's rescaled columns; AdaLoRA's W + s·B·diag(E)·A): the
merged model computes what the base model with the adapter on top computes, in fewer operations."""


def adapter_method(adapter_path: str | Path) -> str:
    """The peft method of the adapter in ``adapter_path`` (``LORA``, ``ADALORA``, ...), from its config."""
    return str(json.loads((Path(adapter_path) / "adapter_config.json").read_text()).get("peft_type", "unknown"))


def check_saved_files(folder: str | Path, what: str, *, input: EvaluationInput = "adapter") -> None:
    """Raise EvaluationError naming every damaged weights or config file (``*.safetensors``,
    ``*.json``) in ``folder``, which the message calls ``what`` (``the adapter runs:/<id>``).
    Reads only the files' headers: this runs before any model is loaded, where a truncated file
    would otherwise fail deep inside safetensors or peft, after the base model was evaluated."""

    folder = Path(folder)
    damaged = folder_problems(folder)
    if not damaged:
        return
    files = "; ".join(f"{path.relative_to(folder)} {problem}" for path, problem in damaged.items())
    fix = ("copy it again from the training run's checkpoint (<run.storage_path>/<run.name>/checkpoint_*/adapter, checked when "
           "it was saved) or give another checkpoint's adapter") if input == "adapter" else "download or copy the model folder again"
    raise EvaluationError(f"{what} is damaged: {files}. The file was cut short or changed after it was written (an interrupted "
                          f"copy, download or upload); {fix}", input=input)


def check_target_files(target: Target) -> None:
    """Raise EvaluationError when a weights or config file of the tuned model, or of a base model
    given as a local folder, is damaged (truncated, or JSON that does not parse)."""
    if target.tuned_path is not None:
        folder = Path(target.tuned_path)
        # A local reference is named by the folder that holds the files; runs:/ and models:/ by the reference.
        local = target.source is None or not target.source.startswith(("runs:", "models:"))
        what = f"the {'adapter' if target.tuned_kind == 'adapter' else 'model folder'} {folder if local else target.source}"
        check_saved_files(folder, what)
        if target.tuned_kind == "adapter" and not any(folder.glob("adapter_model.*")):
            raise EvaluationError(f"{what} is incomplete: it has adapter_config.json but no adapter_model.safetensors; copy it again "
                                  "from the training run's checkpoint (<run.storage_path>/<run.name>/checkpoint_*/adapter)", input="adapter")
    if target.base is not None and Path(target.base).expanduser().is_dir():
        check_saved_files(Path(target.base).expanduser(), f"the base model {target.base}", input="model")


_ADALORA_RANK_PATTERN_WARNING = r"The following rank_pattern keys did not match any targeted module and were ignored: \[('[^']*\.lora_E', )*'[^']*\.lora_E'\]\.$"
"""peft (0.21) checks a config's ``rank_pattern`` keys against the adapted modules' names when it
loads an adapter, and warns that the rest "were ignored". An AdaLoRA adapter's keys name the
modules' ``lora_E`` entries, which AdaLoRA's own loading does read to cut each module to its
trained ranks: that warning, when every key it lists is such an entry, is not one."""


def apply_adapter(model: torch.nn.Module, adapter_path: str, *, merge: bool) -> torch.nn.Module:
    """``model`` with the PEFT adapter in ``adapter_path`` on top, or merged into its weights with
    ``merge`` (in place: ``model`` is the merged model then; the caller checks the method is one
    of MERGEABLE_METHODS). Raises EvaluationError when the adapter does not fit the model."""
    from peft import PeftModel

    from zerolab.lean_imports import peft_without_bitsandbytes

    with peft_without_bitsandbytes(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_ADALORA_RANK_PATTERN_WARNING, category=RuntimeWarning)
        try:
            peft_model = PeftModel.from_pretrained(model, adapter_path)
        except (OSError, ValueError, RuntimeError, KeyError) as exc:
            raise EvaluationError(
                f"could not apply the adapter in {adapter_path} to the base model ({type(exc).__name__}: {_first_line(exc)}); check that the base model is the one the adapter was trained on",
                input="model",
            ) from None
        return peft_model.merge_and_unload() if merge else peft_model


@dataclass
class Answers:
    """One model's answers to every example, in example order, and how producing them went."""

    texts: list[str]
    num_tokens: list[int]
    figures: dict[str, float]


def generate_answers(spec: LoadSpec, examples: Sequence[Example], *, batch_size: int, max_new_tokens: int,
                     device: str = "cpu", dtype: str = "fp32", workers: int = 0) -> Answers:
    """Answers of the model ``spec`` to ``examples``: in this process (``workers=0``) or on
    ``workers`` Ray Data actors (one GPU each on ``cuda``), over the same fixed batches."""
    batches = plan_batches(examples, batch_size)
    start = time.perf_counter()
    if workers <= 0:
        generator = Generator(asdict(spec), device=device, dtype=dtype, max_new_tokens=max_new_tokens, batch_size=batch_size)
        try:
            results = {}
            for batch_id, batch in enumerate(batches):
                results[batch_id] = generator.generate([examples[i].messages for i in batch])
            per_process = [generator.figures()]
        finally:
            generator.close()
    else:
        results, per_process = _generate_on_actors(spec, examples, batches, max_new_tokens=max_new_tokens, device=device,
                                                   dtype=dtype, workers=workers)
    wall = time.perf_counter() - start
    texts: list[str] = [""] * len(examples)
    counts: list[int] = [0] * len(examples)
    for batch_id, batch in enumerate(batches):
        for i, answer, n in zip(batch, *results[batch_id]):
            texts[i], counts[i] = answer, n
    total = sum(counts)
    # Processes work in parallel: the slowest one's generation time is the set's.
    generate_s = max(f["generate_s"] for f in per_process)
    figures = {
        "wall_s": wall,
        "load_s": max(f["load_s"] for f in per_process),
        "generate_s": generate_s,
        "generated_tokens": float(total),
        "tokens_per_s": total / generate_s if generate_s > 0 else 0.0,
        "host_rss_gib": max(f["host_rss_gib"] for f in per_process),
        "host_rss_peak_gib": max(f["host_rss_peak_gib"] for f in per_process),
    }
    if device == "cuda":
        figures["gpu_peak_load_gib"] = max(f["gpu_peak_load_gib"] for f in per_process)
        figures["gpu_peak_generate_gib"] = max(f["gpu_peak_generate_gib"] for f in per_process)
    return Answers(texts=texts, num_tokens=counts, figures=figures)


def _generate_on_actors(spec: LoadSpec, examples: Sequence[Example], batches: list[list[int]], *, max_new_tokens: int,
                        device: str, dtype: str, workers: int) -> tuple[dict[int, tuple[list[str], list[int]]], list[dict[str, float]]]:
    import ray.data


    quiet_ray_data_logging()
    kind = "GPU" if device == "cuda" else "CPU"
    have = cluster_resources().get(kind, 0)
    if have < workers:
        # Ray Data would wait for actors that can never be placed.
        raise EvaluationError(f"{workers} generation workers: each actor takes one {kind} and the Ray cluster has {have:g}; use {int(have)} workers or fewer, or add nodes",
                              input="workers")
    adapter_files = _pack_folder(spec.adapter_path) if spec.adapter_path else None
    items = [{"batch_id": b, "messages": json.dumps([examples[i].messages for i in batch], ensure_ascii=False)}
             for b, batch in enumerate(batches)]
    ds = ray.data.from_items(items, override_num_blocks=len(items))
    resources = {"num_gpus": 1} if device == "cuda" else {"num_cpus": 1}
    ds = ds.map_batches(
        Generator,
        batch_size=1,
        concurrency=workers,
        fn_constructor_kwargs={"spec": asdict(spec), "device": device, "dtype": dtype, "max_new_tokens": max_new_tokens,
                               "batch_size": max(len(b) for b in batches), "adapter_files": adapter_files},
        **resources,
    )
    results: dict[int, tuple[list[str], list[int]]] = {}
    figures: dict[str, dict[str, float]] = {}
    for row in ds.iter_rows():
        results[int(row["batch_id"])] = (json.loads(row["answers"]), json.loads(row["num_tokens"]))
        f = json.loads(row["figures"])
        # An actor's figures only grow: the row with its largest generation time holds its totals.
        process = f.pop("process")
        if process not in figures or f["generate_s"] >= figures[process]["generate_s"]:
            figures[process] = f
    assert len(results) == len(batches), f"{len(results)} of {len(batches)} batches came back"
    return results, list(figures.values())


def _pack_folder(path: str) -> dict[str, bytes]:
    root = Path(path)
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
