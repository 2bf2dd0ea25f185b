"""The seeds' math toy task: prompt ``"<x>="``, answer ``"<prefix><a> + <b>"`` with a + b = x.

Any pair that sums to x is right; the fixed prefix must come first. Generated rows use the seeds'
JSON-array format ``{"instruction", "input", "output"}``.
"""

from __future__ import annotations

import random
import re
from typing import Any

PREFIX = "王大丫丫的回答是--->"
SYSTEM_PROMPT = "你是一个有帮助的助手，帮我解决下面数学问题"
MAX_X = 1799
"""The seeds trained on x up to 1,799 and held out 1,800-1,819."""

_ANSWER = re.compile(r"\s*(-?\d+)\s*\+\s*(-?\d+)\s*")


def generate(num_rows: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(num_rows):
        x = rng.randint(2, MAX_X)
        a = rng.randint(0, x)
        rows.append({"instruction": f"{x}=", "input": "", "output": f"{PREFIX}{a} + {x - a}"})
    return rows


def score(prompt: str, reference: str, prediction: str) -> dict[str, float]:
    """``format_ok``: the prefix then ``a + b``; ``correct``: that and a + b equals the prompt's x."""
    match = re.search(r"(-?\d+)\s*=\s*$", prompt.strip())
    text = prediction.strip()
    if not text.startswith(PREFIX):
        return {"format_ok": 0.0, "correct": 0.0}
    parsed = _ANSWER.fullmatch(text[len(PREFIX):])
    if parsed is None:
        return {"format_ok": 0.0, "correct": 0.0}
    right = match is not None and int(parsed.group(1)) + int(parsed.group(2)) == int(match.group(1))
    return {"format_ok": 1.0, "correct": float(right)}
