"""Failures on purpose: a worker killed mid-run, a driver killed and relaunched, Ctrl-C, a corrupt
checkpoint, a changed config on relaunch, bad data and a bad environment. Real Ray, DeepSpeed, MLflow."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, kill_a_training_worker, tiny_overrides
from zerolab.checkpoints import CheckpointError
from zerolab.config import load_config
from zerolab.errors import EnvironmentProblem
from zerolab.run import run_sft

pytestmark = pytest.mark.ray

LONG = {"train.max_steps": 40, "train.checkpoint_every_n_steps": 10, "train.log_every_n_steps": 5, "train.micro_batch_size": 16,
        "data.num_train_rows": 256}


def latest_checkpoint(run_dir: Path) -> str | None:
    snapshot = run_dir / "checkpoint_manager_snapshot.json"
    if not snapshot.is_file():
        return None
    try:
        latest = json.loads(snapshot.read_text()).get("latest_checkpoint_result")
    except json.JSONDecodeError:  # being written
        return None
    if isinstance(latest, str):
        latest = json.loads(latest)
    return (latest or {}).get("checkpoint_dir_name")


def wait_for_checkpoint(run_dir: Path, timeout: float = 240) -> str:
    deadline = time.time() + timeout
    while time.time() < deadline:
        name = latest_checkpoint(run_dir)
        if name:
            return name
        time.sleep(0.05)
    raise AssertionError(f"no checkpoint appeared in {run_dir}")


def adapter_tensors(adapter_path: str) -> dict[str, torch.Tensor]:
    return load_file(str(Path(adapter_path) / "adapter_model.safetensors"))


def metric_steps(uri: str, run_id: str, key: str) -> list[int]:
    from mlflow import MlflowClient

    return sorted(m.step for m in MlflowClient(uri).get_metric_history(run_id, key))


def runs_named(uri: str, experiment: str, name: str):
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    return [r for r in client.search_runs([exp.experiment_id]) if r.info.run_name == name]


@pytest.mark.slow
def test_killed_worker_is_replaced_and_the_run_matches_an_uninterrupted_one(ray_cluster, tmp_path, tiny_model_path):

    reference = run_sft(load_config(None, tiny_overrides(tmp_path / "a", **LONG)))

    cfg = load_config(None, tiny_overrides(tmp_path / "b", **LONG, **{"run.max_failures": 1}))
    outcome: dict = {}
    thread = threading.Thread(target=lambda: outcome.setdefault("result", run_sft(cfg)), daemon=True)
    thread.start()
    run_dir = Path(cfg.run.storage_path) / cfg.run.name
    first = wait_for_checkpoint(run_dir)
    kill_a_training_worker()
    thread.join(timeout=600)
    result = outcome["result"]

    assert first != "checkpoint_0000040", "the run finished before a worker could be killed"
    resumed = metric_steps(result.tracking_uri, result.run_id, "train/resumed_from_step")
    assert resumed and resumed[0] >= 10, resumed  # restarted from a checkpoint, not from step 0
    assert metric_steps(result.tracking_uri, result.run_id, "train/loss") == list(range(5, 41, 5))  # each step once
    assert len(runs_named(result.tracking_uri, "tests", cfg.run.name)) == 1
    expected, got = adapter_tensors(reference.adapter_path), adapter_tensors(result.adapter_path)
    assert expected.keys() == got.keys()
    for key in expected:
        assert torch.allclose(expected[key], got[key], atol=1e-5), key


def sft_command(tmp_path: Path, **extra) -> list[str]:
    args = [sys.executable, str(REPO / "jobs" / "sft.py")]
    for item in tiny_overrides(tmp_path, **{**LONG, **extra}):
        args += ["--set", item]
    return args


@pytest.mark.slow
def test_killed_driver_relaunch_resumes_with_each_step_logged_once(tmp_path, tiny_model_path):
    cmd = sft_command(tmp_path, **{"run.name": "driver-killed"})
    first = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    run_dir = tmp_path / "runs" / "driver-killed"
    try:
        checkpoint = wait_for_checkpoint(run_dir)
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    assert checkpoint != "checkpoint_0000040"
    second = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    (run,) = runs_named(uri, "tests", "driver-killed")
    assert run.info.status == "FINISHED"
    assert metric_steps(uri, run.info.run_id, "train/loss") == list(range(5, 41, 5))
    assert metric_steps(uri, run.info.run_id, "train/resumed_from_step")


def interrupted_at(cmd: list[str], line: str, *, env: dict[str, str] | None = None,
                   before: Callable[[subprocess.Popen], None] | None = None) -> tuple[subprocess.Popen, str]:
    """Run ``cmd``, send it SIGINT once it prints ``line`` (after ``before(proc)``), and return the
    ended process with its whole output."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines = []
    for got in proc.stdout:
        lines.append(got)
        if line in got:
            if before:
                before(proc)
            proc.send_signal(signal.SIGINT)
            break
    rest, _ = proc.communicate(timeout=300)
    return proc, "".join(lines) + rest


def test_a_one_worker_job_trains_in_its_own_process_without_ray_and_stops_on_ctrl_c(tmp_path, tiny_model_path):
    """A job of one worker on a machine of its own starts no Ray (``cluster.needs_ray``): Ray Train's
    local mode in the job's process. Ctrl-C there still saves a checkpoint at the next logging step
    and marks the run KILLED (the stop flag is an Event of the process, not a Ray actor)."""
    cmd = sft_command(tmp_path, **{"run.name": "alone", "scaling.num_workers": 1, "train.max_steps": 400,
                                   "train.checkpoint_every_n_steps": 1000})
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc, output = interrupted_at(cmd, "step 10/400", env=env)
    assert proc.returncode == 130, output[-3000:]
    assert "it trains in this process, without starting Ray" in output
    assert "Started a local Ray instance" not in output and "raylet" not in output
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    (run,) = runs_named(uri, "tests", "alone")
    assert run.info.status == "KILLED" and run.data.params["derived.launch"] == "driver"
    stopped_at = int(latest_checkpoint(tmp_path / "runs" / "alone").rsplit("_", 1)[1])
    assert 10 <= stopped_at < 400 and stopped_at % 5 == 0  # at a logging step


@pytest.mark.slow
def test_ctrl_c_checkpoints_marks_killed_and_the_printed_command_resumes(tmp_path, tiny_model_path):
    cmd = sft_command(tmp_path, **{"run.name": "interrupted", "train.max_steps": 120, "train.checkpoint_every_n_steps": 1000})

    def while_it_trains(proc: subprocess.Popen) -> None:  # a second job with the same run name: the folder is locked
        second = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert second.returncode == 2 and f"is in use by process {proc.pid}" in second.stderr, second.stderr[-2000:]

    proc, output = interrupted_at(cmd, "step 10/120", before=while_it_trains)
    assert proc.returncode == 130, output[-3000:]
    assert "stop at the next logging step (within train.log_every_n_steps=5 steps)" in output
    # The driver's own lines (not those Ray forwards from its actors, "(Actor pid=...) ...") are clean.
    driver_lines = "".join(line for line in output.splitlines(keepends=True) if not line.startswith(("(", "\x1b[36m(")))
    assert "interrupted: stopped on request at step" in output and "Traceback" not in driver_lines
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    (run,) = runs_named(uri, "tests", "interrupted")
    assert run.info.status == "KILLED"
    stopped_at = int(latest_checkpoint(tmp_path / "runs" / "interrupted").rsplit("_", 1)[1])
    assert 10 <= stopped_at < 120 and stopped_at % 5 == 0  # at a logging step

    resume = shlex.split(re.search(r"^resume: (.+)$", output, re.MULTILINE)[1])
    relaunch = subprocess.run([sys.executable, *resume[1:]], capture_output=True, text=True, timeout=900)
    assert relaunch.returncode == 0, relaunch.stderr[-3000:]
    (run,) = runs_named(uri, "tests", "interrupted")
    assert run.info.status == "FINISHED"
    assert metric_steps(uri, run.info.run_id, "train/loss") == list(range(5, 121, 5))
    assert metric_steps(uri, run.info.run_id, "train/resumed_from_step") == [stopped_at]


def test_a_finished_run_is_left_alone_continued_with_more_steps_or_restarted(ray_cluster, tmp_path, tiny_model_path):
    from mlflow import MlflowClient

    from zerolab.checkpoints import RunFinished, RunFolder

    # One worker (trained in this process): what is checked is the run folder's record, not the workers.
    overrides = tiny_overrides(tmp_path, **{"train.max_steps": 4, "tracking.registered_model": "kept", "scaling.num_workers": 1})
    result = run_sft(load_config(None, overrides))
    client = MlflowClient(result.tracking_uri)

    with pytest.raises(RunFinished, match="after step 4: nothing was trained or registered"):
        run_sft(load_config(None, overrides))
    (run,) = runs_named(result.tracking_uri, "tests", result.run_name)
    assert run.info.status == "FINISHED" and len(client.search_model_versions("name = 'kept'")) == 1

    with pytest.raises(CheckpointError, match=r"different training config \(adapter.r: 8 -> 16\)"):
        run_sft(load_config(None, [*overrides, "adapter.r=16", "train.max_steps=8"]))

    longer = run_sft(load_config(None, [*overrides, "train.max_steps=6"]))  # continued, in the same MLflow run
    assert longer.run_id == result.run_id and metric_steps(result.tracking_uri, result.run_id, "train/resumed_from_step") == [4]
    assert metric_steps(result.tracking_uri, result.run_id, "train/loss") == [2, 4, 6]
    versions = client.search_model_versions("name = 'kept'")
    assert sorted(v.tags["zerolab.step"] for v in versions) == ["4", "6"]  # one version per trained adapter
    record = RunFolder.of(load_config(None, overrides), str(tmp_path / "runs")).read_record()
    assert (record.status, record.step, record.run_id) == ("finished", 6, result.run_id)

    restarted = run_sft(load_config(None, [*overrides, "adapter.r=16"]), restart=True)
    assert restarted.run_id != result.run_id  # a restart is a new MLflow run


@pytest.mark.slow
def test_a_finished_run_relaunched_from_another_directory_says_where_it_is(ray_cluster, tmp_path, tiny_model_path):
    """The embedded default without a name or a store: a new run, its record beside the run folders;
    naming it again from elsewhere trains nothing, in seconds, and points at both halves."""
    first_dir, second_dir = tmp_path / "one", tmp_path / "two"
    first_dir.mkdir(), second_dir.mkdir()
    base = [sys.executable, str(REPO / "jobs" / "sft.py"), "--set", f"run.storage_path={tmp_path / 'runs'}",
            "--set", "train.max_steps=2", "--set", "data.num_train_rows=64", "--set", "data.num_eval_rows=16",
            "--set", "tracking.system_metrics_interval_s=0"]
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    first = subprocess.run(base, cwd=first_dir, capture_output=True, text=True, timeout=600, env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    # A successful run prints no traceback, not even from Ray's own actors (another Ray instance,
    # the tests' cluster, runs on this machine meanwhile).
    assert "Traceback" not in first.stdout + first.stderr, first.stderr[-3000:]
    store = f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}"
    assert f"mlflow ui --backend-store-uri {store}" in first.stdout and not (first_dir / "mlflow.db").exists()
    name = re.search(r"^run +(\S+)", first.stdout, re.MULTILINE)[1]
    assert re.fullmatch(r"math_sum-tiny-qwen2-\d{8}-\d{6}-[0-9a-f]{4}", name), name

    started = time.monotonic()
    again = subprocess.run([*base, "--set", f"run.name={name}"], cwd=second_dir, capture_output=True, text=True, timeout=300, env=env)
    assert again.returncode == 2, again.stderr[-3000:]
    assert time.monotonic() - started < 60  # refused before Ray starts
    assert f"run '{name}' finished at" in again.stderr and store in again.stderr and "Traceback" not in again.stderr
    assert not (second_dir / "mlflow.db").exists()
    from mlflow import MlflowClient

    client = MlflowClient(store)
    (run,) = runs_named(store, "zerolab", name)
    assert run.info.status == "FINISHED" and run.data.tags["zerolab.run_folder"] == str(tmp_path / "runs" / name)
    assert len(client.search_model_versions("name = 'math_sum-tiny-qwen2'")) == 1


def test_an_unreachable_tracking_server_fails_in_seconds_and_leaves_nothing(tmp_path):
    started = time.monotonic()
    proc = subprocess.run(sft_command(tmp_path, **{"run.name": "no-server", "tracking.uri": "http://user:secretpass@127.0.0.1:9"}),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert time.monotonic() - started < 60
    assert "the MLflow server at http://***@127.0.0.1:9 does not answer" in proc.stderr
    assert "secretpass" not in proc.stdout + proc.stderr and "Traceback" not in proc.stderr
    assert not any((tmp_path / "runs" / "no-server").glob("zerolab_job.json"))


def test_bad_data_exits_2_with_file_and_line(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text('{"text": "张伟在北京", "label": {"name": ["张伟"]}}\n{"text": "x"\n', encoding="utf-8")
    proc = subprocess.run(sft_command(tmp_path, **{"data.task": "ner_json", "data.train_path": str(path)}),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "1 of 2 rows (50.0%) are malformed" in proc.stderr and "train.jsonl:2: invalid JSON" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def test_credentials_in_a_data_uri_are_never_printed(tmp_path):
    proc = subprocess.run(sft_command(tmp_path, **{"data.task": "custom", "data.train_path": "https://user:secretpass@127.0.0.1:9/x.jsonl"}),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "https://***@127.0.0.1:9/x.jsonl: cannot be read" in proc.stderr
    assert "secretpass" not in proc.stdout + proc.stderr and "Traceback" not in proc.stderr


def test_a_gpu_job_in_its_own_process_refuses_another_deepspeed_accelerator(tmp_path):
    """A one-GPU job trains in its own process, with the accelerator DeepSpeed takes from the
    environment: an exported DS_ACCELERATOR=cpu is refused before anything loads (exit 2, one
    paragraph), not met later as an NCCL error on a CPU tensor."""
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "DS_ACCELERATOR": "cpu"}
    proc = subprocess.run(sft_command(tmp_path, **{"scaling.num_workers": 1, "scaling.use_gpu": "true"}),
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "scaling.use_gpu=true, but this process has DS_ACCELERATOR=cpu" in proc.stderr and "Traceback" not in proc.stderr


def test_bad_environment_messages(ray_cluster, tmp_path, tiny_model_path, monkeypatch):
    with pytest.raises(EnvironmentProblem, match="scaling.use_gpu=true but the Ray cluster has no GPUs"):
        run_sft(load_config(None, tiny_overrides(tmp_path, **{"scaling.use_gpu": "true"})))
    with pytest.raises(EnvironmentProblem, match="the cluster has 2"):
        run_sft(load_config(None, tiny_overrides(tmp_path, **{"scaling.num_workers": 3})))
    from zerolab.models import ModelLoadError

    with pytest.raises(ModelLoadError, match="there is no folder"):
        run_sft(load_config(None, tiny_overrides(tmp_path, **{"model.name_or_path": "./models/missing"})))
    with pytest.raises(ModelLoadError, match="no network"):
        run_sft(load_config(None, tiny_overrides(tmp_path, **{"model.name_or_path": "acme/never-published-7b"})))


def test_unreachable_ray_address_is_one_paragraph(tmp_path):
    env = {**os.environ, "RAY_ADDRESS": "127.0.0.1:1"}
    proc = subprocess.run(sft_command(tmp_path), capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "could not reach the Ray cluster at RAY_ADDRESS='127.0.0.1:1'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_keys_added_by_a_later_zerolab_are_not_config_drift(tmp_path):
    from zerolab.checkpoints import JOB_CONFIG_FILE, RunFolder, prepare_run_folder

    storage = str(tmp_path / "runs")
    cfg = load_config(None, tiny_overrides(tmp_path, **{"run.name": "upgraded"}))
    folder = RunFolder.of(cfg, storage)
    recorded_before_the_key_existed = {k: v for k, v in cfg.flat().items() if k != "model.kernels"}

    folder.write_json(JOB_CONFIG_FILE, recorded_before_the_key_existed)
    assert prepare_run_folder(cfg, storage, restart=False).checkpoint is None  # at its default: the same job

    folder.write_json(JOB_CONFIG_FILE, recorded_before_the_key_existed)
    changed = load_config(None, tiny_overrides(tmp_path, **{"run.name": "upgraded", "model.kernels": "none"}))
    with pytest.raises(CheckpointError, match=r"different training config \(model.kernels: 'auto' -> 'none'\)"):
        prepare_run_folder(changed, storage, restart=False)


def test_jobs_on_a_cluster_share_a_warm_trainer_that_stops_on_ctrl_c_and_leaves_when_idle(tmp_path, tiny_model_path, ray_cluster):
    """``scaling.keep_warm_s``: one-worker jobs joining a cluster train in one warm trainer (the
    second job in the process the first one started), whose log each job prints as its own; Ctrl-C
    in the job checkpoints the run at a logging step; the trainer leaves once idle for the last
    job's ``keep_warm_s``."""
    env = {**os.environ, "RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address}
    first = subprocess.run(sft_command(tmp_path, **{"run.name": "warm-1", "scaling.num_workers": 1, "scaling.keep_warm_s": 60,
                                                    "train.max_steps": 4, "train.log_every_n_steps": 2}),
                           env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    pid = re.search(r"starting a warm trainer \(pid (\d+)", first.stderr)[1]
    assert "step 4/4" in first.stderr and "start-up: first optimizer step" in first.stderr

    cmd = sft_command(tmp_path, **{"run.name": "warm-2", "scaling.num_workers": 1, "scaling.keep_warm_s": 2,
                                   "train.max_steps": 400, "train.checkpoint_every_n_steps": 1000})
    proc, output = interrupted_at(cmd, "step 10/400", env=env)
    assert proc.returncode == 130, output[-3000:]
    assert f"reusing the warm trainer (pid {pid} " in output
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    (run,) = runs_named(uri, "tests", "warm-2")
    assert run.info.status == "KILLED" and run.data.params["derived.launch"] == "driver"
    stopped_at = int(latest_checkpoint(tmp_path / "runs" / "warm-2").rsplit("_", 1)[1])
    assert 10 <= stopped_at < 400 and stopped_at % 5 == 0  # at a logging step

    from zerolab.warm import NAMESPACE

    deadline = time.monotonic() + 30
    while any(a["namespace"] == NAMESPACE for a in ray_cluster.util.list_named_actors(all_namespaces=True)):
        assert time.monotonic() < deadline, "the warm trainer did not leave after its keep_warm_s"
        time.sleep(0.5)
