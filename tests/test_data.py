"""Reading, validation, chat rendering, masking, batching and packing."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import zerolab.data.prepare
from conftest import REPO, rows_of, tiny_overrides
from zerolab import data
from zerolab.batches import IGNORE_INDEX, PACKER, MicroBatches, epoch_order, pack_rows
from zerolab.config import ModelSpec, load_config
from zerolab.data import (
    DataError,
    PreparedSplit,
    RowError,
    parse_file,
    prepare_split,
    row_to_messages,
    shard_rows,
    tokenize_messages,
    tokenize_rows,
)
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


def test_an_epoch_is_planned_once_for_its_count_and_its_batches(monkeypatch):
    mb = MicroBatches(rows_of(range(3, 40)), micro_batch_size=4, max_seq_length=64, packing=True, pad_id=0, seed=7)
    planned, plan = [], mb.plan
    monkeypatch.setattr(mb, "plan", lambda order: planned.append(order) or plan(order))
    stream = mb.iterate()
    for _ in range(mb.batches_per_epoch()):
        next(stream)
    assert len(planned) == 1
    next(stream)
    assert len(planned) == 2 and planned[1] == list(epoch_order(len(mb.rows), 7, 1))


def test_packing_fills_sequences_and_restarts_positions():
    mb = MicroBatches(rows_of([10, 20, 30, 15, 40]), micro_batch_size=8, max_seq_length=50, packing=True, pad_id=0, seed=0)
    (batch,) = mb.sequential()
    lengths = [sum(len(mb.rows[i][0]) for i in seq) for seq in mb.plan(list(range(5)))[0]]
    assert all(n <= 50 for n in lengths) and len(lengths) < 5
    pos = batch.inputs["position_ids"][0].tolist()
    assert pos[:10] == list(range(10)) and pos[10:30] == list(range(20))
    assert "attention_mask" not in batch.inputs


def test_packing_puts_each_row_where_it_fits_best():
    # Laid end to end (next fit), 40 would close the sequence of 30 and 20 the one of 40: three
    # sequences. Best fit fills two to the brim.
    assert pack_rows([30, 40, 20, 10], range(4), 50) == [[0, 2], [1, 3]]
    # Many short rows and a few long ones, as in chat data: every row once, none over the bound,
    # and the sequences nearly full.
    rng = np.random.default_rng(0)
    lengths = np.concatenate([rng.integers(20, 200, 900), rng.integers(800, 3900, 100)])
    order = epoch_order(len(lengths), 0, 0)
    sequences = pack_rows(lengths.tolist(), order, 4096)
    assert sorted(i for seq in sequences for i in seq) == list(range(len(lengths)))
    assert max(sum(lengths[seq]) for seq in sequences) <= 4096
    assert lengths.sum() / (4096 * len(sequences)) > 0.97
    # Sequences come out in the order they were started, so the epoch's order still leads.
    firsts = [seq[0] for seq in sequences]
    assert firsts == [i for i in order if i in set(firsts)]


def test_a_resume_from_a_checkpoint_packed_otherwise_says_what_it_cannot_reproduce():
    from zerolab.snapshot import packer_change

    # Checkpoints written before best fit recorded no packer: their epochs were planned next fit.
    message = packer_change({"step": 40}, packing=True)
    assert "next-fit" in message and "start the run over" in message
    assert packer_change({"step": 40, "packer": PACKER}, packing=True) is None
    assert packer_change({"step": 40}, packing=False) is None  # unpacked rows: every packer plans them alike


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


# --- preparation, the tokenized-data cache, shards ------------------------------------------------


@pytest.fixture
def tokenized_cache(tmp_path, monkeypatch):
    """A tokenized-data cache of this test's own (the tiny model stays where it was built)."""
    folder = tmp_path / "cache"
    monkeypatch.setattr(zerolab.data.prepare, "cache_dir", lambda: folder)
    return folder / "tokenized"


def ner_file(path, rows: int = 6):
    lines = [json.dumps({"text": f"张伟在北京{i}", "label": {"name": ["张伟"]}}, ensure_ascii=False) for i in range(rows)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def ner_config(path, *extra: str):
    return load_config(None, ["data.task=ner_json", f"data.train_path={path}", *extra])


def test_bad_rows_are_reported_with_file_and_line_also_from_the_cache(tokenized_cache, tmp_path, tiny_model_path):
    path = tmp_path / "train.jsonl"
    good = json.dumps({"text": "张伟在北京", "label": {"name": ["张伟"]}}, ensure_ascii=False)
    path.write_text("\n".join([good, "{oops", json.dumps({"text": "x"}), json.dumps({"text": "长" * 400, "label": {}}), good]) + "\n")
    messages = []
    for _ in range(2):  # prepared, then read from the cache: the same report, the same failure
        with pytest.raises(DataError) as err:
            prepare_split("train", str(path), ner_config(path), tiny_model_path)
        messages.append(str(err.value))
    assert messages[0] == messages[1]
    assert "3 of 5 rows (60.0%) are malformed" in messages[0]
    for where in ("train.jsonl:2: invalid JSON", "train.jsonl:3: missing field: 'label'", "train.jsonl:4: too long"):
        assert where in messages[0]
    # data.max_bad_fraction decides whether the split is usable, not its tokens: still cached.
    split = prepare_split("train", str(path), ner_config(path, "data.max_bad_fraction=0.6"), tiny_model_path)
    assert split.from_cache and split.num_rows == 2 and split.report.rows_bad == 3
    assert split.report.bad_by_reason == {"invalid JSON": 1, "missing field": 1, "too long": 1}
    assert len(list(tokenized_cache.iterdir())) == 1


def test_a_second_preparation_comes_from_the_cache_with_the_same_key(tokenized_cache, tmp_path, tiny_model_path):
    path = ner_file(tmp_path / "train.jsonl")
    first = prepare_split("train", str(path), ner_config(path), tiny_model_path)
    second = prepare_split("train", str(path), ner_config(path, "data.packing=true"), tiny_model_path)  # packing: same tokens
    assert not first.from_cache and first.report.prepared_with == "driver"
    assert second.from_cache and second.report.cache_key == first.report.cache_key
    assert np.array_equal(second.input_ids, first.input_ids) and np.array_equal(second.labels, first.labels)
    assert second.lengths.tolist() == [len(ids) for ids, _ in first.rows()] and second.report.tokens == first.report.tokens


def test_one_changed_byte_of_data_tokenizer_or_max_length_prepares_again(tokenized_cache, tmp_path, tiny_model_path):
    path = ner_file(tmp_path / "train.jsonl")
    model = tmp_path / "model"
    shutil.copytree(tiny_model_path, model)
    key = prepare_split("train", str(path), ner_config(path), str(model)).report.cache_key

    def again(config, model_path=str(model)):
        split = prepare_split("train", str(path), config, model_path)
        return split.from_cache, split.report.cache_key

    assert again(ner_config(path)) == (True, key)
    path.write_bytes(path.read_bytes().replace("北京0".encode(), "北京9".encode()))  # one byte of one row
    changed = again(ner_config(path))
    assert changed[0] is False and changed[1] != key
    with (model / "tokenizer.json").open("a") as f:  # one byte of a tokenizer file
        f.write(" ")
    assert again(ner_config(path))[0] is False
    assert again(ner_config(path, "data.max_seq_length=256"))[0] is False
    assert again(ner_config(path, "data.system_prompt=Answer."))[0] is False
    assert again(ner_config(path, "data.max_seq_length=256"))[0] is True


def test_a_recipe_takes_its_length_from_the_data(tokenized_cache, tiny_model_path):
    """The shipped 7B math recipe with a model folder that carries the built-in tokenizer: most of
    its rows are 66-69 tokens, over the fixed 64 the recipe had. With ``auto`` every row is
    prepared and the length resolves to the longest, rounded up; a fixed 64 still reports them."""
    cfg = load_config(REPO / "jobs" / "configs" / "math_qwen2.5_7b_lora.yaml", [f"model.name_or_path={tiny_model_path}"])
    assert cfg.data.max_seq_length == "auto"
    paths = data.dataset_paths(cfg)
    splits = {name: prepare_split(name, path, cfg, tiny_model_path) for name, path in paths.items()}
    assert {name: (s.report.rows_used, s.report.rows_bad) for name, s in splits.items()} == {"train": (1798, 0), "eval": (200, 0)}
    longest = max(s.report.max_tokens for s in splits.values())
    assert 64 < longest <= 128 and splits["train"].report.length_limit == 2048  # the tiny model's max_position_embeddings
    assert data.resolve_max_seq_length(cfg, splits).data.max_seq_length == 128
    fixed = cfg.with_values({"data.max_seq_length": 96})
    assert data.resolve_max_seq_length(fixed, splits) is fixed
    with pytest.raises(DataError, match=r"too long: 6\d tokens > data.max_seq_length=64") as err:
        prepare_split("train", paths["train"], cfg.with_values({"data.max_seq_length": 64}), tiny_model_path)
    assert "raise data.max_seq_length (or set it to auto)" in str(err.value)


def test_auto_length_follows_the_rows_the_model_takes_and_keys_the_cache(tokenized_cache, tmp_path, tiny_model_path):
    """With ``auto`` a split keeps every row up to the model's ``max_position_embeddings``; that limit
    is part of the cache key, so when it changes (no byte of data or tokenizer does) the rows are
    prepared again and the length resolves anew; rows beyond it are reported, named by the limit."""
    path = ner_file(tmp_path / "train.jsonl")
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps({"text": "张伟和李娜在北京的天安门广场见面" * 3, "label": {"name": ["张伟", "李娜"]}}, ensure_ascii=False) + "\n")
    model = tmp_path / "model"
    shutil.copytree(tiny_model_path, model)
    cfg = ner_config(path, "data.max_seq_length=auto", "data.max_bad_fraction=0.5")

    def prepared(max_positions: int | None = None) -> tuple[PreparedSplit, int]:
        if max_positions is not None:
            config = json.loads((model / "config.json").read_text())
            (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": max_positions}))
        split = prepare_split("train", str(path), cfg, str(model))
        return split, data.resolve_max_seq_length(cfg, {"train": split}).data.max_seq_length

    first, length = prepared()
    longest, second = sorted(first.lengths.tolist())[-1], sorted(first.lengths.tolist())[-2]
    assert first.report.rows_bad == 0 and longest > second and length == -(-longest // 64) * 64
    again, again_length = prepared()
    assert again.from_cache and again.report.cache_key == first.report.cache_key and again_length == length
    fixed = prepare_split("train", str(path), ner_config(path, f"data.max_seq_length={length}"), str(model))
    assert fixed.report.cache_key != first.report.cache_key  # the same rows, but a fixed length is another input

    capped, capped_length = prepared(max_positions=longest)  # the model takes the longest row and no more
    assert not capped.from_cache and capped.report.cache_key != first.report.cache_key
    assert capped_length == longest and capped.report.rows_bad == 0
    short, short_length = prepared(max_positions=longest - 1)
    assert short.report.rows_bad == 1 and short_length == min(-(-second // 64) * 64, longest - 1)
    assert short.report.bad_examples == [f"train.jsonl:7: too long: {longest} tokens > max_position_embeddings={longest - 1}"]


def test_an_empty_file_is_named_with_the_fix(tokenized_cache, tmp_path, tiny_model_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with pytest.raises(DataError, match=r"^data.train_path: empty.jsonl has no rows; add rows"):
        prepare_split("train", str(path), ner_config(path), tiny_model_path)


def test_invalid_utf8_is_one_bad_row_on_its_line(tokenized_cache, tmp_path, tiny_model_path):
    path = ner_file(tmp_path / "train.jsonl", rows=5)
    lines = path.read_bytes().split(b"\n")
    lines[2] = lines[2].replace("北".encode(), b"\xff\xfe")
    path.write_bytes(b"\n".join(lines))
    split = prepare_split("train", str(path), ner_config(path, "data.max_bad_fraction=0.3"), tiny_model_path)
    assert split.num_rows == 4 and split.report.bad_by_reason == {"invalid UTF-8": 1}
    assert split.report.bad_examples[0].startswith("train.jsonl:3: invalid UTF-8: byte 0xff at column")


def test_unsupported_files_in_a_folder_are_listed(tokenized_cache, tmp_path, tiny_model_path, caplog):
    folder = tmp_path / "data"
    folder.mkdir()
    ner_file(folder / "a.jsonl")
    (folder / "notes.txt").write_text("not data")
    (folder / "b.csv").write_text("text,label\n")
    with caplog.at_level("WARNING", logger="zerolab.data"):
        split = prepare_split("train", str(folder), ner_config(folder), tiny_model_path)
    assert split.report.skipped_files == ["b.csv", "notes.txt"] and split.report.files == ["a.jsonl"]
    assert "skipped 2 files of unsupported types" in caplog.text and "notes.txt" in caplog.text
    with pytest.raises(DataError, match="unsupported file type '.txt'"):
        prepare_split("train", str(folder / "notes.txt"), ner_config(folder / "notes.txt"), tiny_model_path)


def test_batched_tokenization_matches_row_by_row(tokenizer):
    records = [{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "one"},
                             {"role": "user", "content": "b"}, {"role": "assistant", "content": "two"}]},
               {"instruction": "12=", "output": "5 + 7"}, {"instruction": "1="}, {"text": "张伟", "label": {"name": ["张伟"]}}]
    ids, labels, errors = tokenize_rows(tokenizer, [json.dumps(r, ensure_ascii=False) for r in records], [None] * 4,
                                        system_prompt="SYS", max_seq_length=512)
    assert errors == [None, None, "missing field: 'output'", None]
    for i in (0, 1, 3):
        assert (ids[i], labels[i]) == tokenize_messages(tokenizer, row_to_messages(records[i], "SYS"))
    assert ids[2] == [] and labels[2] == []
    _, _, short = tokenize_rows(tokenizer, [json.dumps(records[1])], [None], system_prompt="SYS", max_seq_length=5)
    assert short[0].startswith("too long:")


@pytest.mark.parametrize("num_rows, world", [(10, 3), (9, 3), (2, 4), (7, 1)])
def test_shard_rows_is_a_deterministic_partition(num_rows, world):
    equal = shard_rows(num_rows, world, equal=True)
    kept = shard_rows(num_rows, world, equal=False)
    assert len(equal) == len(kept) == world
    assert len({len(s) for s in equal}) == 1 and sum(len(s) for s in equal) == num_rows - num_rows % world
    assert sorted(np.concatenate(kept).tolist()) == list(range(num_rows))  # every row once
    assert max(len(s) for s in kept) - min(len(s) for s in kept) <= 1
    assert [s.tolist() for s in shard_rows(num_rows, world, equal=True)] == [s.tolist() for s in equal]


def test_prepared_rows_round_trip_through_arrow():
    rows = rows_of([3, 5, 2])
    ids = np.concatenate([r[0] for r in rows]).astype(np.int32)
    labels = np.concatenate([r[1] for r in rows]).astype(np.int32)
    split = PreparedSplit(ids, labels, np.array([0, 3, 8, 10]), data.SplitReport("train", [], ""))
    assert split.lengths.tolist() == [3, 5, 2]
    table = split.to_arrow(np.array([2, 0]))
    assert table.column("input_ids").to_pylist() == [rows[2][0].tolist(), rows[0][0].tolist()]
    assert [lab.tolist() for _, lab in split.rows([1])] == [rows[1][1].tolist()]


@pytest.mark.ray
@pytest.mark.parametrize("world, sp", [(3, 1), (4, 2)])
def test_each_rank_reads_the_rows_shard_rows_gives_it_through_ray_data(ray_cluster, world, sp):
    """worker_datasets through real Ray Data: rank r's iterator yields exactly its shard's rows, in
    order (with sequence parallelism, its group's); a split's dataset holds every shard's rows."""
    from zerolab.data import load_shard, worker_datasets

    rows = rows_of([3, 5, 2, 4, 6, 1, 7])
    ids = np.concatenate([r[0] for r in rows]).astype(np.int32)
    labels = np.concatenate([r[1] for r in rows]).astype(np.int32)
    offsets = np.concatenate([[0], np.cumsum([len(r[0]) for r in rows])])
    prepared = {name: PreparedSplit(ids, labels, offsets, data.SplitReport(name, [], "")) for name in ("train", "eval")}
    datasets, config = worker_datasets(prepared, world, sp)
    per_rank = config.configure(datasets, world, None, None)
    groups = world // sp
    for name in ("train", "eval"):
        expected = shard_rows(len(rows), groups, equal=(name == "train"))
        for rank in range(world):
            got = load_shard(per_rank[rank][name])
            assert [g[0].tolist() for g in got] == [rows[i][0].tolist() for i in expected[rank // sp]], (name, rank)
            assert [g[1].tolist() for g in got] == [rows[i][1].tolist() for i in expected[rank // sp]], (name, rank)
        assert datasets[name].count() == sum(len(e) for e in expected)


@pytest.mark.ray
def test_ray_data_preparation_gives_the_driver_preparation_after_the_jobs_one_connect(
        _ray_session, tokenized_cache, tmp_path, tiny_model_path, monkeypatch):
    """Data over DRIVER_MAX_BYTES takes Ray Data: a job of one worker, which starts no Ray for its
    training, connects once (run_sft) because the data says so; the preparation itself connects nothing."""
    import ray

    from zerolab import plan, run
    from zerolab.data import needs_ray_data
    from zerolab.data import prepare as preparation

    path = ner_file(tmp_path / "train.jsonl", rows=40)
    with path.open("a", encoding="utf-8") as f:
        f.write("{oops\n")
    config = ner_config(path, "data.max_bad_fraction=0.1")
    here = prepare_split("train", str(path), config, tiny_model_path)
    shutil.rmtree(tokenized_cache)
    assert not needs_ray_data(config)
    monkeypatch.setattr(preparation, "DRIVER_MAX_BYTES", 0)
    assert needs_ray_data(config)

    ray.shutdown()  # the job starts its own Ray (it runs as the tests' one afterwards: ensure_ray)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(AssertionError, match="Ray is not connected"):
        prepare_split("train", str(path), config, tiny_model_path)
    connects, splits = [], {}
    connect, prepare = run.connect_ray, plan.prepare_data

    class Prepared(Exception):
        pass

    def prepare_then_stop(*args, **kwargs):
        splits.update(prepare(*args, **kwargs))
        raise Prepared

    monkeypatch.setattr(run, "connect_ray", lambda *a, **k: connects.append(a) or connect(*a, **k))
    monkeypatch.setattr(plan, "prepare_data", prepare_then_stop)
    job = load_config(None, tiny_overrides(tmp_path, **{"data.task": "ner_json", "data.train_path": path, "data.max_bad_fraction": 0.1,
                                                         "model.name_or_path": tiny_model_path, "scaling.num_workers": 1}))
    with pytest.raises(Prepared):
        run.run_sft(job)
    spread = splits["train"]
    assert len(connects) == 1 and ray.is_initialized()
    assert spread.report.prepared_with == "ray data" and not spread.from_cache
    assert np.array_equal(spread.input_ids, here.input_ids) and np.array_equal(spread.offsets, here.offsets)
    assert spread.report.bad_examples == here.report.bad_examples == ["train.jsonl:41: invalid JSON: Expecting property name enclosed in double quotes at column 2"]


@pytest.mark.ray
@pytest.mark.slow
def test_a_job_trains_when_its_data_files_exist_on_the_driver_only(ray_cluster, tokenized_cache, tmp_path, tiny_model_path, monkeypatch):
    """The workers get their rows through Ray: the data files (and the cache) are gone before they start."""
    from zerolab import plan, run
    from zerolab.tasks import generate_dataset

    folder = tmp_path / "driver-only"
    train = generate_dataset("math_sum", 96, 3, folder / "train.json")
    evals = generate_dataset("math_sum", 16, 4, folder / "eval.json")
    prepare = plan.prepare_data

    def prepare_then_delete(cfg, model_path, shared=None):
        prepared = prepare(cfg, model_path, shared)
        shutil.rmtree(folder)
        shutil.rmtree(tokenized_cache)
        return prepared

    monkeypatch.setattr(plan, "prepare_data", prepare_then_delete)
    cfg = load_config(None, tiny_overrides(tmp_path, **{"data.train_path": train, "data.eval_path": evals, "train.max_steps": 4}))
    result = run.run_sft(cfg)
    assert not folder.exists() and result.metrics["step"] == 4 and "eval/loss" in result.metrics
    assert result.data["train"]["rows_used"] == 96 and result.data["train"]["from_cache"] is False


def test_long_context_rows_come_through_the_pipeline_and_over_long_ones_are_reported(tokenized_cache, tiny_model_path):
    """The long_context task writes rows for the job's data.max_seq_length (part of the file's name).
    The built-in tokenizer, trained on Chinese and digits, spends about four tokens per English
    word, so rows written for 4,096 tokens are 5k-16k long: prepared at 12,288, some fit and the
    others are counted as too long, as any data's would be."""
    cfg = load_config(None, ["data.task=long_context", "data.num_train_rows=12", "data.num_eval_rows=0", "data.max_seq_length=4096",
                             "data.max_bad_fraction=0.9", f"model.name_or_path={tiny_model_path}"])
    paths = data.dataset_paths(cfg)
    assert list(paths) == ["train"] and paths["train"].endswith("long_context-train-12-seed0-len4096.json")
    split = prepare_split("train", paths["train"], cfg.with_values({"data.max_seq_length": 12288}), tiny_model_path)
    report = split.report
    assert report.rows_used + report.rows_bad == 12
    assert report.rows_used > 0 and report.rows_bad > 0 and report.bad_by_reason == {"too long": report.rows_bad}
    assert 4096 < report.max_tokens <= 12288
