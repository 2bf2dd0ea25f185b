"""Tasks: a deterministic dataset generator and a scorer per task.

Rows are written in the seeds' on-disk formats (a JSON array of instruction/input/output for
``math_sum`` and ``long_context``, JSONL text/label for ``ner_json``), so generated and
user-provided data go through the same reading code.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zerolab.tasks import long_context, math_sum, ner_json


@dataclass(frozen=True)
class Task:
    name: str
    system_prompt: str
    file_format: str
    """`json` (one JSON array) or `jsonl` (one object per line)."""
    generate: Callable[[int, int], list[dict[str, Any]]] | None
    """(num_rows, seed) -> rows in the task's file format; None when the task has no generator."""
    score: Callable[[str, str, str], dict[str, float]]
    """(prompt, reference, prediction) -> per-example numbers, summed by ``summarize``."""
    summarize: Callable[[Sequence[dict[str, float]]], dict[str, float]]
    sized: bool = False
    """The generator also takes ``max_tokens`` (``data.max_seq_length``): its rows are as long as the job allows."""


def exact_match_score(prompt: str, reference: str, prediction: str) -> dict[str, float]:
    return {"exact_match": float(prediction.strip() == reference.strip())}


def mean_summary(per_example: Sequence[dict[str, float]]) -> dict[str, float]:
    keys = sorted({k for row in per_example for k in row})
    return {k: sum(row.get(k, 0.0) for row in per_example) / max(len(per_example), 1) for k in keys}


TASKS: dict[str, Task] = {
    "math_sum": Task(
        name="math_sum",
        system_prompt=math_sum.SYSTEM_PROMPT,
        file_format="json",
        generate=math_sum.generate,
        score=math_sum.score,
        summarize=mean_summary,
    ),
    "ner_json": Task(
        name="ner_json",
        system_prompt=ner_json.SYSTEM_PROMPT,
        file_format="jsonl",
        generate=ner_json.generate,
        score=ner_json.score,
        summarize=ner_json.summarize,
    ),
    "long_context": Task(
        name="long_context",
        system_prompt=long_context.SYSTEM_PROMPT,
        file_format="json",
        generate=long_context.generate,
        score=long_context.score,
        summarize=mean_summary,
        sized=True,
    ),
    "custom": Task(
        name="custom",
        system_prompt="You are a helpful assistant.",
        file_format="jsonl",
        generate=None,
        score=exact_match_score,
        summarize=mean_summary,
    ),
}


def get_task(name: str) -> Task:
    return TASKS[name]


def write_rows(rows: list[dict[str, Any]], path: str | Path, file_format: str) -> Path:
    """Write rows as a JSON array (``json``) or JSON lines (``jsonl``), UTF-8, atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        if file_format == "json":
            json.dump(rows, f, ensure_ascii=False, indent=1)
        else:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    tmp.replace(path)
    return path


def generate_dataset(task_name: str, num_rows: int, seed: int, path: str | Path, *, max_tokens: int | None = None) -> Path:
    """Generate ``num_rows`` rows of ``task_name`` with ``seed`` and write them to ``path``; a
    sized task's rows fill ``max_tokens`` (its default when None), other tasks ignore it."""
    task = get_task(task_name)
    assert task.generate is not None, f"task {task_name} has no generator"
    sized = {"max_tokens": max_tokens} if task.sized and max_tokens is not None else {}
    return write_rows(task.generate(num_rows, seed, **sized), path, task.file_format)
