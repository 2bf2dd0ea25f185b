"""Data: read, validate, render and tokenize once on the driver (cached); batch on the workers.

Driver side (:func:`prepare_split`): each file (JSON array, JSONL or Parquet, via pyarrow) is
parsed, every row turned into chat messages (instruction/input/output, NER text/label with the
label serialised to JSON, or ``messages``), rendered with the tokenizer's chat template, its prompt
and response spans tokenized (one call of the fast tokenizer's batch encoder per chunk of rows) and
prompt tokens masked with -100. Small local inputs are prepared in the driver process, large or
remote ones with Ray Data (:data:`DRIVER_MAX_BYTES` says where the line is and why). Malformed rows
are counted and reported with their file and line; the job fails when their fraction exceeds
``data.max_bad_fraction``. The result, a :class:`PreparedSplit` (every row's tokens end to end, with
per-row ``lengths``), is cached by a fingerprint of everything that decides the tokens, bad-row
report included, so a rerun, relaunch or sweep trial does not prepare it again.

Worker side: :func:`shard_rows` assigns rows to ranks deterministically and :func:`worker_datasets`
hands each rank its rows through Ray's object store (workers never open the data files), so every
rank gets the same rows on every attempt; :class:`zerolab.batches.MicroBatches` shuffles the shard
per epoch from the seed and yields micro-batches padded to their own longest row (or packed).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import re
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from zerolab.batches import AUTO_LENGTH_MULTIPLE, IGNORE_INDEX, auto_max_seq_length
from zerolab.config import SFTConfig
from zerolab.errors import UserError

logger = logging.getLogger(__name__)

SUPPORTED_SUFFIXES = (".json", ".jsonl", ".parquet")
_MAX_EXAMPLES = 20


class DataError(UserError, ValueError):
    """The data cannot be used as given; the message is the report a user needs to fix it."""


class RowError(ValueError):
    """One row is malformed. ``str(exc)`` is '<category>: <detail>'."""


# --- files -------------------------------------------------------------------------------------


def scan_data_files(path: str) -> tuple[list[str], list[str]]:
    """(data files, skipped files) under ``path`` (a file or a folder), each sorted; URIs are passed
    through. Files of a folder whose type is not supported are skipped and returned apart, so the
    data report can list them; an explicit path to one is an error."""
    if "://" in path:
        return [path], []
    p = Path(path).expanduser().resolve()
    if p.is_dir():
        found = sorted(f for f in p.rglob("*") if f.is_file())
        files = [str(f) for f in found if f.suffix in SUPPORTED_SUFFIXES]
        skipped = [str(f.relative_to(p)) for f in found if f.suffix not in SUPPORTED_SUFFIXES]
        if not files:
            also = f" (it holds {len(skipped)} other files: {', '.join(skipped[:5])})" if skipped else ""
            raise DataError(f"{path}: the folder holds no {', '.join(SUPPORTED_SUFFIXES)} files{also}")
        return files, skipped
    if not p.is_file():
        raise DataError(f"{path}: no such file or folder; check the path")
    if p.suffix not in SUPPORTED_SUFFIXES:
        raise DataError(f"{path}: unsupported file type '{p.suffix}'; use {', '.join(SUPPORTED_SUFFIXES)}")
    return [str(p)], []


def list_data_files(path: str) -> list[str]:
    """The data files under ``path``, sorted; files of unsupported types in a folder are skipped with
    a warning that lists them."""
    files, skipped = scan_data_files(path)
    if skipped:
        logger.warning("%s: skipped %d files of unsupported types (use %s): %s", path, len(skipped),
                       ", ".join(SUPPORTED_SUFFIXES), ", ".join(skipped[:_MAX_EXAMPLES]))
    return files


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


_UNDECODABLE = re.compile("[\udc80-\udcff]")
"""Bytes that are not UTF-8, as ``errors="surrogateescape"`` decodes them."""


def _bad_utf8(text: str) -> tuple[int, str] | None:
    """For text holding bytes that are not UTF-8: (lines before the first such byte, the error)."""
    found = _UNDECODABLE.search(text)
    if found is None:
        return None
    line_start = text.rfind("\n", 0, found.start()) + 1
    byte = ord(found.group()) - 0xDC00
    return text.count("\n", 0, line_start), f"invalid UTF-8: byte 0x{byte:02x} at column {found.start() - line_start + 1}; save the file as UTF-8"


def parse_file(row: dict[str, Any]) -> list[dict[str, Any]]:
    """One file (``{"path", "bytes"}``) -> one row per record: path, line, record (JSON text), error.

    A file with no records gives no rows. Bytes that are not UTF-8 make the row they are in bad
    (its file and line reported), not the file.
    """
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

    text = data.decode("utf-8-sig", errors="surrogateescape")
    if text.lstrip().startswith("["):
        _parse_json_array(text, emit)
    else:
        for i, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            bad = _bad_utf8(line)
            if bad:
                emit(i, error=bad[1])
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
    line, counted = 1, 0  # newlines are counted once, from where the last count stopped
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n:
            emit(text.count("\n", 0, n) + 1, error="invalid JSON: the array is not closed with ']'")
            return
        if text[i] == "]":
            return
        line += text.count("\n", counted, i)
        counted = start = i
        try:
            record, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError as exc:
            # The rest of the array cannot be located reliably after a syntax error.
            emit(line, error=f"invalid JSON: {exc.msg} (the rest of the file from here was not read)")
            return
        bad = _bad_utf8(text[text.rfind("\n", 0, start) + 1 : i])
        if bad:
            emit(line + bad[0], error=bad[1])
        else:
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
    spans = chat_spans(tokenizer, messages)
    return join_spans([tokenizer(span, add_special_tokens=False)["input_ids"] for span in spans], tokenizer.eos_token_id)


def chat_spans(tokenizer: Any, messages: list[dict[str, str]]) -> list[str]:
    """The conversation as the chat template renders it, cut into (prompt, answer) text pairs, one
    per assistant turn: what comes before the turn's answer, then the answer with its end of turn."""
    spans: list[str] = []
    done = ""
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        full = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not prompt.startswith(done) or not full.startswith(prompt):
            raise RowError("template: the chat template does not render turns as prefixes of each other")
        spans += [prompt[len(done):], full[len(prompt):]]
        done = full
    return spans


def join_spans(encoded: list[list[int]], eos: int | None) -> tuple[list[int], list[int]]:
    """(input_ids, labels) from the token ids of ``chat_spans``' pairs: prompts masked, answers
    trained through the end-of-turn token, not on the template's text after it."""
    ids: list[int] = []
    labels: list[int] = []
    for prompt_ids, answer in zip(encoded[::2], encoded[1::2]):
        cut = answer.index(eos) + 1 if eos in answer else len(answer)
        ids += prompt_ids + answer
        labels += [IGNORE_INDEX] * len(prompt_ids) + answer[:cut] + [IGNORE_INDEX] * (len(answer) - cut)
    return ids, labels


def tokenize_rows(tokenizer: Any, records: list[str | None], errors: list[str | None], *, system_prompt: str,
                  max_seq_length: int | None, limit_key: str = "data.max_seq_length",
                  ) -> tuple[list[list[int]], list[list[int]], list[str | None]]:
    """(input_ids, labels, error) per row, as :func:`tokenize_messages` makes them one by one, with
    every span of the batch tokenized in one call of the fast tokenizer (its Rust batch encoder).

    ``records`` are rows' JSON text, ``errors`` the parse errors so far (a row with one is passed
    through). A row is bad when it is malformed, longer than ``max_seq_length`` (None: no limit;
    ``limit_key`` names the limit in the report) or has no target.
    """
    spans: list[str] = []
    where: list[tuple[int, int] | None] = []  # per row: its first span and number of spans
    errors = list(errors)
    for r, (text, error) in enumerate(zip(records, errors)):
        if error is not None:
            where.append(None)
            continue
        try:
            row_spans = chat_spans(tokenizer, row_to_messages(json.loads(text), system_prompt))
            where.append((len(spans), len(row_spans)))
            spans += row_spans
        except RowError as exc:
            errors[r] = str(exc)
            where.append(None)
    if not spans:
        encoded = []
    elif tokenizer.is_fast:  # the same ids as tokenizer(spans), without building a BatchEncoding
        encoded = [e.ids for e in tokenizer.backend_tokenizer.encode_batch(spans, add_special_tokens=False)]
    else:
        encoded = tokenizer(spans, add_special_tokens=False)["input_ids"]
    all_ids: list[list[int]] = []
    all_labels: list[list[int]] = []
    for r, span in enumerate(where):
        ids: list[int] = []
        labels: list[int] = []
        if span is not None:
            first, count = span
            ids, labels = join_spans(encoded[first : first + count], tokenizer.eos_token_id)
            if max_seq_length is not None and len(ids) > max_seq_length:
                errors[r] = f"too long: {len(ids)} tokens > {limit_key}={max_seq_length}"
            elif labels.count(IGNORE_INDEX) == len(labels):
                errors[r] = "empty target: the answer has no tokens"
            if errors[r] is not None:
                ids, labels = [], []
        all_ids.append(ids)
        all_labels.append(labels)
    return all_ids, all_labels, errors


@functools.lru_cache(maxsize=4)
def _cached_tokenizer(name_or_path: str, revision: str | None, trust_remote_code: bool) -> Any:
    from zerolab.config import ModelSpec
    from zerolab.models import load_tokenizer

    return load_tokenizer(ModelSpec(name_or_path=name_or_path, revision=revision, trust_remote_code=trust_remote_code))


def tokenize_batch(batch: pa.Table, *, model: dict[str, Any], system_prompt: str, max_seq_length: int | None,
                   limit_key: str = "data.max_seq_length") -> pa.Table:
    """Parsed rows (path, line, record, error) -> path, line, input_ids, labels, error; a Ray Data
    ``map_batches`` function, also called in the driver for small inputs."""
    tokenizer = _cached_tokenizer(model["name_or_path"], model["revision"], model["trust_remote_code"])
    ids, labels, errors = tokenize_rows(tokenizer, batch.column("record").to_pylist(), batch.column("error").to_pylist(),
                                        system_prompt=system_prompt, max_seq_length=max_seq_length, limit_key=limit_key)
    ints = pa.list_(pa.int32())
    return pa.table({"path": batch.column("path"), "line": batch.column("line"), "input_ids": pa.array(ids, type=ints),
                     "labels": pa.array(labels, type=ints), "error": pa.array(errors, type=pa.string())})


# --- driver: one split end to end -----------------------------------------------------------------

TOKENIZED_FORMAT = 1
"""Version of the tokenized layout and of the code that makes it; part of every cache key, so
bumping it (when tokenization or the stored files change) makes every cached split stale."""

DRIVER_MAX_BYTES = 64 << 20
"""Local inputs up to this size are read and tokenized in the driver process; larger ones and
remote ones (``s3://``, ``gs://``, ...) go through Ray Data. On the 2-core machine the driver
prepares about 7 MB/s (math_sum: 20,000 rows, 3.5 MB, in 0.5 s), while a Ray Data pass costs
10-20 s before its first row (worker processes, the tokenizer loaded in each); Ray Data pays off
once its parallel reading and tokenizing over the cluster's CPUs wins back that start, from
inputs of tens of MB; above this line a single process would also hold every row at once."""

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                    "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model", "chat_template.json")


@dataclass
class SplitReport:
    """What one split's files held: counts, bad rows by reason with file:line examples, token stats,
    and where the tokens came from (``from_cache``, ``cache_key``)."""

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
    length_limit: int | None = None
    """The longest row accepted: ``data.max_seq_length``, or with ``auto`` the model's
    ``max_position_embeddings`` (None: the model's config has none)."""
    empty_files: list[str] = field(default_factory=list)
    """Files without a single row."""
    skipped_files: list[str] = field(default_factory=list)
    """Files of a data folder whose type is not supported (not read)."""
    cache_key: str = ""
    """Fingerprint of everything that decides the tokens (:func:`cache_key`)."""
    from_cache: bool = False
    """The tokens were read from the cache, not prepared again."""
    prepared_with: str = ""
    """``driver`` or ``ray data``: where the split was tokenized when it was prepared."""
    from_sweep: bool = False
    """A sweep trial took the tokens its sweep prepared once for all its trials (it read no file)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def source(self) -> str:
        """Where this job's tokens came from: ``sweep``, ``cache``, ``driver`` or ``ray data``."""
        return "sweep" if self.from_sweep else "cache" if self.from_cache else self.prepared_with

    def summary(self) -> str:
        line = f"{self.split}: {self.rows_used}/{self.rows_read} rows used, {self.tokens} tokens ({self.target_tokens} target)"
        if self.rows_bad:
            reasons = ", ".join(f"{k}: {v}" for k, v in sorted(self.bad_by_reason.items()))
            line += f"; {self.rows_bad} bad rows ({reasons})"
        where = {"driver": "tokenized in the driver", "ray data": "tokenized with Ray Data"}.get(self.prepared_with, "")
        if self.from_sweep:
            return line + " (prepared once for the sweep)"
        return line + (" (from the cache)" if self.from_cache else f" ({where})" if where else "")


@dataclass
class PreparedSplit:
    """One split's good rows, tokenized, held by the driver: every row's tokens end to end.

    Row ``i`` is ``input_ids[offsets[i]:offsets[i + 1]]`` (``labels`` alike, -100 where masked),
    in file order. ``lengths`` (tokens per row) is what batch shapes and memory depend on.
    """

    input_ids: np.ndarray
    """int32, all rows' tokens end to end."""
    labels: np.ndarray
    """int32, aligned with ``input_ids``."""
    offsets: np.ndarray
    """int64, ``num_rows + 1`` row boundaries into ``input_ids``."""
    report: SplitReport

    @property
    def num_rows(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        """Tokens of each row (int64, ``num_rows``)."""
        return np.diff(self.offsets)

    @property
    def from_cache(self) -> bool:
        return self.report.from_cache

    def rows(self, indices: np.ndarray | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
        """(input_ids, labels) as int64 arrays for the given rows (all by default), the batcher's input."""
        picked = range(self.num_rows) if indices is None else indices
        o = self.offsets
        return [(self.input_ids[o[i]:o[i + 1]].astype(np.int64), self.labels[o[i]:o[i + 1]].astype(np.int64)) for i in picked]

    def to_arrow(self, indices: np.ndarray | None = None) -> pa.Table:
        """The rows (all, or ``indices`` in that order) as a table of ``input_ids``/``labels`` lists."""
        # 32-bit list offsets hold up to 2**31 - 1 tokens per table.
        lists = pa.ListArray if self.offsets[-1] < 2**31 else pa.LargeListArray
        offsets = pa.array(self.offsets.astype(np.int32 if lists is pa.ListArray else np.int64))

        def column(flat: np.ndarray) -> pa.Array:
            return lists.from_arrays(offsets, pa.array(flat))

        table = pa.table({"input_ids": column(self.input_ids), "labels": column(self.labels)})
        return table if indices is None else table.take(pa.array(indices, type=pa.int64()))


def dataset_paths(cfg: SFTConfig) -> dict[str, str]:
    """The files of each split: the configured ones, or task-generated ones (made once, cached)."""
    from zerolab.models import cache_dir
    from zerolab.tasks import generate_dataset, get_task

    d = cfg.data
    task = get_task(d.task)
    paths: dict[str, str] = {}
    suffix = task.file_format
    if d.train_path:
        paths["train"] = d.train_path
    else:
        target = cache_dir() / "data" / f"{d.task}-train-{d.num_train_rows}-seed{d.seed}.{suffix}"
        paths["train"] = str(target if target.is_file() else generate_dataset(d.task, d.num_train_rows, d.seed, target))
    if d.eval_path:
        paths["eval"] = d.eval_path
    elif not d.train_path and d.num_eval_rows:
        target = cache_dir() / "data" / f"{d.task}-eval-{d.num_eval_rows}-seed{d.seed + 1}.{suffix}"
        paths["eval"] = str(target if target.is_file() else generate_dataset(d.task, d.num_eval_rows, d.seed + 1, target))
    return paths


def prepare_split(split: str, path: str, cfg: SFTConfig, model_path: str) -> PreparedSplit:
    """Read, validate and tokenize one split, or take it from the tokenized-data cache.

    The cache (``<zerolab cache>/tokenized/<key>/``, on the driver) is keyed by :func:`cache_key`:
    the files' bytes, the tokenizer's files, the chat template, system prompt, task,
    ``data.max_seq_length`` (with ``auto``, the model's ``max_position_embeddings``, the longest row
    it then accepts) and :data:`TOKENIZED_FORMAT`; ``data.packing`` is not part of it
    (packing happens in the batcher). Local inputs up to :data:`DRIVER_MAX_BYTES` are prepared in
    this process; larger or remote ones with Ray Data (remote ones are not cached: their bytes are
    not read here). The bad-row report is stored with the tokens, so a cached split reports and
    fails exactly as when it was prepared.

    Raises DataError with the full report when the split has no rows, no usable rows, or its
    fraction of bad rows exceeds ``data.max_bad_fraction``.
    """
    from zerolab.models import cache_dir
    from zerolab.tasks import get_task

    key_name = "data.train_path" if split == "train" else "data.eval_path"
    files, skipped = scan_data_files(path)
    if skipped:
        logger.warning("%s: skipped %d files of unsupported types in %s (use %s): %s", key_name, len(skipped), path,
                       ", ".join(SUPPORTED_SUFFIXES), ", ".join(skipped[:_MAX_EXAMPLES]))
    remote = any("://" in f for f in files)
    system_prompt = cfg.data.system_prompt if cfg.data.system_prompt is not None else get_task(cfg.data.task).system_prompt
    model = {"name_or_path": model_path, "revision": cfg.model.revision, "trust_remote_code": cfg.model.trust_remote_code}
    data_fingerprint = fingerprint(files)
    auto = cfg.data.max_seq_length == "auto"
    # With auto every row the model can take is kept; the length is resolved from them (resolve_max_seq_length).
    limit = max_positions(model) if auto else cfg.data.max_seq_length
    limit_key = "max_position_embeddings" if auto else "data.max_seq_length"
    key = cache_key(data_fingerprint, model, system_prompt=system_prompt, task=cfg.data.task,
                    max_seq_length=cfg.data.max_seq_length, max_positions=limit if auto else None)
    folder = cache_dir() / "tokenized" / key[:32]
    prepared = None if remote else _load_cached(folder, key)
    if prepared is None:
        report = SplitReport(split=split, files=[Path(f).name for f in files], fingerprint=data_fingerprint, cache_key=key)
        local_bytes = sum(Path(f).stat().st_size for f in files) if not remote else 0
        if remote or local_bytes > DRIVER_MAX_BYTES:
            from zerolab.cluster import connect_ray

            report.prepared_with = "ray data"
            connect_ray(cfg)  # a job that trains in its own process has not started Ray (cluster.needs_ray)
            table = _tokenize_with_ray_data(files, model, system_prompt, limit, limit_key)
        else:
            report.prepared_with = "driver"
            table = _tokenize_here(files, model, system_prompt, limit, limit_key)
        report.length_limit = limit
        prepared = _assemble(table, report)
        if not remote:
            _store(folder, prepared)
    prepared.report.split = split
    prepared.report.skipped_files = skipped
    _check(prepared.report, key_name, path, cfg)
    return prepared


def data_identity(cfg: SFTConfig) -> tuple:
    """What decides a job's prepared splits, compared between a sweep's base job and its trials:
    the data section (``data.packing`` aside: packing happens in the batcher) and the model whose
    tokenizer reads it."""
    return replace(cfg.data, packing=False), cfg.model.name_or_path, cfg.model.revision, cfg.model.trust_remote_code


def cache_key(data_fingerprint: str, model: dict[str, Any], *, system_prompt: str, task: str, max_seq_length: int | str,
              max_positions: int | None = None) -> str:
    """sha256 of everything that decides a split's tokens: the data files' fingerprint, the
    tokenizer's (its files, chat template included), system prompt, task, max length and
    :data:`TOKENIZED_FORMAT`. With ``max_seq_length`` ``auto`` the rows kept are those up to the
    model's ``max_position_embeddings`` (``max_positions``), which is then part of the key too: the
    tokens, and so the length ``auto`` resolves to, follow from the key."""
    parts = {"format": TOKENIZED_FORMAT, "data": data_fingerprint, "tokenizer": tokenizer_fingerprint(model),
             "system_prompt": system_prompt, "task": task, "max_seq_length": max_seq_length}
    if max_seq_length == "auto":
        parts["max_positions"] = max_positions
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def max_positions(model: dict[str, Any]) -> int | None:
    """The model's ``max_position_embeddings`` from its config (None where the config has none).
    Raises ModelLoadError."""
    from transformers import AutoConfig

    from zerolab.models import LOAD_ERRORS, ModelLoadError, _load_failure

    try:
        config = AutoConfig.from_pretrained(model["name_or_path"], revision=model["revision"],
                                            trust_remote_code=model["trust_remote_code"])
    except LOAD_ERRORS as exc:
        raise ModelLoadError(_load_failure(model["name_or_path"], "model config", exc)) from exc
    value = getattr(config, "max_position_embeddings", None)
    return value if isinstance(value, int) and value > 0 else None


def resolve_max_seq_length(cfg: SFTConfig, splits: dict[str, PreparedSplit]) -> SFTConfig:
    """``cfg`` with ``data.max_seq_length: auto`` replaced by the length it resolves to on the
    prepared ``splits``: their longest row, rounded up (``zerolab.batches.auto_max_seq_length``),
    at most the model's ``max_position_embeddings``. A set number is returned as it is. The driver
    calls this once, after preparing the data; the memory estimate, the run's params and the
    workers read the result."""
    if cfg.data.max_seq_length != "auto":
        return cfg
    reports = [split.report for split in splits.values()]
    longest = max(r.max_tokens for r in reports)
    limits = [r.length_limit for r in reports if r.length_limit is not None]
    length = auto_max_seq_length(longest, min(limits) if limits else None)
    logger.info("data.max_seq_length: auto -> %d (the longest row, %d tokens, rounded up to a multiple of %d%s)", length, longest,
                AUTO_LENGTH_MULTIPLE, f"; the model takes {min(limits)}" if limits else "")
    return cfg.replace(data=replace(cfg.data, max_seq_length=length))


def tokenizer_fingerprint(model: dict[str, Any]) -> str:
    """sha256 over the tokenizer's files: those of a local folder as they are (not loading it), or,
    for a hub id, the files ``save_pretrained`` writes from the loaded tokenizer. Vocabulary, merges,
    special tokens and the chat template all live in these files."""
    h = hashlib.sha256()
    folder = Path(model["name_or_path"]).expanduser()
    if folder.is_dir():
        names = sorted(f for f in folder.iterdir() if f.is_file() and (f.name in _TOKENIZER_FILES or f.suffix in (".jinja", ".py")))
        for f in names:
            h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
        templates = folder / "additional_chat_templates"
        for f in sorted(templates.glob("*.jinja")) if templates.is_dir() else []:
            h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
        return h.hexdigest()
    import tempfile

    tokenizer = _cached_tokenizer(model["name_or_path"], model["revision"], model["trust_remote_code"])
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        for f in sorted(Path(tmp).rglob("*")):
            if f.is_file():
                h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def _tokenize_here(files: list[str], model: dict[str, Any], system_prompt: str, max_seq_length: int | None,
                   limit_key: str) -> pa.Table:
    """Parse and tokenize local files in this process, in chunks of rows (one tokenizer call each)."""
    tables = []
    for f in files:
        rows = parse_file({"path": f, "bytes": Path(f).read_bytes()})
        for start in range(0, len(rows), 4096):
            chunk = pa.Table.from_pylist(rows[start : start + 4096], schema=_PARSED)
            tables.append(tokenize_batch(chunk, model=model, system_prompt=system_prompt, max_seq_length=max_seq_length,
                                         limit_key=limit_key))
    return pa.concat_tables(tables) if tables else _TOKENIZED.empty_table()


def _tokenize_with_ray_data(files: list[str], model: dict[str, Any], system_prompt: str, max_seq_length: int | None,
                            limit_key: str) -> pa.Table:
    """The same parse and tokenize, spread over the cluster's CPUs by Ray Data; the rows come back
    to the driver in file order."""
    import ray
    import ray.data

    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True  # row order, and so the shards, are reproducible
    # Local files exist on this node only: read them here (files on shared storage need no pinning).
    here = None if any("://" in f for f in files) else {"ray.io/node-id": ray.get_runtime_context().get_node_id()}
    try:
        ds = ray.data.read_binary_files(files, include_paths=True, label_selector=here)
    except OSError as exc:  # FileNotFoundError, permission or connection problems of a remote store
        from zerolab.tracking import mask_text

        raise DataError(mask_text(f"{', '.join(files)}: cannot be read ({type(exc).__name__}: {exc}); check the path or URI "
                                  "and that this machine can reach it with its credentials")) from None
    ds = ds.flat_map(parse_file).map_batches(
        tokenize_batch,
        batch_format="pyarrow",
        batch_size=4096,
        fn_kwargs={"model": model, "system_prompt": system_prompt, "max_seq_length": max_seq_length, "limit_key": limit_key},
    )
    tables = [t for t in ray.get(ds.to_arrow_refs()) if t.num_rows]  # an empty input has no schema
    return pa.concat_tables([t.select(_TOKENIZED.names).cast(_TOKENIZED) for t in tables]) if tables else _TOKENIZED.empty_table()


_PARSED = pa.schema([("path", pa.string()), ("line", pa.int64()), ("record", pa.string()), ("error", pa.string())])
_TOKENIZED = pa.schema([("path", pa.string()), ("line", pa.int64()), ("input_ids", pa.list_(pa.int32())),
                        ("labels", pa.list_(pa.int32())), ("error", pa.string())])


def _assemble(table: pa.Table, report: SplitReport) -> PreparedSplit:
    """The good rows of a tokenized table as flat arrays, and the counts of the report."""
    errors = table.column("error")
    good = table.filter(pc.is_null(errors))
    bad = table.filter(pc.is_valid(errors)).select(["path", "line", "error"]).to_pylist()
    seen = set(table.column("path").to_pylist())
    report.empty_files = [name for name in report.files if name not in seen]
    report.rows_read = table.num_rows
    report.rows_bad = len(bad)
    report.rows_used = good.num_rows
    report.bad_by_reason = dict(Counter(b["error"].split(":", 1)[0] for b in bad))
    report.bad_examples = [f"{b['path']}:{b['line']}: {b['error']}" for b in bad[:_MAX_EXAMPLES]]

    def flat(name: str) -> tuple[np.ndarray, np.ndarray]:
        column = good.column(name).combine_chunks() if good.num_rows else pa.array([], type=pa.list_(pa.int32()))
        offsets = column.offsets.to_numpy().astype(np.int64)
        values = column.values.to_numpy(zero_copy_only=False).astype(np.int32)
        return values[offsets[0]:offsets[-1]], offsets - offsets[0]

    input_ids, offsets = flat("input_ids")
    labels, _ = flat("labels")
    prepared = PreparedSplit(input_ids=input_ids, labels=labels, offsets=offsets, report=report)
    lengths = prepared.lengths
    report.tokens = int(lengths.sum())
    report.max_tokens = int(lengths.max()) if len(lengths) else 0
    report.target_tokens = int((labels != IGNORE_INDEX).sum())
    return prepared


def _store(folder: Path, prepared: PreparedSplit) -> None:
    """Write the split under ``folder`` atomically (a complete folder or none)."""
    import shutil
    import tempfile

    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".writing-"))
    try:
        for name in ("input_ids", "labels", "offsets"):
            np.save(tmp / f"{name}.npy", getattr(prepared, name))
        (tmp / "report.json").write_text(json.dumps(prepared.report.to_dict(), ensure_ascii=False, indent=1), encoding="utf-8")
        tmp.rename(folder)
    except OSError as exc:  # another job stored the same split first, or the cache is not writable
        if not folder.is_dir():
            logger.warning("could not cache the tokenized data in %s: %s", folder, exc)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _load_cached(folder: Path, key: str) -> PreparedSplit | None:
    """The split stored under ``folder``, or None when there is none (or it cannot be read)."""
    if not (folder / "report.json").is_file():
        return None
    try:
        report = SplitReport(**json.loads((folder / "report.json").read_text(encoding="utf-8")))
        arrays = {name: np.load(folder / f"{name}.npy") for name in ("input_ids", "labels", "offsets")}
    except (OSError, ValueError, TypeError) as exc:
        logger.warning("the cached tokenized data in %s cannot be read (%s); preparing the data again", folder, exc)
        return None
    if report.cache_key != key:
        return None
    report.from_cache = True
    return PreparedSplit(**arrays, report=report)


def _check(report: SplitReport, key: str, path: str, cfg: SFTConfig) -> None:
    """Fail on a split with no rows or too many bad ones; warn about bad rows and empty files."""
    if report.rows_read == 0:
        names = ", ".join(report.empty_files) or path
        raise DataError(f"{key}: {names} has no rows; add rows (JSON lines, a JSON array of objects or a Parquet "
                        f"table) or point {key} at another file")
    if report.empty_files:
        logger.warning("%s: %d files have no rows: %s", key, len(report.empty_files), ", ".join(report.empty_files[:_MAX_EXAMPLES]))
    if report.rows_used == 0:
        raise DataError(_bad_rows_message(key, report, cfg, "no usable rows"))
    if report.rows_bad / report.rows_read > cfg.data.max_bad_fraction:
        raise DataError(_bad_rows_message(key, report, cfg, f"over data.max_bad_fraction={cfg.data.max_bad_fraction:g}"))
    if report.rows_bad:
        logger.warning("%s: %d bad rows skipped:\n  %s", key, report.rows_bad, "\n  ".join(report.bad_examples))


def _bad_rows_message(key: str, report: SplitReport, cfg: SFTConfig, why: str) -> str:
    share = report.rows_bad / max(report.rows_read, 1)
    lines = [f"{key}: {report.rows_bad} of {report.rows_read} rows ({share:.1%}) are malformed, {why}:"]
    lines += [f"  {reason}: {count}" for reason, count in sorted(report.bad_by_reason.items())]
    lines.append("first problems (file:line):")
    lines += [f"  {example}" for example in report.bad_examples]
    if report.rows_bad > len(report.bad_examples):
        lines.append(f"  ... and {report.rows_bad - len(report.bad_examples)} more")
    too_long = ("shorten rows too long for the model" if cfg.data.max_seq_length == "auto"
                else "raise data.max_seq_length (or set it to auto) for rows that are too long")
    lines.append(f"Fix or remove these rows, {too_long}, or tolerate a share of bad rows with data.max_bad_fraction=0.05.")
    return "\n".join(lines)


# --- workers: deterministic shards ---------------------------------------------------------------


def shard_rows(num_rows: int, world_size: int, *, equal: bool) -> list[np.ndarray]:
    """Row indices of each rank's shard: rank ``r`` gets rows ``r, r + world_size, ...``.

    Pure and deterministic, so every attempt of a run gives a rank the same rows. Striding, not
    contiguous blocks, spreads files (and any order by length in them) evenly over the ranks.
    ``equal`` drops the last ``num_rows % world_size`` rows so that every rank has as many rows
    (and runs as many steps) as the others; otherwise every row is kept and shards differ by one.
    """
    assert world_size >= 1, world_size
    end = num_rows - num_rows % world_size if equal else num_rows
    return [np.arange(rank, end, world_size, dtype=np.int64) for rank in range(world_size)]


def worker_datasets(prepared: dict[str, PreparedSplit], world_size: int) -> tuple[dict[str, Any], Any]:
    """(Ray datasets, Ray Train DataConfig) that give rank r the rows ``shard_rows`` assigns it.

    The driver puts each rank's rows into Ray's object store (one block per rank); a worker reads
    its block through Ray, from whichever node holds it, never from a file: the data files and the
    cache exist on the driver only. ``train`` shards are equal, so every rank runs the same number
    of steps; ``eval`` keeps every row. Ray's default ``streaming_split`` would hand blocks to
    whichever rank asks first, so a resumed run would not continue on the same rows.
    """
    import ray
    import ray.data
    from ray.train import DataConfig

    refs = {name: [ray.put(split.to_arrow(indices)) for indices in shard_rows(split.num_rows, world_size, equal=(name == "train"))]
            for name, split in prepared.items()}
    datasets = {name: ray.data.from_arrow_refs(blocks) for name, blocks in refs.items()}
    shards = {name: [ray.data.from_arrow_refs([block]) for block in blocks] for name, blocks in refs.items()}

    class ShardedDataConfig(DataConfig):
        def configure(self, datasets, world_size, worker_handles, worker_node_ids, **kwargs):  # type: ignore[override]
            return [{name: shards[name][rank].iterator() for name in datasets} for rank in range(world_size)]

    return datasets, ShardedDataConfig(datasets_to_split=[])


def load_shard(iterator: Any) -> list[tuple[np.ndarray, np.ndarray]]:
    """All (input_ids, labels) rows of this rank's shard, in order."""
    rows = []
    for batch in iterator.iter_batches(batch_format="numpy", batch_size=None):
        rows.extend(zip(batch["input_ids"], batch["labels"]))
    return [(np.asarray(ids, dtype=np.int64), np.asarray(lab, dtype=np.int64)) for ids, lab in rows]
