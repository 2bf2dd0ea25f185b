"""Whether a saved file is whole: a safetensors file whose header accounts for its bytes, a JSON
file that parses. Shared by the relaunch's checkpoint check and by evaluation and export, which
read adapters and models that a copy or an upload may have cut short. Only the standard library:
the checks run on the driver before anything heavy is imported.

Each function returns what is wrong in words that follow the file's name (``<file> is truncated
...``), or None; the caller raises its own error with the file's name and what to do.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Protocol


class Readable(Protocol):
    def read(self, n: int, /) -> bytes: ...


def safetensors_problem(f: Readable, size: int) -> str | None:
    """What is wrong with the safetensors file open as ``f`` (``size`` bytes), None when whole. The
    file is an 8-byte header length, a JSON header and the tensors' bytes, whose extent the header
    gives: a truncated or padded file does not add up. Reads the header only."""
    head = f.read(8)
    if len(head) < 8:
        return f"is truncated ({size} bytes)"
    (n,) = struct.unpack("<Q", head)
    if n > size - 8:
        return f"is truncated: its header alone needs {n} bytes, the file has {size}"
    try:
        header = json.loads(f.read(n).decode())
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (ValueError, AttributeError, KeyError, IndexError, TypeError) as exc:  # ValueError: also bad UTF-8 and bad JSON
        return f"has an unreadable header ({type(exc).__name__}: {exc})"
    if 8 + n + end != size:
        return f"is truncated or damaged: its tensors need {8 + n + end} bytes, the file has {size}"
    return None


def json_problem(data: bytes) -> str | None:
    """What is wrong with a JSON file's bytes, None when they parse."""
    try:
        json.loads(data.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        return f"is not valid JSON ({exc})"
    return None


def folder_problems(folder: str | Path) -> dict[Path, str]:
    """The damaged ``*.safetensors`` and ``*.json`` files directly in a local ``folder``, each with
    what is wrong; empty when all are whole."""
    found: dict[Path, str] = {}
    for path in sorted(Path(folder).iterdir()):
        if not path.is_file():
            continue
        if path.suffix == ".safetensors":
            with path.open("rb") as f:
                problem = safetensors_problem(f, path.stat().st_size)
        elif path.suffix == ".json":
            problem = json_problem(path.read_bytes())
        else:
            continue
        if problem is not None:
            found[path] = problem
    return found
