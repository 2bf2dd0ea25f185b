"""Scores of a model's answers, by the task's scorer, and the report that puts a tuned model
and its base side by side: metrics, the per-example table, the printed summary and its files."""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zerolab.generation import PERF_KEYS, Answers, Example
from zerolab.tasks import get_task

ACCURACY_KEY = {"math_sum": "correct", "ner_json": "exact_match", "custom": "exact_match"}
"""The per-task score reported as ``eval/accuracy``: math_sum counts an answer right when it has
the prefix and a + b = x; ner_json and custom when the answer equals the reference."""


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


# --- the report -----------------------------------------------------------------------------------


UNITS = {"wall_s": "s", "load_s": "s", "generate_s": "s", "tokens_per_s": "tokens/s", "generated_tokens": "tokens",
         "gpu_peak_load_gib": "GiB", "gpu_peak_generate_gib": "GiB", "host_rss_gib": "GiB", "host_rss_peak_gib": "GiB"}
"""The unit of each figure of :data:`PERF_KEYS`. Every other key is a score: a rate between 0 and
1 (a share of the prompts; ner_json's precision, recall and F1 a share of entities)."""


def format_figure(key: str, value: float) -> str:
    """One figure for a person: a score as a percentage (``100.0%``), a count as a count
    (``2,207 tokens``), a time, a speed or a size with its unit; ``-`` when missing."""
    if not math.isfinite(value):
        return "-"
    unit = UNITS.get(key)
    if unit is None:
        return f"{100 * value:.1f}%"
    if unit == "tokens":
        return f"{value:,.0f} tokens"
    if unit == "tokens/s":
        return f"{value:,.1f} tokens/s"
    return f"{value:,.2f} {unit}"


def format_change(key: str, base: float, tuned: float) -> str:
    """From ``base`` to ``tuned``: percentage points for a score (``+100.0 pts``), a ratio for a
    speed (``1.02x``: a rate of tokens compares by how many times), a signed difference in the
    figure's unit otherwise; ``-`` when either is missing."""
    if not (math.isfinite(base) and math.isfinite(tuned)):
        return "-"
    unit = UNITS.get(key)
    if unit is None:
        return f"{100 * (tuned - base):+.1f} pts"
    if unit == "tokens/s":
        return f"{tuned / base:.2f}x" if base > 0 else "-"
    if unit == "tokens":
        return f"{tuned - base:+,.0f} tokens"
    return f"{tuned - base:+,.2f} {unit}"


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
        """The side-by-side summary a person reads: scores first, then speed and memory, each figure
        with its unit (see :func:`format_figure`) and, with both models, the change from base to tuned."""
        labels = list(self.results)
        both = len(labels) > 1
        summary_keys = [k for k in self.primary.summary if k != "accuracy"]
        keys = ["accuracy", *summary_keys, *(k for k in PERF_KEYS if k in self.primary.answers.figures)]
        rows = [["", *labels, *(["delta"] if both else [])]]
        for key in keys:
            values = {label: self.results[label].metrics().get(key, math.nan) for label in labels}
            change = [format_change(key, values["base"], values["tuned"])] if both else []
            rows.append([key, *(format_figure(key, v) for v in values.values()), *change])
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines = [f"task {self.task}: {len(self.examples)} prompts from {self.data_path}",
                 *(f"  {label}: {r.description}" for label, r in self.results.items())]
        lines += [f"{row[0]:<{widths[0]}}" + "".join(f"  {cell:>{w}}" for cell, w in zip(row[1:], widths[1:])) for row in rows]
        scores = "scores: % of prompts" + (" (precision, recall, f1: of entities)" if self.task == "ner_json" else "")
        lines.append(f"{scores}{'; delta: tuned - base, in percentage points for scores, as a ratio for tokens_per_s' if both else ''}")
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
