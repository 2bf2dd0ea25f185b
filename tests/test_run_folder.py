"""The run folder without Ray: its record and lock, the whole-checkpoint check, the fallback to the
newest good checkpoint, and what a relaunch of a finished run does. Checkpoints are built here in
the layout the workers write (DeepSpeed state, RNG states, the PEFT adapter, Ray's snapshot)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from conftest import tiny_overrides
from zerolab.checkpoints import (
    JOB_CONFIG_FILE,
    LOCK_FILE,
    SNAPSHOT_FILE,
    CheckpointError,
    RunFinished,
    RunFolder,
    RunInUse,
    RunRecord,
    prepare_run_folder,
)
from zerolab.config import load_config


def make_checkpoint(run_dir: Path, step: int, world: int = 2) -> str:
    name = f"checkpoint_{step:07d}"
    state = run_dir / name / "deepspeed" / "state"
    state.mkdir(parents=True)
    torch.save({"step": step}, state / "mp_rank_00_model_states.pt")
    for rank in range(world):
        torch.save({"rank": rank}, state / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
        torch.save({"torch": torch.get_rng_state()}, run_dir / name / f"rng_rank{rank}.pt")
    adapter = run_dir / name / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 8, "peft_type": "LORA"}))
    save_file({"a.lora_A.weight": torch.ones(8, 16), "a.lora_B.weight": torch.zeros(16, 8)}, str(adapter / "adapter_model.safetensors"))
    return name


def write_snapshot(run_dir: Path, names: list[str]) -> None:
    results = [{"version": 0, "checkpoint_dir_name": n, "metrics": {"step": int(n.split("_")[1])}} for n in names]
    (run_dir / SNAPSHOT_FILE).write_text(json.dumps({
        "ray_version": "2.60.0", "checkpoint_results": results, "checkpoint_report_indices": list(range(len(names))),
        "latest_checkpoint_result": results[-1], "pending_training_results": [], "pending_validation_specs": [],
        "current_report_index": len(names), "validated_checkpoint_dir_names": [],
        "timed_out_validation_checkpoint_dir_names": [], "failed_validation_checkpoint_dir_names": []}))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.fixture
def run(tmp_path):
    """A run with two checkpoints (steps 5 and 10) and its record, as a finished 2-worker ZeRO-2 run leaves it."""
    cfg = load_config(None, tiny_overrides(tmp_path, **{"run.name": "r1"}))
    run_dir = tmp_path / "runs" / "r1"
    names = [make_checkpoint(run_dir, 5), make_checkpoint(run_dir, 10)]
    write_snapshot(run_dir, names)
    from zerolab.tracking import mask_params

    record = RunRecord(config=mask_params(cfg.flat()), tracking_uri="sqlite:////x/mlflow.db", run_id="abc", status="training", step=10)
    RunFolder.of(cfg, str(tmp_path / "runs")).write_record(record)
    return cfg, run_dir, names


def test_unfinished_run_resumes_from_its_newest_checkpoint(run):
    cfg, run_dir, names = run
    resume = prepare_run_folder(cfg, cfg.run.storage_path, restart=False)
    assert resume.checkpoint == names[-1] and resume.record.run_id == "abc" and not resume.extends


@pytest.mark.parametrize("damage", ["adapter", "rng", "model_state", "deleted", "adapter_config"])
def test_a_bad_newest_checkpoint_gives_way_to_the_previous_good_one(run, damage, caplog):
    cfg, run_dir, names = run
    newest = run_dir / names[-1]
    if damage == "adapter":
        truncate(newest / "adapter" / "adapter_model.safetensors")
    elif damage == "rng":
        truncate(newest / "rng_rank1.pt")
    elif damage == "model_state":
        truncate(newest / "deepspeed" / "state" / "mp_rank_00_model_states.pt")
    elif damage == "adapter_config":
        (newest / "adapter" / "adapter_config.json").write_text('{"r": 8,')
    else:
        import shutil

        shutil.rmtree(newest)
    resume = prepare_run_folder(cfg, cfg.run.storage_path, restart=False)
    assert resume.checkpoint == names[0]
    expected = {"adapter": "adapter/adapter_model.safetensors is truncated", "rng": "rng_rank1.pt cannot be read",
                "model_state": "mp_rank_00_model_states.pt", "adapter_config": "adapter/adapter_config.json is not valid JSON",
                "deleted": "is missing"}[damage]
    assert expected in caplog.text and f"resuming from {names[0]} instead" in caplog.text
    # Ray Train now restores the good one: the snapshot names it as the latest, the bad one is gone from it.
    snapshot = json.loads((run_dir / SNAPSHOT_FILE).read_text())
    assert snapshot["latest_checkpoint_result"]["checkpoint_dir_name"] == names[0]
    assert [r["checkpoint_dir_name"] for r in snapshot["checkpoint_results"]] == names[:1]
    assert snapshot["checkpoint_results"][0]["metrics"] == {"step": 5}  # Ray's own entry, kept as it was
    if damage != "deleted":
        assert newest.is_dir()  # set aside, not deleted


def test_no_good_checkpoint_names_each_problem(run):
    cfg, run_dir, names = run
    for name in names:
        truncate(run_dir / name / "adapter" / "adapter_model.safetensors")
    with pytest.raises(CheckpointError, match=r"no checkpoint of .* can be resumed: .*checkpoint_0000010.*checkpoint_0000005.*start the run over"):
        prepare_run_folder(cfg, cfg.run.storage_path, restart=False)


def test_an_unreadable_snapshot_is_rebuilt_from_the_checkpoint_folders(run, caplog):
    cfg, run_dir, names = run
    truncate(run_dir / SNAPSHOT_FILE)
    assert prepare_run_folder(cfg, cfg.run.storage_path, restart=False).checkpoint == names[-1]
    assert f"{SNAPSHOT_FILE} is unreadable" in caplog.text
    snapshot = json.loads((run_dir / SNAPSHOT_FILE).read_text())
    assert [r["checkpoint_dir_name"] for r in snapshot["checkpoint_results"]] == names


def test_an_unreadable_record_is_named(run):
    cfg, run_dir, _ = run
    truncate(run_dir / JOB_CONFIG_FILE)
    with pytest.raises(CheckpointError, match=rf"{JOB_CONFIG_FILE} is unreadable .*start the run over"):
        prepare_run_folder(cfg, cfg.run.storage_path, restart=False)


def test_a_finished_run_is_not_resumed_unless_it_gets_more_steps(run):
    cfg, run_dir, names = run
    folder = RunFolder.of(cfg, cfg.run.storage_path)
    record = folder.read_record()
    record.status, record.ended_at, record.checkpoint, record.registered = "finished", "2026-11-23T00:00:00+00:00", names[-1], "models:/r1/1"
    folder.write_record(record)
    with pytest.raises(RunFinished) as info:
        prepare_run_folder(cfg, cfg.run.storage_path, restart=False)
    message = str(info.value)
    for part in ("finished at 2026-11-23T00:00:00+00:00 after step 10", "nothing was trained or registered", "MLflow run abc",
                 f"r1/{names[-1]}/adapter", "models:/r1/1", "new run.name", "start it over", "train.max_steps above 10"):
        assert part in message, message
    longer = load_config(None, tiny_overrides(Path(cfg.run.storage_path).parent, **{"run.name": "r1", "train.max_steps": 20}))
    resume = prepare_run_folder(longer, cfg.run.storage_path, restart=False)
    assert resume.extends and resume.checkpoint == names[-1]
    other = load_config(None, tiny_overrides(Path(cfg.run.storage_path).parent, **{"run.name": "r1", "train.max_steps": 20,
                                                                                      "adapter.r": 16}))
    with pytest.raises(CheckpointError, match=r"different training config \(adapter.r: 8 -> 16\)"):
        prepare_run_folder(other, cfg.run.storage_path, restart=False)
    assert prepare_run_folder(cfg, cfg.run.storage_path, restart=True).checkpoint is None
    assert not (run_dir / names[-1]).exists() and not (run_dir / JOB_CONFIG_FILE).exists()


def test_a_record_written_before_runs_had_a_status_still_reads(tmp_path):
    cfg = load_config(None, tiny_overrides(tmp_path, **{"run.name": "old"}))
    folder = RunFolder.of(cfg, str(tmp_path / "runs"))
    folder.write_json(JOB_CONFIG_FILE, cfg.flat())
    record = folder.read_record()
    assert record.config == cfg.flat() and record.status == "training"


def test_the_record_stores_no_secret(tmp_path):
    from zerolab.tracking import mask_params

    data = tmp_path / "d.jsonl"
    data.write_text("{}\n")
    cfg = load_config(None, tiny_overrides(tmp_path, **{"run.name": "s"}))
    flat = {**cfg.flat(), "data.train_path": "https://user:secretpass@example.invalid/d.jsonl"}
    RunFolder.of(cfg, str(tmp_path / "runs")).write_record(RunRecord(config=mask_params(flat)))
    text = (tmp_path / "runs" / "s" / JOB_CONFIG_FILE).read_text()
    assert "secretpass" not in text and "https://***@example.invalid/d.jsonl" in text


def test_the_lock_refuses_a_second_job_and_outlives_no_process(tmp_path):
    cfg = load_config(None, tiny_overrides(tmp_path, **{"run.name": "locked"}))
    folder = RunFolder.of(cfg, str(tmp_path / "runs"))
    with folder.locked():
        assert (tmp_path / "runs" / "locked" / LOCK_FILE).is_file()
        with pytest.raises(RunInUse, match=rf"in use by process {os.getpid()} on {socket.gethostname()}.*{LOCK_FILE}"):
            with folder.locked():
                pass
    # A lock whose process died (SIGKILL leaves it behind) is taken over.
    assert not (tmp_path / "runs" / "locked").exists()  # released, and the empty folder removed with it
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout.strip()
    (tmp_path / "runs" / "locked").mkdir(parents=True)
    (tmp_path / "runs" / "locked" / LOCK_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": int(gone), "since": "x"}))
    with folder.locked():
        assert json.loads((tmp_path / "runs" / "locked" / LOCK_FILE).read_text())["pid"] == os.getpid()
    # Another host's lock is not second-guessed.
    (tmp_path / "runs" / "locked").mkdir(parents=True, exist_ok=True)
    (tmp_path / "runs" / "locked" / LOCK_FILE).write_text(json.dumps({"host": "elsewhere", "pid": 1, "since": "x"}))
    with pytest.raises(RunInUse, match="on elsewhere"):
        with folder.locked():
            pass


def test_the_start_up_line_names_every_phase_to_the_first_step(caplog):
    import logging

    from zerolab.clock import StartupClock

    clock = StartupClock()
    clock.launched = 1000.0
    clock._marks = [("Ray", 1004.0), ("model config and data", 1005.5)]
    with caplog.at_level(logging.INFO, logger="zerolab"):
        out = clock.report({"perf/first_step_unix": 1012.0, "perf/wall_s": 30.0})
    assert out == {"perf/startup_s": 12.0, "perf/first_step_unix": 1012.0, "perf/wall_s": 30.0}
    assert ("first optimizer step 12.0 s after launch (Ray 4.0 s, model config and data 1.5 s, workers to their first step 6.5 s)"
            in caplog.text)
    assert clock.report({}) == {}  # a run stopped before its final report has no first-step time


def test_the_start_up_clock_starts_when_the_process_did():
    """``process_start_time`` (what ``jobs/sft.py`` gives the start-up clock) is the process's start:
    a fresh process that slept 1.5 s before asking is 1.5 s old and a little more, not seconds off
    (psutil's create_time was off by minutes on a VM whose wall clock had been stepped)."""
    code = "import time; time.sleep(1.5); from zerolab.clock import process_start_time; print(time.time() - process_start_time())"
    age = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout)
    assert 1.5 <= age < 6, age


def test_the_jobs_driver_code_leaves_the_training_stack_to_import_while_ray_starts():
    """``zerolab.run`` imports none of the training stack: a job imports it on a second thread while
    Ray starts (``cluster.job_imports``); one that imported it up front pays both one after the other."""
    code = ("import sys, zerolab.run\n"
            "print(sorted(m for m in ('torch', 'transformers', 'peft', 'deepspeed', 'mlflow', 'ray.train') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"

    from zerolab.cluster import job_imports

    assert set(job_imports(load_config(None, ["scaling.num_workers=1"]))) >= {"zerolab.models", "peft", "deepspeed"}
    assert "deepspeed" not in job_imports(load_config(None, ["scaling.num_workers=2"]))  # the workers import it
