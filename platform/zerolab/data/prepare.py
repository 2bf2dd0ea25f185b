"""The driver's preparation of one split, end to end: read, validate and tokenize it once, or
take it from the tokenized-data cache.

Small local inputs are prepared in the driver process, large or remote ones with Ray Data
(:data:`DRIVER_MAX_BYTES` says where the line is and why; :func:`needs_ray_data` tells the driver
before it decides whether to start Ray). Malformed rows are counted and reported with their file and
line; the job fails when their fraction exceeds ``data.max_bad_fraction``. The result, a
:class:`PreparedSplit`, is cached by a fingerprint of everything that decides the tokens, bad-row
report included, so a rerun, relaunch or sweep trial does not prepare it again.
:func:`resolve_max_seq_length` turns ``data.max_seq_length: auto`` into the length the prepared rows need.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from zerolab import cache_dir
from zerolab.batches import AUTO_LENGTH_MULTIPLE, IGNORE_INDEX, auto_max_seq_length
from zerolab.config import SFTConfig
from zerolab.data.formats import MAX_EXAMPLES, PARSED_SCHEMA, SUPPORTED_SUFFIXES, DataError, fingerprint, parse_file, scan_data_files
from zerolab.data.prepared import PreparedSplit, SplitReport
from zerolab.data.tokens import TOKENIZED_SCHEMA, tokenize_batch, tokenizer_fingerprint
from zerolab.tasks import generate_dataset, get_task

logger = logging.getLogger(__name__)

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


def dataset_paths(cfg: SFTConfig) -> dict[str, str]:
    """The files of each split: the configured ones, or task-generated ones (made once, cached)."""
    d = cfg.data
    task = get_task(d.task)
    paths: dict[str, str] = {}
    suffix = task.file_format
    # A sized task (long_context) fills the job's row length: it is part of the file's name.
    max_tokens = (d.max_seq_length if d.max_seq_length != "auto" else None) if task.sized else None
    length = f"-len{max_tokens or 'default'}" if task.sized else ""
    if d.train_path:
        paths["train"] = d.train_path
    else:
        target = cache_dir() / "data" / f"{d.task}-train-{d.num_train_rows}-seed{d.seed}{length}.{suffix}"
        paths["train"] = str(target if target.is_file() else generate_dataset(d.task, d.num_train_rows, d.seed, target,
                                                                              max_tokens=max_tokens))
    if d.eval_path:
        paths["eval"] = d.eval_path
    elif d.has_eval_split():
        target = cache_dir() / "data" / f"{d.task}-eval-{d.num_eval_rows}-seed{d.seed + 1}{length}.{suffix}"
        paths["eval"] = str(target if target.is_file() else generate_dataset(d.task, d.num_eval_rows, d.seed + 1, target,
                                                                             max_tokens=max_tokens))
    return paths


def needs_ray_data(cfg: SFTConfig) -> bool:
    """Whether preparing the job's data takes Ray Data (:func:`prepare_split`): a split's files are
    remote, or its local files hold more than :data:`DRIVER_MAX_BYTES`. Looks at file sizes only,
    reads no file (a task's generated files are made first where they are not yet, as the
    preparation would). A path that names no data is reported by the preparation, not here."""
    for path in dataset_paths(cfg).values():
        try:
            files, _ = scan_data_files(path)
        except DataError:
            continue
        if _needs_ray_data(files):
            return True
    return False


def _needs_ray_data(files: list[str]) -> bool:
    """Whether one split's ``files`` are prepared with Ray Data: any is remote, or together they
    exceed :data:`DRIVER_MAX_BYTES`."""
    return any("://" in f for f in files) or sum(Path(f).stat().st_size for f in files) > DRIVER_MAX_BYTES


def prepare_split(split: str, path: str, cfg: SFTConfig, model_path: str) -> PreparedSplit:
    """Read, validate and tokenize one split, or take it from the tokenized-data cache.

    The cache (``<zerolab cache>/tokenized/<key>/``, on the driver) is keyed by :func:`cache_key`:
    the files' bytes, the tokenizer's files, the chat template, system prompt, task,
    ``data.max_seq_length`` (with ``auto``, the longest row the model then accepts: its
    ``max_position_embeddings``, times ``model.rope_factor`` under ``model.rope_scaling``) and :data:`TOKENIZED_FORMAT`; ``data.packing`` is not part of it
    (packing happens in the batcher). Local inputs up to :data:`DRIVER_MAX_BYTES` are prepared in
    this process; larger or remote ones with Ray Data, which the caller has connected where
    :func:`needs_ray_data` says so (remote ones are not cached: their bytes are not read here).
    The bad-row report is stored with the tokens, so a cached split reports and
    fails exactly as when it was prepared.

    Raises DataError with the full report when the split has no rows, no usable rows, or its
    fraction of bad rows exceeds ``data.max_bad_fraction``.
    """
    key_name = "data.train_path" if split == "train" else "data.eval_path"
    files, skipped = scan_data_files(path)
    if skipped:
        logger.warning("%s: skipped %d files of unsupported types in %s (use %s): %s", key_name, len(skipped), path,
                       ", ".join(SUPPORTED_SUFFIXES), ", ".join(skipped[:MAX_EXAMPLES]))
    remote = any("://" in f for f in files)
    system_prompt = cfg.data.system_prompt if cfg.data.system_prompt is not None else get_task(cfg.data.task).system_prompt
    model = {"name_or_path": model_path, "revision": cfg.model.revision, "trust_remote_code": cfg.model.trust_remote_code}
    data_fingerprint = fingerprint(files)
    auto = cfg.data.max_seq_length == "auto"
    # With auto every row the model can take is kept; the length is resolved from them (resolve_max_seq_length).
    trained = max_positions(model) if auto else None
    limit = (cfg.model.positions(trained) if trained else None) if auto else cfg.data.max_seq_length
    limit_key = "max_position_embeddings" if auto else "data.max_seq_length"
    key = cache_key(data_fingerprint, model, system_prompt=system_prompt, task=cfg.data.task,
                    max_seq_length=cfg.data.max_seq_length, max_positions=limit if auto else None)
    folder = cache_dir() / "tokenized" / key[:32]
    prepared = None if remote else _load_cached(folder, key)
    if prepared is None:
        report = SplitReport(split=split, files=[Path(f).name for f in files], fingerprint=data_fingerprint, cache_key=key)
        if _needs_ray_data(files):
            import ray

            assert ray.is_initialized(), (f"{key_name}: {path} is prepared with Ray Data, but Ray is not connected; "
                                          "connect it first where zerolab.data.needs_ray_data(cfg) says so")
            report.prepared_with = "ray data"
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
    the data section (``data.packing`` aside: packing happens in the batcher), the model whose
    tokenizer reads it and, with ``data.max_seq_length: auto``, its RoPE scaling (the longest row kept)."""
    m = cfg.model
    rope = (m.rope_scaling, m.rope_factor, m.rope_original_max_position_embeddings) if cfg.data.max_seq_length == "auto" else ()
    return replace(cfg.data, packing=False), m.name_or_path, m.revision, m.trust_remote_code, rope


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

    from zerolab.models import LOAD_ERRORS, ModelLoadError, load_failure

    try:
        config = AutoConfig.from_pretrained(model["name_or_path"], revision=model["revision"],
                                            trust_remote_code=model["trust_remote_code"])
    except LOAD_ERRORS as exc:
        raise ModelLoadError(load_failure(model["name_or_path"], "model config", exc)) from exc
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


def _tokenize_here(files: list[str], model: dict[str, Any], system_prompt: str, max_seq_length: int | None,
                   limit_key: str) -> pa.Table:
    """Parse and tokenize local files in this process, in chunks of rows (one tokenizer call each)."""
    tables = []
    for f in files:
        rows = parse_file({"path": f, "bytes": Path(f).read_bytes()})
        for start in range(0, len(rows), 4096):
            chunk = pa.Table.from_pylist(rows[start : start + 4096], schema=PARSED_SCHEMA)
            tables.append(tokenize_batch(chunk, model=model, system_prompt=system_prompt, max_seq_length=max_seq_length,
                                         limit_key=limit_key))
    return pa.concat_tables(tables) if tables else TOKENIZED_SCHEMA.empty_table()


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
    return pa.concat_tables([t.select(TOKENIZED_SCHEMA.names).cast(TOKENIZED_SCHEMA) for t in tables]) if tables else TOKENIZED_SCHEMA.empty_table()


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
    report.bad_examples = [f"{b['path']}:{b['line']}: {b['error']}" for b in bad[:MAX_EXAMPLES]]

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
        logger.warning("%s: %d files have no rows: %s", key, len(report.empty_files), ", ".join(report.empty_files[:MAX_EXAMPLES]))
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

