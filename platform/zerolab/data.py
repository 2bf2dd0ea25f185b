"""Data: read, validate, render and tokenize with Ray Data on the driver; batch on the workers.

Driver side (:func:`prepare_split`): Ray Data reads each file (JSON array, JSONL or Parquet, via
pyarrow), turns every row into chat messages (instruction/input/output, NER text/label with the
label serialised to JSON, or ``messages``), renders them with the tokenizer's chat template,
tokenizes prompt and response separately and masks prompt tokens with -100. Malformed rows are
kept with an ``error`` and their file and line, counted, and reported; the job fails when their
fraction exceeds ``data.max_bad_fraction``. The good rows are materialized once.

Worker side: :class:`ShardedDataConfig` splits the materialized dataset deterministically, so
every rank gets the same rows on every attempt; :class:`MicroBatches` shuffles the shard per epoch
from the seed and yields micro-batches padded to their own longest row (or packed), never to a
fixed length. The position in that stream is a single integer, so a resumed run continues
exactly where the checkpoint was taken.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from zerolab.batches import IGNORE_INDEX
from zerolab.config import SFTConfig

logger = logging.getLogger(__name__)

SUPPORTED_SUFFIXES = (".json", ".jsonl", ".parquet")
_MAX_EXAMPLES = 20


class DataError(ValueError):
    """The data cannot be used as given; the message is the report a user needs to fix it."""


class RowError(ValueError):
    """One row is malformed. ``str(exc)`` is '<category>: <detail>'."""


def quiet_ray_data_logging() -> None:
    """Keep Ray Data's warnings but not its per-dataset INFO lines (a dozen per job) nor the notice
    that progress bars are off (zerolab prints its own data summary)."""
    import ray.data

    ray.data.DataContext.get_current().enable_progress_bars = False
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)


# --- files -------------------------------------------------------------------------------------


def list_data_files(path: str) -> list[str]:
    """The data files under ``path`` (a file or a folder), sorted; URIs are passed through."""
    if "://" in path:
        return [path]
    p = Path(path).expanduser().resolve()
    if p.is_dir():
        files = sorted(str(f) for f in p.rglob("*") if f.suffix in SUPPORTED_SUFFIXES and f.is_file())
        if not files:
            raise DataError(f"{path}: the folder holds no {', '.join(SUPPORTED_SUFFIXES)} files")
        return files
    if not p.is_file():
        raise DataError(f"{path}: no such file or folder; check the path")
    if p.suffix not in SUPPORTED_SUFFIXES:
        raise DataError(f"{path}: unsupported file type '{p.suffix}'; use {', '.join(SUPPORTED_SUFFIXES)}")
    return [str(p)]


def fingerprint(files: list[str]) -> str:
    """sha256 over the files' names and bytes (local files only; URIs hash their names)."""
    h = hashlib.sha256()
    for f in files:
        h.update(Path(f).name.encode())
        if "://" not in f:
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
    return h.hexdigest()


def parse_file(row: dict[str, Any]) -> list[dict[str, Any]]:
    """One file (``{"path", "bytes"}``) -> one row per record: path, line, record (JSON text), error."""
    path, data = row["path"], row["bytes"]
    name = path.rsplit("/", 1)[-1]
    out: list[dict[str, Any]] = []

    def emit(line: int, record: Any = None, error: str | None = None) -> None:
        if error is None and not isinstance(record, dict):
            error = f"not an object: expected a JSON object per row, got {type(record).__name__}"
        text = json.dumps(record, ensure_ascii=False) if error is None else ""
        out.append({"path": name, "line": line, "record": text, "error": error})

    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(pa.BufferReader(data))
        except pa.ArrowException as exc:
            emit(0, error=f"unreadable file: not a Parquet file ({exc})")
            return out
        for i, record in enumerate(table.to_pylist(), start=1):
            emit(i, record)
        return out

    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        emit(0, error=f"unreadable file: not UTF-8 text ({exc})")
        return out
    if text.lstrip().startswith("["):
        _parse_json_array(text, emit)
    else:
        for i, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                emit(i, json.loads(line))
            except json.JSONDecodeError as exc:
                emit(i, error=f"invalid JSON: {exc.msg} at column {exc.colno}")
    return out


def _parse_json_array(text: str, emit: Any) -> None:
    """Walk a JSON array element by element so each row keeps the line it starts on."""
    decoder = json.JSONDecoder()
    i = text.index("[") + 1
    n = len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n:
            emit(text.count("\n", 0, n) + 1, error="invalid JSON: the array is not closed with ']'")
            return
        if text[i] == "]":
            return
        line = text.count("\n", 0, i) + 1
        try:
            record, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError as exc:
            # The rest of the array cannot be located reliably after a syntax error.
            emit(line, error=f"invalid JSON: {exc.msg} (the rest of the file from here was not read)")
            return
        emit(line, record)


# --- rows -> messages -> tokens ----------------------------------------------------------------


def row_to_messages(record: dict[str, Any], system_prompt: str) -> list[dict[str, str]]:
    """Chat messages for one row in any of the supported formats; raises RowError."""
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise RowError("wrong type: 'messages' must be a non-empty list of {role, content}")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise RowError("wrong type: every message needs a string 'role' and a string 'content'")
            if m["role"] not in ("system", "user", "assistant"):
                raise RowError(f"wrong type: unknown role '{m['role']}'; use system, user or assistant")
        if messages[-1]["role"] != "assistant":
            raise RowError("missing target: the last message must be the assistant's answer")
        if not any(m["role"] == "assistant" and m["content"].strip() for m in messages):
            raise RowError("empty target: every assistant message is empty")
        if messages[0]["role"] != "system" and system_prompt:
            messages = [{"role": "system", "content": system_prompt}, *messages]
        return [{"role": m["role"], "content": m["content"]} for m in messages]

    if "instruction" in record or "output" in record:
        instruction, extra, output = record.get("instruction"), record.get("input", ""), record.get("output")
        for key, value in (("instruction", instruction), ("output", output)):
            if value is None:
                raise RowError(f"missing field: '{key}'")
            if not isinstance(value, str):
                raise RowError(f"wrong type: '{key}' must be a string, got {type(value).__name__}")
        if extra is None:
            extra = ""
        if not isinstance(extra, str):
            raise RowError(f"wrong type: 'input' must be a string, got {type(extra).__name__}")
        if not output.strip():
            raise RowError("empty target: 'output' is empty")
        user = f"{instruction}\n{extra}" if extra else instruction
        return _with_system(system_prompt, user, output)

    if "text" in record or "label" in record:
        text, label = record.get("text"), record.get("label")
        if text is None:
            raise RowError("missing field: 'text'")
        if label is None:
            raise RowError("missing field: 'label'")
        if not isinstance(text, str):
            raise RowError(f"wrong type: 'text' must be a string, got {type(text).__name__}")
        if not text.strip():
            raise RowError("empty prompt: 'text' is empty")
        if isinstance(label, str):
            target = label
        elif isinstance(label, dict):
            target = json.dumps(label, ensure_ascii=False)
        else:
            raise RowError(f"wrong type: 'label' must be an object of entity lists (or a string), got {type(label).__name__}")
        if not target.strip():
            raise RowError("empty target: 'label' is empty")
        return _with_system(system_prompt, text, target)

    keys = ", ".join(sorted(record)) or "none"
    raise RowError(f"unknown format: expected 'messages', 'instruction'/'output' or 'text'/'label' fields, found {keys}")


def _with_system(system_prompt: str, user: str, assistant: str) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return [*messages, {"role": "user", "content": user}, {"role": "assistant", "content": assistant}]


def prompt_and_target(record: dict[str, Any], system_prompt: str) -> tuple[list[dict[str, str]], str]:
    """The messages up to the last assistant turn, and that turn's text (the reference answer)."""
    messages = row_to_messages(record, system_prompt)
    return messages[:-1], messages[-1]["content"]


def tokenize_messages(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """input_ids and labels: assistant turns (through their end-of-turn token) are targets, the rest -100.

    Each prompt span is the text ``apply_chat_template(..., add_generation_prompt=True)`` renders,
    tokenized as one piece exactly as at inference; each answer span is tokenized on its own.
    """
    ids: list[int] = []
    labels: list[int] = []
    done = ""
    eos = tokenizer.eos_token_id
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        full = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not prompt.startswith(done) or not full.startswith(prompt):
            raise RowError("template: the chat template does not render turns as prefixes of each other")
        span = tokenizer(prompt[len(done):], add_special_tokens=False)["input_ids"]
        ids += span
        labels += [IGNORE_INDEX] * len(span)
        answer = tokenizer(full[len(prompt):], add_special_tokens=False)["input_ids"]
        # Train through the end-of-turn token, not on the template's text after it.
        cut = answer.index(eos) + 1 if eos in answer else len(answer)
        ids += answer
        labels += answer[:cut] + [IGNORE_INDEX] * (len(answer) - cut)
        done = full
    return ids, labels


@functools.lru_cache(maxsize=4)
def _cached_tokenizer(name_or_path: str, revision: str | None, trust_remote_code: bool) -> Any:
    from zerolab.config import ModelSpec
    from zerolab.models import load_tokenizer

    return load_tokenizer(ModelSpec(name_or_path=name_or_path, revision=revision, trust_remote_code=trust_remote_code))


def tokenize_batch(batch: pa.Table, *, model: dict[str, Any], system_prompt: str, max_seq_length: int) -> pa.Table:
    """Ray Data ``map_batches`` function: records -> input_ids/labels, or an error per row."""
    tokenizer = _cached_tokenizer(model["name_or_path"], model["revision"], model["trust_remote_code"])
    cols: dict[str, list[Any]] = {k: [] for k in ("input_ids", "labels", "num_tokens", "num_target_tokens", "error")}
    for text, error in zip(batch.column("record").to_pylist(), batch.column("error").to_pylist()):
        ids: list[int] = []
        labels: list[int] = []
        if error is None:
            try:
                ids, labels = tokenize_messages(tokenizer, row_to_messages(json.loads(text), system_prompt))
                if len(ids) > max_seq_length:
                    raise RowError(f"too long: {len(ids)} tokens > data.max_seq_length={max_seq_length}")
                if not any(label != IGNORE_INDEX for label in labels):
                    raise RowError("empty target: the answer has no tokens")
            except RowError as exc:
                error, ids, labels = str(exc), [], []
        cols["input_ids"].append(ids)
        cols["labels"].append(labels)
        cols["num_tokens"].append(len(ids))
        cols["num_target_tokens"].append(sum(1 for label in labels if label != IGNORE_INDEX))
        cols["error"].append(error)
    ints = pa.list_(pa.int32())
    return pa.table(
        {
            "path": batch.column("path"),
            "line": batch.column("line"),
            "input_ids": pa.array(cols["input_ids"], type=ints),
            "labels": pa.array(cols["labels"], type=ints),
            "num_tokens": pa.array(cols["num_tokens"], type=pa.int32()),
            "num_target_tokens": pa.array(cols["num_target_tokens"], type=pa.int32()),
            "error": pa.array(cols["error"], type=pa.string()),
        }
    )


# --- driver: one split end to end -----------------------------------------------------------------


@dataclass
class SplitReport:
    """What one split's files held: counts, bad rows by reason with file:line examples, token stats."""

    split: str
    files: list[str]
    fingerprint: str
    rows_read: int = 0
    rows_used: int = 0
    rows_bad: int = 0
    bad_by_reason: dict[str, int] = field(default_factory=dict)
    bad_examples: list[str] = field(default_factory=list)
    tokens: int = 0
    target_tokens: int = 0
    max_tokens: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        line = f"{self.split}: {self.rows_used}/{self.rows_read} rows used, {self.tokens} tokens ({self.target_tokens} target)"
        if self.rows_bad:
            reasons = ", ".join(f"{k}: {v}" for k, v in sorted(self.bad_by_reason.items()))
            line += f"; {self.rows_bad} bad rows ({reasons})"
        return line


def prepare_split(split: str, path: str, cfg: SFTConfig, model_path: str) -> tuple[Any, SplitReport]:
    """Read, validate and tokenize one split with Ray Data; return (materialized dataset, report).

    Raises DataError with the full report when the split has no usable rows or its fraction of
    bad rows exceeds ``data.max_bad_fraction``.
    """
    import ray
    import ray.data
    from ray.data.expressions import col

    from zerolab.tasks import get_task

    files = list_data_files(path)
    report = SplitReport(split=split, files=[Path(f).name for f in files], fingerprint=fingerprint(files))
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True  # row order, and so the shards, are reproducible
    system_prompt = cfg.data.system_prompt if cfg.data.system_prompt is not None else get_task(cfg.data.task).system_prompt
    model = {"name_or_path": model_path, "revision": cfg.model.revision, "trust_remote_code": cfg.model.trust_remote_code}

    # Local files exist on this node only: read them here (files on shared storage need no pinning).
    here = None if any("://" in f for f in files) else {"ray.io/node-id": ray.get_runtime_context().get_node_id()}
    ds = ray.data.read_binary_files(files, include_paths=True, label_selector=here)
    ds = ds.flat_map(parse_file)
    ds = ds.map_batches(
        tokenize_batch,
        batch_format="pyarrow",
        batch_size=512,
        fn_kwargs={"model": model, "system_prompt": system_prompt, "max_seq_length": cfg.data.max_seq_length},
    ).materialize()

    stats = ds.select_columns(["path", "line", "error", "num_tokens", "num_target_tokens"]).to_arrow_refs()
    bad: list[tuple[str, int, str]] = []
    for table in ray.get(stats):
        report.rows_read += table.num_rows
        errors = table.column("error").to_pylist()
        ok = pa.array([e is None for e in errors])
        good = table.filter(ok)
        report.tokens += int(pa.compute.sum(good.column("num_tokens")).as_py() or 0)
        report.target_tokens += int(pa.compute.sum(good.column("num_target_tokens")).as_py() or 0)
        report.max_tokens = max(report.max_tokens, int(pa.compute.max(good.column("num_tokens")).as_py() or 0))
        for p, ln, e in zip(table.column("path").to_pylist(), table.column("line").to_pylist(), errors):
            if e is not None:
                bad.append((p, ln, e))
    report.rows_bad = len(bad)
    report.rows_used = report.rows_read - report.rows_bad
    report.bad_by_reason = dict(Counter(e.split(":", 1)[0] for _, _, e in bad))
    report.bad_examples = [f"{p}:{ln}: {e}" for p, ln, e in bad[:_MAX_EXAMPLES]]

    key = "data.train_path" if split == "train" else "data.eval_path"
    if report.rows_used == 0:
        raise DataError(_bad_rows_message(key, report, cfg, "no usable rows"))
    if report.rows_bad / report.rows_read > cfg.data.max_bad_fraction:
        raise DataError(_bad_rows_message(key, report, cfg, f"over data.max_bad_fraction={cfg.data.max_bad_fraction:g}"))
    if report.rows_bad:
        logger.warning("%s: %d bad rows skipped:\n  %s", key, report.rows_bad, "\n  ".join(report.bad_examples))

    good_ds = ds.filter(expr=col("error").is_null()).select_columns(["input_ids", "labels"]).materialize()
    return good_ds, report


def _bad_rows_message(key: str, report: SplitReport, cfg: SFTConfig, why: str) -> str:
    share = report.rows_bad / max(report.rows_read, 1)
    lines = [f"{key}: {report.rows_bad} of {report.rows_read} rows ({share:.1%}) are malformed, {why}:"]
    lines += [f"  {reason}: {count}" for reason, count in sorted(report.bad_by_reason.items())]
    lines.append("first problems (file:line):")
    lines += [f"  {example}" for example in report.bad_examples]
    if report.rows_bad > len(report.bad_examples):
        lines.append(f"  ... and {report.rows_bad - len(report.bad_examples)} more")
    lines.append(
        "Fix or remove these rows, raise data.max_seq_length for rows that are too long, "
        "or tolerate a share of bad rows with --set data.max_bad_fraction=0.05."
    )
    return "\n".join(lines)


# --- workers: deterministic shards and micro-batches ----------------------------------------------


def sharded_data_config(datasets: dict[str, Any], world_size: int) -> Any:
    """A Ray Train DataConfig that gives rank r the r-th fixed shard of each materialized dataset.

    Ray's default ``streaming_split`` hands blocks to whichever rank asks first, so the rows a rank
    sees change between attempts; a fixed split is what lets a resumed run continue on the same
    data. ``train`` shards are equal, so every rank runs the same number of steps; ``eval`` keeps
    every row. The split runs here, on the driver, before the workers take their CPUs: Ray Train
    configures datasets after that, when no Ray Data task could be scheduled on a full machine.
    """
    from ray.train import DataConfig

    shards = {name: ds.split(world_size, equal=(name == "train")) for name, ds in datasets.items()}

    class ShardedDataConfig(DataConfig):
        def configure(self, datasets, world_size, worker_handles, worker_node_ids, **kwargs):  # type: ignore[override]
            return [{name: shards[name][rank].iterator() for name in datasets} for rank in range(world_size)]

    return ShardedDataConfig(datasets_to_split=[])


def load_shard(iterator: Any) -> list[tuple[np.ndarray, np.ndarray]]:
    """All (input_ids, labels) rows of this rank's shard, in order."""
    rows = []
    for batch in iterator.iter_batches(batch_format="numpy", batch_size=1024):
        rows.extend(zip(batch["input_ids"], batch["labels"]))
    return [(np.asarray(ids, dtype=np.int64), np.asarray(lab, dtype=np.int64)) for ids, lab in rows]
