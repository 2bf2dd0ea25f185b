"""The benchmark's workload: a realistic length mix of SFT data and random-init models of real shapes.

The data mix, written once per seed in the chat ``messages`` format (every row carries its task's
system prompt, so every trainer renders it the same way):

- the math set as the seeds had it (1,798 rows of ``"<x>="`` → ``"王大丫丫的回答是---><a> + <b>"``),
- the NER set (2,000 rows of a sentence → entities as JSON),
- a long-sample set: NER over whole documents of generated sentences, 512 to ``max_tokens`` long.

Long rows (:func:`long_rows`, the long-row suites): ``long_context`` rows (a generated document with
one fact to find, ``zerolab.tasks.long_context``) cut to just under a given token count each.

:func:`tokenized_rows` renders and tokenizes the rows exactly as zerolab's data pipeline does
(``zerolab.data.tokenize_messages``), so the baselines train on the same token sequences as zerolab.
Models come from ``bench/calibrate_memory.py``'s builder: random weights in the real shape with the
built-in tiny model's tokenizer (its ids fall inside the real vocabulary, whose full size keeps
the logits realistic). Nothing is downloaded.
"""

from __future__ import annotations

import json
import math
import random
import re
from pathlib import Path

import numpy as np

NUM_MATH, NUM_NER, NUM_LONG = 1798, 2000, 400


def data_mix(root: Path, *, seed: int = 0, max_tokens: int = 4096) -> Path:
    """Write (once) and return the file of the mix: JSON lines of ``{"messages": [...]}``, shuffled."""
    from zerolab.tasks import get_task, math_sum, ner_json

    path = root / f"sft-mix-seed{seed}-max{max_tokens}.jsonl"
    if path.is_file():
        return path
    rng = random.Random(seed)
    math_prompt, ner_prompt = get_task("math_sum").system_prompt, get_task("ner_json").system_prompt

    def chat(system: str, user: str, answer: str) -> dict:
        return {"messages": [{"role": "system", "content": system}, {"role": "user", "content": user},
                             {"role": "assistant", "content": answer}]}

    rows = [chat(math_prompt, r["instruction"], r["output"]) for r in math_sum.generate(NUM_MATH, seed)]
    rows += [chat(ner_prompt, r["text"], json.dumps(r["label"], ensure_ascii=False)) for r in ner_json.generate(NUM_NER, seed + 1)]
    sentences = ner_json.generate(4000, seed + 2)
    tokenizer = _tokenizer()
    per_sentence = np.mean([len(tokenizer(s["text"], add_special_tokens=False)["input_ids"]) for s in sentences[:200]])
    for _ in range(NUM_LONG):
        target = rng.randint(512, max_tokens)  # document lengths spread evenly over 512..max_tokens
        for _attempt in range(8):
            doc = rng.sample(sentences, max(1, int(target / (1.2 * per_sentence))))  # + the label's tokens
            target = int(target * 0.9)  # for the next attempt, if this one is too long
            label: dict[str, list[str]] = {}
            for s in doc:
                for kind, names in s["label"].items():
                    label.setdefault(kind, []).extend(n for n in names if n not in label[kind])
            row = chat(ner_prompt, "".join(s["text"] for s in doc), json.dumps(label, ensure_ascii=False))
            if _length(tokenizer, row) <= max_tokens:
                rows.append(row)
                break
    rng.shuffle(rows)
    root.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".partial")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    tmp.rename(path)
    return path


def long_rows(root: Path, tokens: int, *, rows: int = 4, seed: int = 0) -> Path:
    """Write (once) and return a file of ``rows`` chat rows, each a ``long_context`` question on a
    document (the task's system prompt; the question, a blank line and the document as the user's
    message; the code as the answer) that the benchmark's tokenizer renders into at most ``tokens``
    tokens and at least that less one filler sentence (a few dozen tokens): each document is made
    longer than needed, then its filler sentences are dropped from the end, the facts kept, to the
    most that fit (a bisection over the count kept). Packed with ``data.max_seq_length`` set to
    ``tokens``, every micro-batch of one row is then one such row, about ``tokens`` wide."""
    from zerolab.tasks import long_context

    path = root / f"long-rows-{tokens}-n{rows}-seed{seed}.jsonl"
    if path.is_file():
        return path
    tokenizer = _tokenizer()

    def chat(row: dict, document: str) -> dict:
        return {"messages": [{"role": "system", "content": long_context.SYSTEM_PROMPT},
                             {"role": "user", "content": f"{row['instruction']}\n\n{document}"},
                             {"role": "assistant", "content": row["output"]}]}

    probe = long_context.generate(1, seed, max_tokens=4096)[0]
    per_word = _length(tokenizer, chat(probe, probe["input"])) / len(probe["input"].split())
    # The generator fills half to all of its budget (in words): the shortest then still overshoots by 10%.
    budget = math.ceil(2.2 * tokens / per_word) + long_context.RESERVED_TOKENS
    out = []
    for i in range(rows):
        row = long_context.generate(1, seed + i, max_tokens=budget)[0]
        sentences = re.split(r"(?<=\.) ", row["input"])
        facts = [s.startswith("The access code of ") for s in sentences]

        def document(kept: int, row: dict = row, sentences: list[str] = sentences, facts: list[bool] = facts) -> str:
            fillers = 0
            parts = []
            for sentence, is_fact in zip(sentences, facts):
                if is_fact or fillers < kept:
                    parts.append(sentence)
                fillers += not is_fact
            return " ".join(parts)

        low, high = 0, len(facts) - sum(facts)
        if _length(tokenizer, chat(row, document(high))) <= tokens:
            raise ValueError(f"a document of {high} filler sentences is not longer than {tokens} tokens; raise the budget")
        while high - low > 1:  # the most filler sentences that fit: low fits, high does not
            middle = (low + high) // 2
            low, high = (middle, high) if _length(tokenizer, chat(row, document(middle))) <= tokens else (low, middle)
        out.append(chat(row, document(low)))
    root.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".partial")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in out), encoding="utf-8")
    tmp.rename(path)
    return path


def tokenized_rows(path: Path, model_path: str | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
    """(input_ids, labels) of every row of ``path``, as zerolab's pipeline makes them."""
    from zerolab.data import row_to_messages, tokenize_messages

    tokenizer = _tokenizer(model_path)
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        ids, labels = tokenize_messages(tokenizer, row_to_messages(json.loads(line), ""))
        out.append((np.asarray(ids, dtype=np.int64), np.asarray(labels, dtype=np.int64)))
    return out


def row_counts(rows: list[tuple[np.ndarray, np.ndarray]]) -> dict[str, int]:
    """What a system trains on, as the benchmark's table names it: rows, their tokens and their loss
    targets (labels other than -100), as zerolab's data report counts them."""
    return {"train_rows": len(rows), "train_tokens": int(sum(len(ids) for ids, _ in rows)),
            "train_target_tokens": int(sum(np.count_nonzero(labels != -100) for _, labels in rows))}


def describe(rows: list[tuple[np.ndarray, np.ndarray]], max_tokens: int) -> dict[str, float]:
    """Row count, token counts and the share of padding when every row is padded to ``max_tokens``."""
    lengths = np.array([len(ids) for ids, _ in rows])
    return {"rows": len(rows), "tokens": int(lengths.sum()), "mean_len": float(lengths.mean()),
            "median_len": float(np.median(lengths)), "max_len": int(lengths.max()),
            "padding_share_at_max_len": float(1 - lengths.mean() / max_tokens)}


def _tokenizer(model_path: str | None = None):
    from zerolab.config import ModelSpec
    from zerolab.models import load_tokenizer

    tokenizer = load_tokenizer(ModelSpec(name_or_path=model_path) if model_path else ModelSpec())
    tokenizer.model_max_length = 1 << 30  # lengths are checked against max_tokens here, not by the tokenizer
    return tokenizer


def _length(tokenizer, row: dict) -> int:
    from zerolab.data import row_to_messages, tokenize_messages

    return len(tokenize_messages(tokenizer, row_to_messages(row, ""))[0])
