"""Long rows: a generated document with one fact (the needle) placed deep inside, and a question
that only that fact answers.

Each row is ``{"instruction": question, "input": document, "output": answer}``: the document is
filler sentences of common English words (about one token per word and one per full stop with
Qwen2.5's and Llama 3's tokenizers) in which ``The access code of <name> is <code>.`` stands at a
depth between 10% and 90% of the document, beside distractor facts of the same form about other
names; the question asks for one name's code, so a model that has not read the right sentence
cannot answer. Document lengths spread evenly over half to all of a row's budget of
``max_tokens`` (``data.max_seq_length``), less room for the question, the answer and the chat
template. A tokenizer that spends more tokens per word makes longer rows; rows over
``data.max_seq_length`` are counted and reported as bad, as for any data.
"""

from __future__ import annotations

import random
import re
from typing import Any

SYSTEM_PROMPT = "Read the document and answer the question with the exact code it gives."
DEFAULT_MAX_TOKENS = 32768
"""The row budget where ``data.max_seq_length`` is ``auto``."""
RESERVED_TOKENS = 128
"""Tokens of a row's budget left for the system prompt, the question, the answer and the chat template."""
NUM_DISTRACTORS = 4

_NAMES = ["Avery", "Blake", "Carter", "Dana", "Ellis", "Finley", "Gray", "Harper", "Jordan", "Kendall", "Logan", "Morgan",
          "Parker", "Quinn", "Reese", "Rowan", "Sawyer", "Taylor"]
_SUBJECTS = ["the river", "the old mill", "a small boat", "the north road", "the market", "a tall tree", "the harbor",
             "the stone bridge", "a quiet town", "the long field", "the farm", "the wind"]
_VERBS = ["runs past", "turns toward", "stands near", "looks over", "moves along", "rests beside", "waits for", "leads to"]
_OBJECTS = ["the hills", "the sea", "the green valley", "the white house", "the open gate", "the dark forest",
            "the low wall", "the busy square", "the far shore", "the narrow path"]
_ENDINGS = ["in the morning", "at night", "after the rain", "in the spring", "every day", "for a while", "again", "once more"]
_CODE = re.compile(r"\d+")


def _filler(rng: random.Random) -> str:
    return f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_ENDINGS)}."


def _units(sentence: str) -> int:
    """The sentence's words and its full stop: its tokens with a tokenizer that has each word."""
    return len(sentence.split()) + 1


def fact(name: str, code: str) -> str:
    """The sentence that holds ``name``'s code (the needle, or a distractor)."""
    return f"The access code of {name} is {code}."


def generate(num_rows: int, seed: int, *, max_tokens: int = DEFAULT_MAX_TOKENS) -> list[dict[str, Any]]:
    """``num_rows`` rows whose documents fill half to all of ``max_tokens`` less
    :data:`RESERVED_TOKENS` (see the module's docstring), deterministic from ``seed``."""
    if max_tokens <= 2 * RESERVED_TOKENS:
        raise ValueError(f"max_tokens {max_tokens} leaves no room for a document; give more than {2 * RESERVED_TOKENS}")
    rng = random.Random(seed)
    budget = max_tokens - RESERVED_TOKENS
    rows = []
    for _ in range(num_rows):
        target = rng.randint(budget // 2, budget)
        names = rng.sample(_NAMES, NUM_DISTRACTORS + 1)
        codes = rng.sample(range(10000, 100000), NUM_DISTRACTORS + 1)
        facts = [fact(n, str(c)) for n, c in zip(names, codes)]
        filler: list[str] = []
        used = sum(_units(f) for f in facts)
        while True:
            sentence = _filler(rng)
            if used + _units(sentence) > target:
                break
            filler.append(sentence)
            used += _units(sentence)
        # The needle (facts[0]) 10-90% deep; distractors anywhere. Inserting from the deepest
        # position down keeps each position's meaning.
        positions = [round(rng.uniform(0.1, 0.9) * len(filler))] + [rng.randint(0, len(filler)) for _ in facts[1:]]
        for pos, sentence in sorted(zip(positions, facts), key=lambda p: -p[0]):
            filler.insert(pos, sentence)
        rows.append({"instruction": f"What is the access code of {names[0]}?", "input": " ".join(filler), "output": str(codes[0])})
    return rows


def needle_depth(row: dict[str, Any]) -> float:
    """Where the answer's sentence starts in the row's document, as a fraction of its length."""
    name = row["instruction"].removeprefix("What is the access code of ").removesuffix("?")
    return row["input"].index(fact(name, row["output"])) / len(row["input"])


def score(prompt: str, reference: str, prediction: str) -> dict[str, float]:
    """``answered``: the prediction gives a number; ``correct``: its first number is the reference's code."""
    found = _CODE.search(prediction)
    return {"answered": float(found is not None), "correct": float(found is not None and found.group() == reference.strip())}
