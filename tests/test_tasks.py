"""Task generators are deterministic and in the seeds' formats; scorers on hand-written cases."""

from __future__ import annotations

import json

import pytest

from zerolab.tasks import TASKS, generate_dataset, long_context, math_sum, ner_json

P = math_sum.PREFIX


def test_math_generator_is_deterministic_and_correct():
    rows = math_sum.generate(50, seed=3)
    assert rows == math_sum.generate(50, seed=3) and rows != math_sum.generate(50, seed=4)
    for row in rows:
        assert set(row) == {"instruction", "input", "output"}
        x = int(row["instruction"].rstrip("="))
        assert math_sum.score(row["instruction"], row["output"], row["output"]) == {"format_ok": 1.0, "correct": 1.0}
        assert 2 <= x <= math_sum.MAX_X


@pytest.mark.parametrize(
    "prediction, expected",
    [
        (f"{P}3 + 2", {"format_ok": 1.0, "correct": 1.0}),
        (f"{P}5 + 0", {"format_ok": 1.0, "correct": 1.0}),  # any pair summing to x is right
        (f"{P}3 + 3", {"format_ok": 1.0, "correct": 0.0}),  # wrong sum
        ("3 + 2", {"format_ok": 0.0, "correct": 0.0}),      # right sum, missing prefix
        ("王大丫丫的回答是>3 + 2", {"format_ok": 0.0, "correct": 0.0}),  # wrong prefix
        (f"{P}three + 2", {"format_ok": 0.0, "correct": 0.0}),
    ],
)
def test_math_scorer(prediction, expected):
    assert math_sum.score("5=", "", prediction) == expected


def test_ner_generator_labels_are_in_text():
    for row in ner_json.generate(40, seed=1):
        assert isinstance(row["label"], dict) and row["label"]
        for entities in row["label"].values():
            assert all(e in row["text"] for e in entities)


def test_ner_scorer_cases():
    gold = json.dumps({"name": ["张伟"], "address": ["北京"]}, ensure_ascii=False)
    exact = ner_json.score("", gold, gold)
    assert exact == {"valid_json": 1.0, "tp": 2.0, "fp": 0.0, "fn": 0.0, "exact_match": 1.0}
    partial = ner_json.score("", gold, json.dumps({"name": ["张伟"], "company": ["华为"]}, ensure_ascii=False))
    assert (partial["tp"], partial["fp"], partial["fn"], partial["exact_match"]) == (1.0, 1.0, 1.0, 0.0)
    broken = ner_json.score("", gold, '{"name": ["张伟"')
    assert broken["valid_json"] == 0.0 and broken["fn"] == 2.0
    summary = ner_json.summarize([exact, partial, broken])
    assert summary["precision"] == pytest.approx(3 / 4)
    assert summary["recall"] == pytest.approx(3 / 6)
    assert summary["f1"] == pytest.approx(2 * 0.75 * 0.5 / 1.25)
    assert summary["valid_json"] == pytest.approx(2 / 3)


def test_generated_files_use_the_seeds_formats(tmp_path):
    math_file = generate_dataset("math_sum", 5, 0, tmp_path / "m.json")
    assert isinstance(json.loads(math_file.read_text()), list)
    ner_file = generate_dataset("ner_json", 5, 0, tmp_path / "n.jsonl")
    lines = ner_file.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 5 and all(json.loads(line)["text"] for line in lines)
    assert TASKS["custom"].generate is None


@pytest.mark.parametrize("max_tokens", [32768, 262144])
def test_long_context_rows_fill_the_row_budget_with_the_needle_deep_inside(max_tokens):
    rows = long_context.generate(3, seed=5, max_tokens=max_tokens)
    assert rows == long_context.generate(3, seed=5, max_tokens=max_tokens)
    assert rows != long_context.generate(3, seed=6, max_tokens=max_tokens)
    budget = max_tokens - long_context.RESERVED_TOKENS
    for row in rows:
        assert set(row) == {"instruction", "input", "output"}
        units = len(row["input"].split()) + row["input"].count(".")  # words and full stops: ~tokens with Qwen2.5's tokenizer
        assert budget // 2 - 20 <= units <= budget
        name = row["instruction"].removeprefix("What is the access code of ").removesuffix("?")
        assert row["input"].count(long_context.fact(name, row["output"])) == 1  # the answer is in the document, once
        assert row["input"].count("The access code of ") == long_context.NUM_DISTRACTORS + 1  # beside facts about others
        assert 0.05 <= long_context.needle_depth(row) <= 0.95
        assert long_context.score(row["instruction"], row["output"], row["output"]) == {"answered": 1.0, "correct": 1.0}


def test_long_context_scorer():
    assert long_context.score("", "48213", "The code is 48213.") == {"answered": 1.0, "correct": 1.0}
    assert long_context.score("", "48213", "48231") == {"answered": 1.0, "correct": 0.0}
    assert long_context.score("", "48213", "I could not find it") == {"answered": 0.0, "correct": 0.0}
    assert long_context.score("", "48213", "12345 or 48213") == {"answered": 1.0, "correct": 0.0}  # the first number counts
    with pytest.raises(ValueError, match="no room"):
        long_context.generate(1, 0, max_tokens=200)


def test_long_context_is_registered_and_sized_by_the_row_length(tmp_path):
    task = TASKS["long_context"]
    assert task.sized and task.file_format == "json" and task.score is long_context.score
    path = generate_dataset("long_context", 2, 0, tmp_path / "l.json", max_tokens=4096)
    rows = json.loads(path.read_text())
    assert rows == long_context.generate(2, 0, max_tokens=4096)
    assert generate_dataset("math_sum", 2, 0, tmp_path / "m.json", max_tokens=4096).is_file()  # unsized tasks ignore it
