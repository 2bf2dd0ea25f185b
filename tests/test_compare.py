"""The comparison's labels, timing and chart, without Ray or MLflow: runs are named by the values
that differ between them, wall time is split into start-up and training, and the chart carries
those labels."""

from __future__ import annotations

import pytest

from zerolab import compare

ZERO3_OFFLOAD = {"deepspeed.stage": "3", "deepspeed.offload_optimizer": "True", "deepspeed.offload_param": "True"}
ZERO2 = {"deepspeed.stage": "2", "deepspeed.offload_optimizer": "False", "deepspeed.offload_param": "False"}


@pytest.mark.parametrize(("params", "label"), [
    (ZERO3_OFFLOAD, "ZeRO-3 + offload"),
    (ZERO2, "ZeRO-2"),
    ({**ZERO2, "deepspeed.offload_optimizer": "True"}, "ZeRO-2 + optimizer offload"),
    ({**ZERO3_OFFLOAD, "deepspeed.offload_optimizer": "False"}, "ZeRO-3 + param offload"),
    ({"deepspeed.zero": "3+all"}, "ZeRO-3 + offload"),
    ({"deepspeed.zero": "3+optimizer"}, "ZeRO-3 + optimizer offload"),
    ({"deepspeed.zero": "0"}, "ZeRO-0"),
])
def test_stage_and_offload_read_as_one_label(params, label):
    assert compare.stage_label(params) == label


def test_labels_name_only_what_differs():
    common = {"adapter.method": "lora", "train.lr": "0.0003", "data.train.fingerprint": "x", "model.name_or_path": "m"}
    runs = [{**common, **ZERO3_OFFLOAD, "adapter.r": "16", "data.train.fingerprint": "a"},
            {**common, **ZERO2, "adapter.r": "8", "data.train.fingerprint": "b"},
            {**common, **ZERO2, "adapter.r": "16", "data.train.fingerprint": "c"}]
    # The stage's three params count as one varying thing; a per-run fingerprint is no choice.
    assert compare.varying_keys(runs) == ["adapter.r", "deepspeed.stage", "deepspeed.offload_optimizer", "deepspeed.offload_param"]
    assert compare.run_labels(runs, ["t0", "t1", "t2"]) == ["ZeRO-3 + offload, r=16", "ZeRO-2, r=8", "ZeRO-2, r=16"]
    # Only the learning rate differs: no stage part; numbers printed short.
    lrs = [{**common, **ZERO2, "train.lr": "0.0003"}, {**common, **ZERO2, "train.lr": "1e-4"}]
    assert compare.run_labels(lrs, ["a", "b"]) == ["lr=0.0003", "lr=0.0001"]
    # The method alone is its value; a key one run lacks shows as "-".
    assert compare.run_labels([{"adapter.method": "lora"}, {"adapter.method": "dora", "adapter.r": "8"}], ["a", "b"]) == \
        ["lora, r=-", "dora, r=8"]


def test_runs_nothing_tells_apart_keep_their_names():
    same = {**ZERO2, "adapter.r": "8"}
    assert compare.run_labels([same, same], ["seed-1", "seed-2"]) == ["seed-1", "seed-2"]
    assert compare.run_labels([same], ["only"]) == ["only"]
    # Two of three alike: those two get their name added, so no two labels collide.
    labels = compare.run_labels([same, same, {**same, "adapter.r": "16"}], ["x", "y", "z"])
    assert labels == ["r=8 (x)", "r=8 (y)", "r=16"]


def test_wall_time_splits_into_start_up_and_training():
    # Recorded first step and training time.
    assert compare.timing(1000.0, 1100.0, first_step_unix=1030.0, training_s=60.0) == \
        {"wall_s": 100.0, "startup_s": 30.0, "training_s": 60.0}
    # Estimated: the first window logged at t=1040 for step 5 at 2 s/step -> first step done at 1032;
    # training to the last logged window at 1090.
    est = compare.timing(1000.0, 1100.0, first_log=(1040.0, 5, 2.0), last_log_unix=1090.0)
    assert est == {"wall_s": 100.0, "startup_s": pytest.approx(32.0), "training_s": pytest.approx(58.0)}
    # A run still going: no whole wall time; nothing known: nothing made up.
    assert compare.timing(1000.0, None, training_s=50.0)["wall_s"] == 50.0
    assert compare.timing(1000.0, 1100.0) == {"wall_s": 100.0, "startup_s": None, "training_s": None}


def test_chart_names_every_run_by_its_label(tmp_path):
    rows = [compare.RunRow("id0", "sweep-abc_00000", "FINISHED", {**ZERO3_OFFLOAD, "adapter.r": "16"},
                           {"tokens_per_s": 100.0, "gpu_peak_gib": 2.0, "host_rss_gib": 5.0, "wall_s": 100.0, "startup_s": 30.0,
                            "training_s": 60.0, "gpu_util_pct": 80.0, "cpu_util_pct": 40.0}, [(5, 2.0), (10, 1.5)]),
            compare.RunRow("id1", "sweep-abc_00001", "FINISHED", {**ZERO2, "adapter.r": "8"},
                           {"tokens_per_s": 200.0, "host_rss_gib": 3.0, "wall_s": 80.0}, [(5, 2.1), (10, 1.4)])]
    fig = compare.plot(rows, tmp_path / "runs.png")
    assert (tmp_path / "runs.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    expected = ["ZeRO-3 + offload, r=16", "ZeRO-2, r=8"]
    ax_loss, ax_tps, ax_mem, ax_time, ax_util = fig.axes
    assert [t.get_text() for t in ax_loss.get_legend().get_texts()] == expected
    assert [t.get_text() for t in ax_tps.get_yticklabels()] == expected
    assert [t.get_text() for t in ax_mem.get_yticklabels()] == expected
    assert not any("sweep-abc" in t.get_text() for ax in fig.axes for t in ax.get_yticklabels())
    # Wall time stacked: start-up, then training from where start-up ends, then the rest.
    startup, training, rest = ax_time.containers
    assert [b.get_width() for b in startup] == [30.0, 0.0]
    assert [(b.get_x(), b.get_width()) for b in training] == [(30.0, 60.0), (0.0, 0.0)]
    assert [b.get_width() for b in rest] == [10.0, 80.0]
    assert [t.get_text() for t in ax_time.get_legend().get_texts()][0].startswith("start-up")
    assert [b.get_width() for b in ax_util.containers[0]] == [80.0, 0.0]


def test_chart_takes_the_sweep_tables_names(tmp_path):
    rows = [compare.RunRow(f"id{i}", f"trial-{i}", "FINISHED", {"adapter.r": str(r)}, {"tokens_per_s": 1.0}, [(1, 1.0)])
            for i, r in enumerate((4, 8))]
    fig = compare.plot(rows, tmp_path / "runs.png", ["ZeRO-0, r=4", "ZeRO-2, r=8"])
    assert [t.get_text() for t in fig.axes[1].get_yticklabels()] == ["ZeRO-0, r=4", "ZeRO-2, r=8"]


def test_stage_and_offload_are_one_definition_for_sweeps_estimates_and_labels():
    from zerolab.config import load_config
    from zerolab.zero import SWEEP_OPTIONS, ZERO_KEYS, Option

    assert ZERO_KEYS == ("0", "1", "2", "2+optimizer", "3", "3+optimizer", "3+all")
    for option in SWEEP_OPTIONS:
        assert Option.parse(option.key) == option
        assert Option.of(option.apply(load_config(None, []))) == option  # the config it selects reads back as itself
        assert compare.stage_label({"deepspeed.zero": option.key}) == option.label == compare.stage_label(
            {k: str(v) for k, v in option.values().items()})
