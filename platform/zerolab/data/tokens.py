"""Rows -> chat messages -> tokens: each supported row shape as messages, rendered with the
tokenizer's chat template, tokenized in batches (one call of the fast tokenizer's batch encoder per
chunk of rows) with prompt tokens masked by -100; and the tokenizer's fingerprint for the cache key.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Any

import pyarrow as pa

from zerolab.batches import IGNORE_INDEX
from zerolab.config import ModelSpec


class RowError(ValueError):
    """One row is malformed. ``str(exc)`` is '<category>: <detail>'."""


def row_to_messages(record: dict[str, Any], system_prompt: str) -> list[dict[str, str]]:
    """Chat messages for one row in any of the supported formats; raises RowError."""
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise RowError("wrong type: 'messages' must be a non-empty list of {role, content}")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise RowError("wrong type: every message needs a string 'role' and a string 'content'")
            if m["role"] not in ("system", "user", "assistant"):
                raise RowError(f"wrong type: unknown role '{m['role']}'; use system, user or assistant")
        if messages[-1]["role"] != "assistant":
            raise RowError("missing target: the last message must be the assistant's answer")
        if not any(m["role"] == "assistant" and m["content"].strip() for m in messages):
            raise RowError("empty target: every assistant message is empty")
        if messages[0]["role"] != "system" and system_prompt:
            messages = [{"role": "system", "content": system_prompt}, *messages]
        return [{"role": m["role"], "content": m["content"]} for m in messages]

    if "instruction" in record or "output" in record:
        instruction, extra, output = record.get("instruction"), record.get("input", ""), record.get("output")
        for key, value in (("instruction", instruction), ("output", output)):
            if value is None:
                raise RowError(f"missing field: '{key}'")
            if not isinstance(value, str):
                raise RowError(f"wrong type: '{key}' must be a string, got {type(value).__name__}")
        if extra is None:
            extra = ""
        if not isinstance(extra, str):
            raise RowError(f"wrong type: 'input' must be a string, got {type(extra).__name__}")
        if not output.strip():
            raise RowError("empty target: 'output' is empty")
        user = f"{instruction}\n{extra}" if extra else instruction
        return _with_system(system_prompt, user, output)

    if "text" in record or "label" in record:
        text, label = record.get("text"), record.get("label")
        if text is None:
            raise RowError("missing field: 'text'")
        if label is None:
            raise RowError("missing field: 'label'")
        if not isinstance(text, str):
            raise RowError(f"wrong type: 'text' must be a string, got {type(text).__name__}")
        if not text.strip():
            raise RowError("empty prompt: 'text' is empty")
        if isinstance(label, str):
            target = label
        elif isinstance(label, dict):
            target = json.dumps(label, ensure_ascii=False)
        else:
            raise RowError(f"wrong type: 'label' must be an object of entity lists (or a string), got {type(label).__name__}")
        if not target.strip():
            raise RowError("empty target: 'label' is empty")
        return _with_system(system_prompt, text, target)

    keys = ", ".join(sorted(record)) or "none"
    raise RowError(f"unknown format: expected 'messages', 'instruction'/'output' or 'text'/'label' fields, found {keys}")


def _with_system(system_prompt: str, user: str, assistant: str) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return [*messages, {"role": "user", "content": user}, {"role": "assistant", "content": assistant}]


def prompt_and_target(record: dict[str, Any], system_prompt: str) -> tuple[list[dict[str, str]], str]:
    """The messages up to the last assistant turn, and that turn's text (the reference answer)."""
    messages = row_to_messages(record, system_prompt)
    return messages[:-1], messages[-1]["content"]


def tokenize_messages(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """input_ids and labels: assistant turns (through their end-of-turn token) are targets, the rest -100.

    Each prompt span is the text ``apply_chat_template(..., add_generation_prompt=True)`` renders,
    tokenized as one piece exactly as at inference; each answer span is tokenized on its own.
    """
    spans = chat_spans(tokenizer, messages)
    return join_spans([tokenizer(span, add_special_tokens=False)["input_ids"] for span in spans], tokenizer.eos_token_id)


def chat_spans(tokenizer: Any, messages: list[dict[str, str]]) -> list[str]:
    """The conversation as the chat template renders it, cut into (prompt, answer) text pairs, one
    per assistant turn: what comes before the turn's answer, then the answer with its end of turn."""
    spans: list[str] = []
    done = ""
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        full = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not prompt.startswith(done) or not full.startswith(prompt):
            raise RowError("template: the chat template does not render turns as prefixes of each other")
        spans += [prompt[len(done):], full[len(prompt):]]
        done = full
    return spans


def join_spans(encoded: list[list[int]], eos: int | None) -> tuple[list[int], list[int]]:
    """(input_ids, labels) from the token ids of ``chat_spans``' pairs: prompts masked, answers
    trained through the end-of-turn token, not on the template's text after it."""
    ids: list[int] = []
    labels: list[int] = []
    for prompt_ids, answer in zip(encoded[::2], encoded[1::2]):
        cut = answer.index(eos) + 1 if eos in answer else len(answer)
        ids += prompt_ids + answer
        labels += [IGNORE_INDEX] * len(prompt_ids) + answer[:cut] + [IGNORE_INDEX] * (len(answer) - cut)
    return ids, labels


def tokenize_rows(tokenizer: Any, records: list[str | None], errors: list[str | None], *, system_prompt: str,
                  max_seq_length: int | None, limit_key: str = "data.max_seq_length",
                  ) -> tuple[list[list[int]], list[list[int]], list[str | None]]:
    """(input_ids, labels, error) per row, as :func:`tokenize_messages` makes them one by one, with
    every span of the batch tokenized in one call of the fast tokenizer (its Rust batch encoder).

    ``records`` are rows' JSON text, ``errors`` the parse errors so far (a row with one is passed
    through). A row is bad when it is malformed, longer than ``max_seq_length`` (None: no limit;
    ``limit_key`` names the limit in the report) or has no target.
    """
    spans: list[str] = []
    where: list[tuple[int, int] | None] = []  # per row: its first span and number of spans
    errors = list(errors)
    for r, (text, error) in enumerate(zip(records, errors)):
        if error is not None:
            where.append(None)
            continue
        try:
            row_spans = chat_spans(tokenizer, row_to_messages(json.loads(text), system_prompt))
            where.append((len(spans), len(row_spans)))
            spans += row_spans
        except RowError as exc:
            errors[r] = str(exc)
            where.append(None)
    if not spans:
        encoded = []
    elif tokenizer.is_fast:  # the same ids as tokenizer(spans), without building a BatchEncoding
        encoded = [e.ids for e in tokenizer.backend_tokenizer.encode_batch(spans, add_special_tokens=False)]
    else:
        encoded = tokenizer(spans, add_special_tokens=False)["input_ids"]
    all_ids: list[list[int]] = []
    all_labels: list[list[int]] = []
    for r, span in enumerate(where):
        ids: list[int] = []
        labels: list[int] = []
        if span is not None:
            first, count = span
            ids, labels = join_spans(encoded[first : first + count], tokenizer.eos_token_id)
            if max_seq_length is not None and len(ids) > max_seq_length:
                errors[r] = f"too long: {len(ids)} tokens > {limit_key}={max_seq_length}"
            elif labels.count(IGNORE_INDEX) == len(labels):
                errors[r] = "empty target: the answer has no tokens"
            if errors[r] is not None:
                ids, labels = [], []
        all_ids.append(ids)
        all_labels.append(labels)
    return all_ids, all_labels, errors


@functools.lru_cache(maxsize=4)
def _cached_tokenizer(name_or_path: str, revision: str | None, trust_remote_code: bool) -> Any:
    from zerolab.models import load_tokenizer

    return load_tokenizer(ModelSpec(name_or_path=name_or_path, revision=revision, trust_remote_code=trust_remote_code))


def tokenize_batch(batch: pa.Table, *, model: dict[str, Any], system_prompt: str, max_seq_length: int | None,
                   limit_key: str = "data.max_seq_length") -> pa.Table:
    """Parsed rows (path, line, record, error) -> path, line, input_ids, labels, error; a Ray Data
    ``map_batches`` function, also called in the driver for small inputs."""
    tokenizer = _cached_tokenizer(model["name_or_path"], model["revision"], model["trust_remote_code"])
    ids, labels, errors = tokenize_rows(tokenizer, batch.column("record").to_pylist(), batch.column("error").to_pylist(),
                                        system_prompt=system_prompt, max_seq_length=max_seq_length, limit_key=limit_key)
    ints = pa.list_(pa.int32())
    return pa.table({"path": batch.column("path"), "line": batch.column("line"), "input_ids": pa.array(ids, type=ints),
                     "labels": pa.array(labels, type=ints), "error": pa.array(errors, type=pa.string())})


TOKENIZED_SCHEMA = pa.schema([("path", pa.string()), ("line", pa.int64()), ("input_ids", pa.list_(pa.int32())),
                              ("labels", pa.list_(pa.int32())), ("error", pa.string())])
"""The rows :func:`tokenize_batch` gives, as a table."""

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                    "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model", "chat_template.json")


def tokenizer_fingerprint(model: dict[str, Any]) -> str:
    """sha256 over the tokenizer's files: those of a local folder as they are (not loading it), or,
    for a hub id, the files ``save_pretrained`` writes from the loaded tokenizer. Vocabulary, merges,
    special tokens and the chat template all live in these files."""
    h = hashlib.sha256()
    folder = Path(model["name_or_path"]).expanduser()
    if folder.is_dir():
        names = sorted(f for f in folder.iterdir() if f.is_file() and (f.name in _TOKENIZER_FILES or f.suffix in (".jinja", ".py")))
        for f in names:
            h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
        templates = folder / "additional_chat_templates"
        for f in sorted(templates.glob("*.jinja")) if templates.is_dir() else []:
            h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
        return h.hexdigest()
    import tempfile

    tokenizer = _cached_tokenizer(model["name_or_path"], model["revision"], model["trust_remote_code"])
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        for f in sorted(Path(tmp).rglob("*")):
            if f.is_file():
                h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()

