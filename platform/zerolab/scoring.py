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
