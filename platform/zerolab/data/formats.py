"""Data files: which files a data path names, their fingerprint, and each file parsed into rows.

The bottom of :mod:`zerolab.data`: it imports nothing of the package. A file (JSON array, JSONL or
Parquet, via pyarrow) becomes one row per record, ``{path, line, record, error}`` (:data:`PARSED_SCHEMA`),
with the record as JSON text and a malformed record's problem in ``error``, so a bad row is reported
with its file and line instead of failing the file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from pathlib import Path
from typing import Any

import pyarrow as pa

from zerolab.errors import UserError

logger = logging.getLogger(__name__)

SUPPORTED_SUFFIXES = (".json", ".jsonl", ".parquet")
MAX_EXAMPLES = 20
"""Bad rows and file names a report lists by name; the rest are counted."""


class DataError(UserError, ValueError):
    """The data cannot be used as given; the message is the report a user needs to fix it."""


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
                       ", ".join(SUPPORTED_SUFFIXES), ", ".join(skipped[:MAX_EXAMPLES]))
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


PARSED_SCHEMA = pa.schema([("path", pa.string()), ("line", pa.int64()), ("record", pa.string()), ("error", pa.string())])
"""The rows :func:`parse_file` gives, as a table."""
