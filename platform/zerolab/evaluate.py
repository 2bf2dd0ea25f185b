"""Generation-based evaluation: answer held-out prompts with a model, score the answers with the
task's scorer, and compare a fine-tuned model with its base on the same prompts.

What is evaluated is a :class:`Target`: a base model (hub id, folder or ``builtin:tiny-qwen2``)
and optionally what fine-tuning produced, given as a local folder, ``runs:/<run_id>[/<path>]``
(the adapter a training run logged; ``adapter`` when no path is given) or
``models:/<name>/<version>`` / ``models:/<name>@<alias>`` (a registered version; its ``source``
is downloaded, with ``runs:/<run_id>/adapter`` as the fallback). The folder is a PEFT adapter or,
after full fine-tuning, a whole model. When it comes from a training run, the base model, task,
system prompt and eval split are read from that run's params unless given.

Answers are greedy (no sampling, one beam) with the KV cache, in batches of prompts rendered by
the model's chat template exactly as in training and left-padded, stopping at end-of-turn or
``max_new_tokens``. Prompts are batched longest first, so a batch holds prompts of similar
length; the batches are fixed before generation, so one process and several Ray Data actors
(``workers``) generate the same batches and give the same answers.
"""

from __future__ import annotations

import contextlib
import csv
import json
import logging
import math
import os
import resource
import shutil
import socket
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import torch

from zerolab.tasks import TASKS, get_task

logger = logging.getLogger("zerolab.evaluate")

GIB = 1024**3
Device = Literal["auto", "cpu", "cuda"]
DType = Literal["auto", "bf16", "fp16", "fp32"]
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

ACCURACY_KEY = {"math_sum": "correct", "ner_json": "exact_match", "custom": "exact_match"}
"""The per-task score reported as ``eval/accuracy``: math_sum counts an answer right when it has
the prefix and a + b = x; ner_json and custom when the answer equals the reference."""

PERF_KEYS = ("wall_s", "load_s", "generate_s", "tokens_per_s", "generated_tokens", "gpu_peak_load_gib",
             "gpu_peak_generate_gib", "host_rss_gib", "host_rss_peak_gib")


class EvaluationError(ValueError):
    """What to evaluate cannot be found or used as given; the message says what to do."""


# --- what to evaluate ------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadSpec:
    """How to load one model under evaluation; crosses into Ray actors as a dict."""

    name_or_path: str
    """The base model, or the folder of a fully fine-tuned model."""
    adapter_path: str | None = None
    """A PEFT adapter folder applied on top of ``name_or_path``."""
    merge: bool = False
    """Merge the adapter into the base weights after loading (peft's ``merge_and_unload``)."""
    revision: str | None = None
    trust_remote_code: bool = False
    attn_implementation: str = "sdpa"


@dataclass
class Target:
    """A base model and, optionally, what fine-tuning made of it, with what is known about its origin."""

    base: str | None
    tuned_path: str | None = None
    tuned_kind: Literal["adapter", "full"] | None = None
    source: str | None = None
    """The reference the tuned model came from, as given (a folder, ``runs:/...`` or ``models:/...``)."""
    run_id: str | None = None
    """The training run that produced it, when known."""
    run_params: dict[str, str] = field(default_factory=dict)
    run_name: str | None = None
    experiment_id: str | None = None

    def param(self, key: str) -> str | None:
        """A training-run param, None when missing or empty (MLflow stores None as '')."""
        value = self.run_params.get(key)
        return value if value else None

    def tuned_spec(self, *, merge: bool = False) -> LoadSpec | None:
        if self.tuned_path is None:
            return None
        if self.tuned_kind == "full":
            if merge:
                raise EvaluationError(f"--merge: {self.source} is a fully fine-tuned model, not an adapter; there is nothing to merge (drop --merge)")
            return LoadSpec(name_or_path=self.tuned_path)
        assert self.base is not None, "an adapter target always knows its base model"
        return LoadSpec(name_or_path=self.base, adapter_path=self.tuned_path, merge=merge)

    def base_spec(self) -> LoadSpec | None:
        return LoadSpec(name_or_path=self.base) if self.base else None


def resolve_target(adapter: str | None, model: str | None, tracking_uri: str, download_dir: str | Path) -> Target:
    """Find the tuned model named by ``adapter`` (downloading it from MLflow into ``download_dir``
    when it is a ``runs:/`` or ``models:/`` reference) and its base model. Raises EvaluationError."""
    if adapter is None:
        if model is None:
            raise EvaluationError("nothing to evaluate: give --adapter (a folder, runs:/<run_id> or models:/<name>/<version>) and/or --model")
        return Target(base=model)
    download_dir = Path(download_dir)
    run_id = None
    if adapter.startswith("runs:/"):
        run_id, _, artifact = adapter[len("runs:/"):].strip("/").partition("/")
        if not run_id:
            raise EvaluationError(f"--adapter {adapter}: no run id; write runs:/<run_id> (the adapter a training run logged) or runs:/<run_id>/<artifact path>")
        run = _get_run(tracking_uri, run_id, adapter)
        folder = _download(f"runs:/{run_id}/{artifact or 'adapter'}", tracking_uri, download_dir / "adapter", adapter)
    elif adapter.startswith("models:/"):
        folder, run_id = _download_model_version(adapter, tracking_uri, download_dir)
        run = _get_run(tracking_uri, run_id, adapter) if run_id else None
    elif "://" in adapter or adapter.startswith(("runs:", "models:")):
        raise EvaluationError(f"--adapter {adapter}: unsupported reference; use a local folder, runs:/<run_id>[/<path>], models:/<name>/<version> or models:/<name>@<alias>")
    else:
        folder = Path(adapter).expanduser()
        if not folder.is_dir():
            raise EvaluationError(f"--adapter {adapter}: no such folder; give the adapter folder a training run saved (<run.storage_path>/<run.name>/checkpoint_*/adapter), runs:/<run_id> or models:/<name>/<version>")
        run = None
    tuned, kind = _find_model_folder(folder, adapter)
    params = dict(run.data.params) if run is not None else {}
    base = model or params.get("model.name_or_path") or None
    if base is None and kind == "adapter":
        base = json.loads((tuned / "adapter_config.json").read_text()).get("base_model_name_or_path")
        if not base:
            raise EvaluationError(f"--adapter {adapter}: its adapter_config.json names no base model; give it with --model")
    return Target(base=base, tuned_path=str(tuned), tuned_kind=kind, source=adapter, run_id=run_id, run_params=params,
                  run_name=run.info.run_name if run is not None else None,
                  experiment_id=run.info.experiment_id if run is not None else None)


def _get_run(uri: str, run_id: str, ref: str) -> Any:
    from zerolab import tracking

    try:
        return tracking.get_run(uri, run_id)
    except tracking.NotInStore as exc:
        raise EvaluationError(
            f"--adapter {ref}: there is no MLflow run '{run_id}' in {uri} ({exc}); check the run id "
            f"(`mlflow ui --backend-store-uri {uri}` lists the runs) or point --tracking-uri / MLFLOW_TRACKING_URI at the store that holds it"
        ) from None


def _download(artifact_uri: str, uri: str, dst: Path, ref: str) -> Path:
    from zerolab import tracking

    try:
        return tracking.download(artifact_uri, uri, dst)
    except tracking.NotInStore as exc:
        raise EvaluationError(
            f"--adapter {ref}: could not download {artifact_uri} ({exc}); the run may have logged no adapter "
            "(it failed or was stopped before the end), or the artifact path differs: give it as runs:/<run_id>/<path>"
        ) from None


def _download_model_version(ref: str, uri: str, download_dir: Path) -> tuple[Path, str | None]:
    """Download a registered version's ``source``, falling back to ``runs:/<run_id>/adapter``."""
    from zerolab import tracking

    body = ref[len("models:/"):].strip("/")
    alias: str | None = None
    version: str | None = None
    if "@" in body:
        name, alias = body.split("@", 1)
    else:
        name, _, version = body.rpartition("/")
        if not name or not version:
            raise EvaluationError(f"--adapter {ref}: write models:/<name>/<version> or models:/<name>@<alias>")
    try:
        mv = tracking.model_version(uri, name, version=version, alias=alias)
    except tracking.NotInStore as exc:
        raise EvaluationError(
            f"--adapter {ref}: no such registered model version in {uri} ({exc}); check the name and version "
            "or alias in the MLflow UI's Models page, or point --tracking-uri at the right store"
        ) from None
    tries = [mv.source] if mv.source else []
    if mv.run_id:
        tries.append(f"runs:/{mv.run_id}/adapter")
    for i, artifact_uri in enumerate(tries):
        try:
            folder = _download(artifact_uri, uri, download_dir / f"version-{i}", ref)
            _find_model_folder(folder, ref)
            return folder, mv.run_id or None
        except EvaluationError as exc:
            logger.warning("%s: %s", ref, exc)
    raise EvaluationError(f"--adapter {ref}: version {mv.version} of '{mv.name}' has no loadable adapter or model at {' or '.join(tries) or 'any source'}")


def _find_model_folder(folder: Path, ref: str) -> tuple[Path, Literal["adapter", "full"]]:
    """The folder (``folder`` or one below it) holding a PEFT adapter or a whole HF model."""
    candidates = [folder, *sorted(p for p in folder.rglob("*") if p.is_dir() and len(p.relative_to(folder).parts) <= 2)]
    for path in candidates:
        if (path / "adapter_config.json").is_file():
            return path, "adapter"
    for path in candidates:
        if (path / "config.json").is_file() and (any(path.glob("*.safetensors")) or any(path.glob("*.bin"))):
            return path, "full"
    raise EvaluationError(
        f"--adapter {ref}: {folder} holds neither a PEFT adapter (adapter_config.json) nor a saved model (config.json + weights); "
        "point it at the adapter folder a training run saved"
    )


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
    from zerolab.data import DataError, RowError, list_data_files, parse_file, prompt_and_target

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
    from zerolab.models import cache_dir
    from zerolab.tasks import generate_dataset

    spec = get_task(task)
    if spec.generate is None:
        raise EvaluationError(f"--data: task '{task}' has no generator; give the eval file with --data")
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
        raise EvaluationError("--device cuda: this machine has no CUDA GPU; use --device cpu (or auto)")
    return device


def resolve_dtype(dtype: DType, device: str) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device == "cuda" else torch.float32
    if dtype == "fp16" and device == "cpu":
        raise EvaluationError("--dtype fp16: half precision generation needs a GPU; use fp32 or bf16 on CPU")
    return _DTYPES[dtype]


class Generator:
    """One loaded model that answers chat prompts greedily, in batches, and measures itself.

    Also the Ray Data ``map_batches`` callable: each input row is one planned batch
    (``batch_id``, ``messages`` as JSON), each output row its answers and this process's figures.
    """

    def __init__(self, spec: dict[str, Any], *, device: str, dtype: str, max_new_tokens: int, batch_size: int = 1,
                 adapter_files: dict[str, bytes] | None = None) -> None:
        from zerolab.config import ModelSpec
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
        model_spec = ModelSpec(name_or_path=self.spec.name_or_path, revision=self.spec.revision,
                               trust_remote_code=self.spec.trust_remote_code, attn_implementation=self.spec.attn_implementation)  # type: ignore[arg-type]
        self.tokenizer = load_tokenizer(model_spec)
        self.tokenizer.padding_side = "left"
        model = load_model(model_spec, _DTYPES[dtype])
        if self.spec.adapter_path is not None:
            model = _apply_adapter(model, self.spec.adapter_path, merge=self.spec.merge)
        self.model = model.to(self.device).eval()
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


def _apply_adapter(model: torch.nn.Module, adapter_path: str, *, merge: bool) -> torch.nn.Module:
    from peft import PeftModel

    from zerolab.models import ModelLoadError

    try:
        peft_model = PeftModel.from_pretrained(model, adapter_path)
    except (OSError, ValueError, RuntimeError, KeyError) as exc:
        raise ModelLoadError(
            f"could not apply the adapter in {adapter_path} to the base model ({type(exc).__name__}: {_first_line(exc)}); "
            "check that --model is the model the adapter was trained on"
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

    from zerolab.data import quiet_ray_data_logging

    quiet_ray_data_logging()
    kind = "GPU" if device == "cuda" else "CPU"
    have = ray.cluster_resources().get(kind, 0)
    if have < workers:
        # Ray Data would wait for actors that can never be placed.
        raise EvaluationError(f"--workers {workers}: each generation actor takes one {kind} and the Ray cluster has {have:g}; "
                              f"use --workers {int(have)} or fewer, or add nodes")
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


# --- scoring -----------------------------------------------------------------------------------


def score_answers(task: str, examples: Sequence[Example], answers: Sequence[str]) -> tuple[list[dict[str, float]], dict[str, float]]:
    """Per-example scores from the task's scorer plus generic exact match, and their summary with
    ``accuracy`` (the task's headline score, see ACCURACY_KEY)."""
    spec = get_task(task)
    per_example = []
    for example, answer in zip(examples, answers):
        scores = dict(spec.score(example.prompt, example.reference, answer))
        scores.setdefault("exact_match", float(answer.strip() == example.reference.strip()))
        per_example.append(scores)
    summary = dict(spec.summarize(per_example))
    if "exact_match" not in summary:
        summary["exact_match"] = sum(s["exact_match"] for s in per_example) / max(len(per_example), 1)
    summary["accuracy"] = summary[ACCURACY_KEY[task]]
    return per_example, summary


# --- one evaluation ----------------------------------------------------------------------------


@dataclass(frozen=True)
class EvalOptions:
    task: str
    data_path: str
    num_examples: int | None = None
    """The first N rows of the eval file; None: all."""
    system_prompt: str | None = None
    batch_size: int = 16
    max_new_tokens: int = 64
    compare_base: bool = False
    merge: bool = False
    workers: int = 0
    """0: generate in this process; N: on N Ray Data actors (one GPU each on cuda)."""
    device: Device = "auto"
    dtype: DType = "auto"


@dataclass
class ModelResult:
    label: str
    """``base`` or ``tuned``."""
    description: str
    answers: Answers
    scores: list[dict[str, float]]
    summary: dict[str, float]

    def metrics(self) -> dict[str, float]:
        return {**self.summary, **self.answers.figures}


@dataclass
class EvalReport:
    task: str
    data_path: str
    examples: list[Example]
    results: dict[str, ModelResult]
    """``tuned`` and/or ``base``, in the order they ran."""
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def primary(self) -> ModelResult:
        """The model the evaluation is about: the tuned one when there is one."""
        return self.results.get("tuned") or self.results["base"]

    def metrics(self, prefix: str = "eval") -> dict[str, float]:
        """``eval/<k>`` for the primary model; with both models also ``eval/base/<k>``,
        ``eval/tuned/<k>`` and ``eval/delta/<k>`` (tuned minus base)."""
        out = {f"{prefix}/{k}": v for k, v in self.primary.metrics().items()}
        if len(self.results) > 1:
            for label, result in self.results.items():
                out.update({f"{prefix}/{label}/{k}": v for k, v in result.metrics().items()})
            base, tuned = self.results["base"].metrics(), self.results["tuned"].metrics()
            out.update({f"{prefix}/delta/{k}": tuned[k] - base[k] for k in tuned if k in base})
        return out

    def table(self) -> list[dict[str, Any]]:
        """One row per example: prompt, reference, and each model's answer, scores and token count."""
        rows = []
        for i, example in enumerate(self.examples):
            row: dict[str, Any] = {"index": example.index, "prompt": example.prompt, "reference": example.reference}
            for label, result in self.results.items():
                row[f"{label}_answer"] = result.answers.texts[i]
                row.update({f"{label}_{k}": v for k, v in result.scores[i].items()})
                row[f"{label}_num_tokens"] = result.answers.num_tokens[i]
            rows.append(row)
        return rows

    def format(self) -> str:
        """The side-by-side summary a person reads: scores first, then speed and memory."""
        labels = list(self.results)
        both = len(labels) > 1
        head = f"{'':<24}" + "".join(f"{label:>12}" for label in labels) + (f"{'delta':>12}" if both else "")
        lines = [f"task {self.task}: {len(self.examples)} prompts from {self.data_path}",
                 *(f"  {label}: {r.description}" for label, r in self.results.items()), head]
        summary_keys = [k for k in self.primary.summary if k != "accuracy"]
        keys = ["accuracy", *summary_keys, *(k for k in PERF_KEYS if k in self.primary.answers.figures)]
        for key in keys:
            values = [self.results[label].metrics().get(key, math.nan) for label in labels]
            line = f"{key:<24}" + "".join(f"{v:>12.4g}" for v in values)
            if both:  # base ran first
                line += f"{values[1] - values[0]:>+12.4g}"
            lines.append(line)
        return "\n".join(lines)

    def write(self, folder: str | Path) -> list[Path]:
        """``examples.jsonl``, ``examples.csv`` and ``summary.json`` in ``folder``."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        rows = self.table()
        with (folder / "examples.jsonl").open("w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        with (folder / "examples.csv").open("w", encoding="utf-8", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        summary = {"task": self.task, "data_path": self.data_path, "num_examples": len(self.examples), "options": self.options,
                   "models": {label: r.description for label, r in self.results.items()}, "metrics": self.metrics()}
        (folder / "summary.json").write_text(json.dumps(summary, indent=2, ensure_ascii=False), encoding="utf-8")
        return [folder / "examples.jsonl", folder / "examples.csv", folder / "summary.json"]


def run_evaluation(target: Target, options: EvalOptions) -> EvalReport:
    """Generate and score the answers of the tuned model (and, with ``compare_base``, of the base
    model first) on the same prompts."""
    if options.task not in TASKS:
        raise EvaluationError(f"--task {options.task}: unknown task; choose one of {', '.join(TASKS)}")
    if options.compare_base and (target.tuned_path is None or target.base is None):
        raise EvaluationError("--compare-base: needs both a tuned model (--adapter) and its base model (--model, or a training run that names it)")
    device = resolve_device(options.device)
    dtype = {v: k for k, v in _DTYPES.items()}[resolve_dtype(options.dtype, device)]
    examples = load_examples(options.data_path, options.task, system_prompt=options.system_prompt, limit=options.num_examples)
    tuned = target.tuned_spec(merge=options.merge)
    runs: list[tuple[str, LoadSpec, str]] = []
    if options.compare_base or tuned is None:
        runs.append(("base", target.base_spec(), str(target.base)))  # type: ignore[arg-type]
    if tuned is not None:
        what = f"{'merged ' if tuned.merge else ''}adapter {target.source} on {target.base}" if target.tuned_kind == "adapter" \
            else f"fully fine-tuned model {target.source}"
        runs.append(("tuned", tuned, what))
    results = {}
    for label, spec, description in runs:
        logger.info("evaluating %s (%s) on %d prompts", label, description, len(examples))
        answers = generate_answers(spec, examples, batch_size=options.batch_size, max_new_tokens=options.max_new_tokens,
                                   device=device, dtype=dtype, workers=options.workers)
        scores, summary = score_answers(options.task, examples, answers.texts)
        results[label] = ModelResult(label=label, description=description, answers=answers, scores=scores, summary=summary)
    return EvalReport(task=options.task, data_path=options.data_path, examples=examples, results=results,
                      options={**asdict(options), "device": device, "dtype": dtype})


def options_for(target: Target, *, task: str | None = None, data_path: str | None = None, **kwargs: Any) -> EvalOptions:
    """EvalOptions with the task, eval file and system prompt taken from the training run of
    ``target`` where not given: its ``data.task``, its ``data.eval_path`` (when that file is
    here), else the generated eval split its run held out."""
    task = task or target.param("data.task")
    if task is None:
        raise EvaluationError(f"--task: not given and not known from a training run; choose one of {', '.join(TASKS)}")
    if task not in TASKS:
        raise EvaluationError(f"--task {task}: unknown task; choose one of {', '.join(TASKS)}")
    if data_path is None:
        run_eval = target.param("data.eval_path")
        if run_eval and ("://" in run_eval or Path(run_eval).expanduser().exists()):
            data_path = run_eval
        else:
            if run_eval:
                logger.warning("the run's eval file %s is not on this machine; using the task's generated eval split", run_eval)
            data_path = default_eval_path(task, int(target.param("data.num_eval_rows") or 200), int(target.param("data.seed") or 0) + 1)
    elif "://" not in data_path and not Path(data_path).expanduser().exists():
        raise EvaluationError(f"--data {data_path}: no such file or folder; give a JSON/JSONL/Parquet eval file")
    return EvalOptions(task=task, data_path=data_path, system_prompt=target.param("data.system_prompt"), **kwargs)


# --- MLflow --------------------------------------------------------------------------------------


def log_report(report: EvalReport, uri: str, run_id: str, *, step: int = 0) -> None:
    """Metrics (``eval/*``), the per-example table (``mlflow.log_table``: ``eval/examples.json``)
    and the files of :meth:`EvalReport.write` (under ``eval/``) into the MLflow run ``run_id``."""
    from zerolab import tracking

    tracking.MetricsLogger(uri, run_id).log({k: v for k, v in report.metrics().items() if math.isfinite(v)}, step=step)
    rows = report.table()
    tracking.log_table(uri, run_id, {k: [row[k] for row in rows] for k in rows[0]}, "eval/examples.json")
    with tempfile.TemporaryDirectory() as tmp:
        report.write(tmp)
        tracking.log_artifact(uri, run_id, tmp, "eval")


def log_eval_run(report: EvalReport, target: Target, uri: str, *, experiment: str | None = None, run_name: str | None = None) -> str:
    """Record a standalone evaluation as its own MLflow run (tagged with the training run it
    evaluates) in ``experiment``, else the training run's experiment, else ``zerolab``; returns its id."""
    from zerolab import tracking

    if experiment is None:
        experiment = tracking.mlflow_client(uri).get_experiment(target.experiment_id).name if target.experiment_id else "zerolab"
    run_name = run_name or default_run_name(target)
    tags = {"zerolab.kind": "eval", "task": report.task, "model": str(target.base)}
    if target.run_id:
        tags["zerolab.source_run_id"] = target.run_id
    with tracking.tracked_run(uri, experiment, run_name, tags=tags, new=True) as run:
        params = {f"eval.{k}": v for k, v in report.options.items()}
        params.update({"eval.base_model": target.base, "eval.tuned": target.source, "eval.num_prompts": len(report.examples)})
        run.log_params(params)
        log_report(report, uri, run.run_id)
        run.status = "FINISHED"
    return run.run_id


def default_run_name(target: Target) -> str:
    """``eval-<training run name>``, else ``eval-<adapter or model folder name>``, as MLflow and folders accept it."""
    import re

    what = target.run_name or Path(str(target.source or target.base).rstrip("/")).name
    return re.sub(r"[^A-Za-z0-9._-]+", "-", f"eval-{what}")[:128]


def evaluate_after_training(cfg: Any, uri: str, run_id: str, tuned_folder: str | Path, *, step: int = 0) -> EvalReport:
    """The ``eval`` section of a training job: evaluate what was just trained (against its base
    with ``eval.compare_base``) on the job's eval split and log it into the training run."""
    from zerolab.data import dataset_paths

    e = cfg.eval
    tuned, kind = _find_model_folder(Path(tuned_folder), str(tuned_folder))
    target = Target(base=cfg.model.name_or_path, tuned_path=str(tuned), tuned_kind=kind, source=str(tuned_folder), run_id=run_id)
    # The driver of a GPU job may have no GPU: generate on GPU actors then.
    workers = e.num_workers if cfg.scaling.use_gpu or e.num_workers > 1 else 0
    options = EvalOptions(task=cfg.data.task, data_path=dataset_paths(cfg)["eval"], num_examples=e.num_examples or None,
                          system_prompt=cfg.data.system_prompt, batch_size=e.batch_size, max_new_tokens=e.max_new_tokens,
                          compare_base=e.compare_base, merge=False, workers=workers, device="cuda" if cfg.scaling.use_gpu else "cpu",
                          dtype=cfg.precision())
    report = run_evaluation(target, options)
    log_report(report, uri, run_id, step=step)
    logger.info("evaluation after training:\n%s", report.format())
    return report


# --- merged export -------------------------------------------------------------------------------


def export_merged(target: Target, output: str | Path, *, dtype: DType = "auto", overwrite: bool = False) -> dict[str, Any]:
    """Merge the adapter of ``target`` into its base weights and save a model folder that
    ``AutoModelForCausalLM.from_pretrained`` loads (weights as safetensors, config, generation
    config, tokenizer). The folder is reloaded and checked against the unmerged model's logits.
    Returns what was written and the check's figures."""
    from transformers import AutoModelForCausalLM

    from zerolab.config import ModelSpec
    from zerolab.models import load_model, load_tokenizer

    output = Path(output).expanduser()
    if target.tuned_kind != "adapter":
        raise EvaluationError(f"--adapter {target.source}: export merges an adapter, but this is a fully fine-tuned model folder that already loads as is")
    if output.exists() and any(output.iterdir()) and not overwrite:
        raise EvaluationError(f"--output {output}: the folder exists and is not empty; choose a new folder or pass --overwrite")
    assert target.base is not None and target.tuned_path is not None
    spec = ModelSpec(name_or_path=target.base)
    torch_dtype = _saved_dtype(spec) if dtype == "auto" else _DTYPES[dtype]
    tokenizer = load_tokenizer(spec)
    model = _apply_adapter(load_model(spec, torch_dtype), target.tuned_path, merge=False).eval()
    probe = _probe_ids(tokenizer)
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
        raise EvaluationError(f"--output {output}: the merged model's logits differ from the adapter's (max |diff| {max_diff:.3g}, "
                              f"next-token agreement {agreement:.1%}); the adapter method may not merge exactly")
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


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
