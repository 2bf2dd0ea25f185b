"""Reading, validation, chat rendering, masking, batching and packing."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from conftest import rows_of
from zerolab.batches import IGNORE_INDEX, MicroBatches
from zerolab.config import ModelSpec, load_config
from zerolab.data import DataError, RowError, parse_file, prepare_split, row_to_messages, tokenize_messages
from zerolab.models import load_model, load_tokenizer


def parse(path, data: bytes):
    return parse_file({"path": str(path), "bytes": data})


def test_json_array_rows_keep_their_line_numbers():
    text = '[\n  {"instruction": "1=", "output": "a"},\n\n  {"instruction": "2=",\n   "output": "b"}\n]\n'
    rows = parse("x/m.json", text.encode())
    assert [(r["path"], r["line"], r["error"]) for r in rows] == [("m.json", 2, None), ("m.json", 4, None)]
    assert json.loads(rows[1]["record"]) == {"instruction": "2=", "output": "b"}


def test_json_array_syntax_error_is_reported_at_its_line():
    rows = parse("m.json", b'[{"a": 1},\n {"a": ,}\n]')
    assert rows[0]["error"] is None
    assert rows[1]["line"] == 2 and rows[1]["error"].startswith("invalid JSON")


def test_jsonl_bad_lines_are_counted_not_fatal():
    text = '{"text": "a", "label": {}}\nnot json\n\n[1, 2]\n{"text": "b", "label": {}}\n'
    rows = parse("n.jsonl", text.encode())
    assert [(r["line"], (r["error"] or "").split(":")[0]) for r in rows] == [(1, ""), (2, "invalid JSON"), (4, "not an object"), (5, "")]


def test_parquet_rows(tmp_path):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": ["张伟在北京"], "label": [json.dumps({"name": ["张伟"]}, ensure_ascii=False)]}), path)
    rows = parse(path, path.read_bytes())
    assert rows[0]["line"] == 1 and rows[0]["error"] is None
    assert row_to_messages(json.loads(rows[0]["record"]), "")[-1]["content"] == '{"name": ["张伟"]}'


def test_three_row_shapes_become_messages():
    alpaca = row_to_messages({"instruction": "1=", "input": "ctx", "output": "ans"}, "SYS")
    assert alpaca == [{"role": "system", "content": "SYS"}, {"role": "user", "content": "1=\nctx"}, {"role": "assistant", "content": "ans"}]
    ner = row_to_messages({"text": "张伟", "label": {"name": ["张伟"]}}, "")
    assert ner[-1]["content"] == '{"name": ["张伟"]}' and ner[0]["role"] == "user"
    chat = row_to_messages({"messages": [{"role": "system", "content": "own"}, {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}, "SYS")
    assert chat[0]["content"] == "own"


@pytest.mark.parametrize(
    "row, reason",
    [
        ({"instruction": "1="}, "missing field"),
        ({"instruction": 1, "output": "x"}, "wrong type"),
        ({"instruction": "1=", "output": "  "}, "empty target"),
        ({"text": "x", "label": 3}, "wrong type"),
        ({"messages": [{"role": "user", "content": "q"}]}, "missing target"),
        ({"question": "q"}, "unknown format"),
    ],
)
def test_malformed_rows_raise_row_error_with_category(row, reason):
    with pytest.raises(RowError, match=f"^{reason}"):
        row_to_messages(row, "")


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    return load_tokenizer(ModelSpec())


def test_prompt_is_masked_and_the_answer_ends_with_eos(tokenizer):
    messages = row_to_messages({"instruction": "12=", "output": "王大丫丫的回答是--->5 + 7"}, "SYS")
    ids, labels = tokenize_messages(tokenizer, messages)
    prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
    n_prompt = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    assert labels[:n_prompt] == [IGNORE_INDEX] * n_prompt
    target = [t for t in labels if t != IGNORE_INDEX]
    assert tokenizer.decode(target) == "王大丫丫的回答是--->5 + 7<|im_end|>"
    assert ids[:n_prompt] == tokenizer(prompt, add_special_tokens=False)["input_ids"]  # the prompt as at inference


def test_multi_turn_trains_every_assistant_turn(tokenizer):
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "one"},
                {"role": "user", "content": "b"}, {"role": "assistant", "content": "two"}]
    ids, labels = tokenize_messages(tokenizer, messages)
    assert tokenizer.decode([t for t in labels if t != IGNORE_INDEX]) == "one<|im_end|>two<|im_end|>"
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(messages, tokenize=False)


def test_batches_are_padded_to_their_own_longest_row():
    mb = MicroBatches(rows_of([5, 9, 30, 7]), micro_batch_size=2, max_seq_length=64, packing=False, pad_id=0, seed=0)
    batches = mb.sequential()
    assert [b.inputs["input_ids"].shape[1] for b in batches] == [9, 30]
    assert batches[0].num_tokens == 14 and int(batches[0].inputs["attention_mask"].sum()) == 14


def test_order_is_reproducible_and_resume_continues_the_stream():
    rows = rows_of(range(3, 40))
    make = lambda: MicroBatches(rows, micro_batch_size=4, max_seq_length=64, packing=True, pad_id=0, seed=7)  # noqa: E731
    full = make().iterate()
    first = [next(full).inputs["input_ids"] for _ in range(25)]  # crosses epoch boundaries
    resumed = make().iterate(start=11)
    assert all(torch.equal(first[i], next(resumed).inputs["input_ids"]) for i in range(11, 25))
    assert make().epoch_plan(0) != make().epoch_plan(1)


def test_packing_fills_sequences_and_restarts_positions():
    mb = MicroBatches(rows_of([10, 20, 30, 15, 40]), micro_batch_size=8, max_seq_length=50, packing=True, pad_id=0, seed=0)
    (batch,) = mb.sequential()
    lengths = [sum(len(mb.rows[i][0]) for i in seq) for seq in mb.plan(list(range(5)))[0]]
    assert all(n <= 50 for n in lengths) and len(lengths) < 5
    pos = batch.inputs["position_ids"][0].tolist()
    assert pos[:10] == list(range(10)) and pos[10:30] == list(range(20))
    assert "attention_mask" not in batch.inputs


def test_packed_and_padded_batches_give_the_same_loss(tiny_model_path):
    torch.manual_seed(0)
    model = load_model(ModelSpec(), torch.float32).eval()
    model.config.use_cache = False  # as in training: with a KV cache transformers ignores packing
    rows = rows_of([12, 25, 9, 30, 17, 21], seed=1)
    padded = MicroBatches(rows, micro_batch_size=6, max_seq_length=128, packing=False, pad_id=0, seed=0).sequential()[0]
    packed = MicroBatches(rows, micro_batch_size=6, max_seq_length=128, packing=True, pad_id=0, seed=0).sequential()[0]
    assert packed.inputs["input_ids"].shape[0] < padded.inputs["input_ids"].shape[0]
    assert packed.num_targets == padded.num_targets and packed.num_tokens == padded.num_tokens
    with torch.no_grad():
        a = model(**padded.inputs, num_items_in_batch=padded.num_targets).loss
        b = model(**packed.inputs, num_items_in_batch=packed.num_targets).loss
    assert torch.allclose(a, b, rtol=1e-4), (a, b)
    # Without per-sample positions the samples would attend to each other and the loss would differ.
    leaky = {k: v for k, v in packed.inputs.items() if k != "position_ids"}
    with torch.no_grad():
        c = model(**leaky, num_items_in_batch=packed.num_targets).loss
    assert not torch.allclose(a, c, rtol=1e-3)


@pytest.mark.ray
def test_bad_rows_are_reported_with_file_and_line(ray_cluster, tmp_path, tiny_model_path):
    path = tmp_path / "train.jsonl"
    good = json.dumps({"text": "张伟在北京", "label": {"name": ["张伟"]}}, ensure_ascii=False)
    path.write_text("\n".join([good, "{oops", json.dumps({"text": "x"}), json.dumps({"text": "长" * 400, "label": {}}), good]) + "\n")
    cfg = load_config(None, ["data.task=ner_json", f"data.train_path={path}"])
    with pytest.raises(DataError) as err:
        prepare_split("train", str(path), cfg, tiny_model_path)
    text = str(err.value)
    assert "3 of 5 rows (60.0%) are malformed" in text
    for where in ("train.jsonl:2: invalid JSON", "train.jsonl:3: missing field: 'label'", "train.jsonl:4: too long"):
        assert where in text
    lenient = load_config(None, ["data.task=ner_json", f"data.train_path={path}", "data.max_bad_fraction=0.6"])
    ds, report = prepare_split("train", str(path), lenient, tiny_model_path)
    assert ds.count() == 2 and report.rows_bad == 3 and report.bad_by_reason == {"invalid JSON": 1, "missing field": 1, "too long": 1}
