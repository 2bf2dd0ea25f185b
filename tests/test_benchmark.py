"""The benchmark harness (bench/harness.py) with TRL's SFTTrainer as a system: the table's ratios to
TRL, how a TRL run is started, and (slow tier) zerolab and TRL run through the harness on the tiny
model on CPU, training the same rows. Performance figures come from GPU leases, never from here."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import REPO


@pytest.fixture
def harness(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    from bench import harness

    return harness


def row(system: str, tokens_per_s: float, gpu_gib: float | str, first_step_s: float, **settings: object) -> dict[str, object]:
    """A results row as read back from benchmark.csv (strings)."""
    values = {"run": f"{system}-{tokens_per_s}", "system": system, "shape": "qwen2.5-7b", "gpus": 1, "micro_batch": 2,
              "tokens_per_s_per_gpu": tokens_per_s, "gpu_peak_allocated_gib": gpu_gib, "time_to_first_step_s": first_step_s,
              "status": "ok", **settings}
    return {k: str(v) for k, v in values.items()}


def test_ratios_to_trl_are_over_the_median_of_its_runs_of_the_same_work(harness):
    trl = [row("trl", 11000, 56.0, 40.0), row("trl", 11500, 56.0, 38.0), row("trl", 9000, 58.0, 44.0)]
    zerolab = row("zerolab", 15640, 49.0, 35.6)
    other_batch = row("zerolab", 15000, 31.8, 30.0, micro_batch=1)  # no TRL run at one row per step
    failed = {**row("trl", 99999, 1.0, 1.0), "status": "failed (1)"}
    cpu = [row("zerolab", 9700, "", 27.6, shape="tiny"), row("trl", 6600, "", 14.0, shape="tiny")]
    rows = [*trl, zerolab, other_batch, failed, *cpu]
    harness.ratios(rows)
    assert (zerolab["vs_trl"], zerolab["vs_trl_memory"], zerolab["vs_trl_first_step"]) == ("1.42", "0.88", "0.89")
    assert trl[1]["vs_trl"] == "1.05" and other_batch["vs_trl"] == other_batch["vs_trl_memory"] == ""
    # On CPU there is no GPU memory to compare: that ratio stays empty, the others are made.
    assert (cpu[0]["vs_trl"], cpu[0]["vs_trl_memory"], cpu[0]["vs_trl_first_step"]) == ("1.47", "", "1.97")
    table = harness.markdown_table(rows)
    assert "| 1.42× · 0.88× · 0.89× |" in table and "| 1.47× · — · 1.97× |" in table


def test_attention_flops_of_a_split_row_count_the_whole_row(harness):
    """A row split over a sequence-parallel group is one sample of the whole row's length: the
    attention FLOPs per token are those of the full row, however many GPUs share it (h200x4-64: a
    128K row over four H200s, 2,204 tokens/s per GPU; over one, 2,266)."""
    from zerolab import perf

    q_dim, layers, row_tokens = 3584, 28, 131067
    metrics = {"mfu": 0.069, "tokens_per_step": row_tokens, "tokens_per_s_per_gpu": 2204.0, "device": "NVIDIA H200"}
    four = harness.Run("zerolab", "qwen2.5-7b", gpus=4, stage=2, row_tokens=131072, checkpointing=True,
                       overrides=("scaling.sequence_parallel_size=4",))
    attention = 2204.0 * perf.attention_train_flops_per_token(row_tokens, q_dim, layers) / perf.peak_flops_of("NVIDIA H200")
    assert harness._mfu_with_attention(four, metrics) == round(0.069 + attention, 4)
    # Four GPUs each with a row of their own (data parallel): four samples of the step's quarter.
    apart = harness.Run("zerolab", "qwen2.5-7b", gpus=4, stage=2, row_tokens=32768, checkpointing=True)
    quarter = 2204.0 * perf.attention_train_flops_per_token(row_tokens // 4, q_dim, layers) / perf.peak_flops_of("NVIDIA H200")
    assert harness._mfu_with_attention(apart, metrics) == round(0.069 + quarter, 4)
    # Eight GPUs in two groups of four: two rows per step, each the whole row's length.
    groups = harness.Run("zerolab", "qwen2.5-7b", gpus=8, stage=2, row_tokens=131072, checkpointing=True,
                         overrides=("scaling.sequence_parallel_size=4",))
    assert harness._mfu_with_attention(groups, {**metrics, "tokens_per_step": 2 * row_tokens}) == round(0.069 + attention, 4)


def test_the_lora_nodes_suite_varies_only_what_it_names(harness):
    """``lora-nodes-7b``: the nodes, peft's forward (``model.kernels=none``) and the nodes with ZeRO-2's
    ``overlap_comm`` off, whose DeepSpeed JSON is the stage's own file but for that one setting."""
    import json

    runs = {r.variant: r for r in harness.SUITES["lora-nodes-7b"]}
    assert {v: r.kernels for v, r in runs.items()} == {"nodes": "auto", "peft": "none", "nodes-no-overlap": "auto"}
    config = next(o.split("=", 1)[1] for o in runs["nodes-no-overlap"].overrides if o.startswith("deepspeed.config="))
    expected = json.loads((REPO / "ds_configs/zero2.json").read_text())
    expected["zero_optimization"]["overlap_comm"] = False
    assert json.loads(Path(config).read_text()) == expected
    assert runs["nodes"].overrides == runs["peft"].overrides == ("train.log_every_n_steps=1",)


def test_trl_starts_without_a_launcher_on_one_gpu_and_under_torchrun_on_several(harness, tmp_path):
    assert "trl" in harness.SYSTEMS and {r.system for r in harness.SUITES["cpu-smoke"]} == set(harness.SYSTEMS)
    ws = harness.Workspace(tmp_path)
    ws.data, ws.models = tmp_path / "mix.jsonl", {"qwen2.5-7b": "/models/7b"}
    one = harness.command(harness.Run("trl", "qwen2.5-7b", micro_batch=2, attn="auto"), ws, tmp_path / "r")
    two = harness.command(harness.Run("trl", "qwen2.5-7b", gpus=2, micro_batch=2, checkpointing=True), ws, tmp_path / "r")
    assert one[1].endswith("bench/trl_sft.py") and "torch.distributed.run" not in one
    assert one[one.index("--attn") + 1] == "auto" and one[one.index("--max-seq-length") + 1] == "4096"
    assert two[1:3] == ["-m", "torch.distributed.run"] and "--nproc_per_node=2" in two and "--gradient-checkpointing" in two
    zerolab, trl = (r for r in harness.SUITES["trl-7b"][:2])
    assert (zerolab.system, trl.system) == ("zerolab", "trl") and zerolab.micro_batch == trl.micro_batch == 2


@pytest.mark.slow
def test_trl_trains_zerolabs_rows_through_the_harness_on_cpu(harness, tmp_path):
    """zerolab's job and TRL's SFTTrainer as the cpu-smoke suite runs them (tiny model, 4 steps, 2 packed
    rows of at most 1,024 tokens a step): both rows are complete, and TRL's packed dataset holds
    exactly the rows, tokens and loss targets zerolab's data report counts. Their steps' tokens are
    not the same tokens: zerolab packs best fit in each epoch's random order, TRL best fit decreasing
    over the whole set and then shuffles the packed sequences, so the same rows group differently;
    both fill their sequences, so a step's tokens agree within 5%. 45-70 s on a shared 2-core machine."""
    runs = {r.system: r for r in harness.SUITES["cpu-smoke"] if r.system in ("zerolab", "trl")}
    ws = harness.Workspace(tmp_path)
    ws.prepare({"tiny"})
    with open(tmp_path / "runs.log", "a") as log:
        rows = {system: harness.execute(run, ws, log)[0] for system, run in runs.items()}
    ours, theirs = rows["zerolab"], rows["trl"]
    assert ours["status"] == theirs["status"] == "ok", (tmp_path / "runs.log").read_text()[-3000:]
    assert theirs["attn"] == "sdpa" and theirs["command"].startswith("python bench/trl_sft.py")
    for column in ("train_rows", "train_tokens", "train_target_tokens"):
        assert ours[column] == theirs[column] > 0, column
    assert ours["train_rows"] < 4198  # the rows longer than 1,024 tokens are left out by both
    for r in (ours, theirs):
        assert 0 < r["tokens_per_s_per_gpu"] and 0 < r["step_s"] and 0 < r["time_to_first_step_s"] < r["wall_s"]
        assert 0.9 * 2 * 1024 < r["tokens_per_step"] <= 2 * 1024, r
    assert abs(theirs["tokens_per_step"] / ours["tokens_per_step"] - 1) < 0.05
    harness.write_csv(tmp_path / "benchmark.csv", list(rows.values()), harness.COLUMNS)
    table = harness.markdown_table(harness.read_csv([Path(tmp_path / "benchmark.csv")]))
    trl_line = next(line for line in table.splitlines() if line.startswith("| trl-tiny"))
    assert "| 1.00× · — · 1.00× |" in trl_line
    # zerolab's last logged loss beside its figures, to hold two trees to the same loss; TRL's is not shown.
    assert 0 < ours["train_loss"] < 15 and theirs.get("train_loss", "") == ""
    zerolab_line = next(line for line in table.splitlines() if line.startswith("| zerolab-tiny"))
    assert f"| {ours['train_loss']:.4f} |" in zerolab_line and "| — | — | — | 1.00× · — · 1.00× |" in trl_line


def test_the_segment_report_finds_the_hole_a_request_did_not_fit(monkeypatch):
    """A stream maps 100 MiB, frees a 40 MiB block at its start that a live block keeps from the free
    end, then asks for 50 MiB: the allocator maps more. The report names that growth, the request's
    line, the 40 MiB hole and the live block above it; another stream's blocks are kept apart."""
    monkeypatch.syspath_prepend(str(REPO))
    from bench.memory_trace import compact, segment_report

    mib = 2**20

    def frames(line: int) -> list[dict[str, object]]:
        return [{"filename": "/x/platform/zerolab/model_code.py", "line": line, "name": "f"}]

    def ev(action: str, addr: int, size: int, stream: int = 0, line: int = 0) -> dict[str, object]:
        return {"action": action, "addr": addr * mib, "size": size * mib, "stream": stream, "frames": frames(line)}

    trace = [ev("segment_map", 0, 100), ev("alloc", 0, 40, line=1), ev("alloc", 40, 20, line=2), ev("alloc", 60, 40, line=3),
             ev("segment_map", 1000, 30, stream=7), ev("alloc", 1000, 10, stream=7, line=9),
             ev("free_requested", 0, 40), ev("free_completed", 0, 40),
             ev("segment_map", 100, 50), ev("alloc", 100, 50, line=4)]
    snapshot = {"device_traces": [trace], "segments": [
        {"device": 0, "stream": 0, "total_size": 150 * mib, "allocated_size": 110 * mib},
        {"device": 0, "stream": 7, "total_size": 30 * mib, "allocated_size": 10 * mib}]}
    report = segment_report(snapshot, last=1)
    assert "replayed: reserved peak 0.176 GiB, allocated peak 0.117 GiB" in report  # 180 and 120 MiB
    assert "stream 0x0: peak held 0.107 GiB (of which freed, the GPU's use of it still pending: 0.000), peak mapped 0.146 GiB" in report
    assert "growth at event 8: +50.0 MiB to 0.146 GiB, for 50.0 MiB at zerolab/model_code.py:4 f" in report
    assert "held / mapped GiB by stream: 0x0 0.059 / 0.098, 0x7 0.010 / 0.029" in report
    assert "the stream's free holes: 0.039 GiB in 1" in report
    assert "40.0 MiB  between [segment start] and [zerolab/model_code.py:2 f]" in report
    # Unmapping a part of a range takes it out of the reserved bytes, and the compact form reads the same.
    unmapped = {**snapshot, "device_traces": [[*trace, ev("segment_unmap", 120, 30), ev("segment_map", 2000, 20)]]}
    assert "reserved peak 0.176 GiB" in segment_report(unmapped)  # 180 - 30 + 20: no new peak
    assert segment_report(compact(unmapped)) == segment_report(unmapped)
    # A block freed while another stream's queued work may use it stays held until that work is done.
    pending = {**snapshot, "device_traces": [[*trace, ev("free_requested", 1000, 10, stream=7), ev("alloc", 1010, 15, stream=7)]]}
    assert "stream 0x7: peak held 0.024 GiB (of which freed, the GPU's use of it still pending: 0.010)" in segment_report(pending)


def test_a_profile_tells_the_adapters_products_from_the_frozen_weights(monkeypatch):
    """The profile's product split (bench/torchrun_loop.py) on a LoRA layer's forward and backward,
    from the shapes a profile records: the frozen weight's two products are wide, the adapter's six
    narrow (a side of its rank)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    monkeypatch.syspath_prepend(str(REPO))
    from bench.torchrun_loop import PRODUCTS, product_kind

    x = torch.randn(256, 256, requires_grad=True)
    weight, a, b = torch.randn(512, 256), torch.randn(16, 256, requires_grad=True), torch.randn(512, 16, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        ((x @ a.t()) @ b.t()).addmm_(x, weight.t()).sum().backward()
    kinds = [product_kind(e.input_shapes) for e in prof.key_averages(group_by_input_shape=True) for _ in range(e.count)
             if e.key in PRODUCTS]
    assert sorted(kinds) == ["narrow"] * 6 + ["wide"] * 2
    assert product_kind([[512], [], []]) is None
