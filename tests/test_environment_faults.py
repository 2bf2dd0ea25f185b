"""Faults of the user's environment (MLflow store, storage, Model Registry, signals, changed data),
found before the first step where they can be and answered with one paragraph, exit 2; those that
can only come later leave a run that a relaunch finishes. Real MLflow stores, real files, real Ray."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, tiny_overrides
from zerolab import stop, tracking
from zerolab.checkpoints import CheckpointError, RunFolder, RunRecord, StorageUnavailable, check_storage, prepare_run_folder
from zerolab.config import load_config


def sft(tmp_path: Path, **extra: object) -> list[str]:
    args = [sys.executable, str(REPO / "jobs" / "sft.py")]
    for item in tiny_overrides(tmp_path, **extra):
        args += ["--set", item]
    return args


def a_store(tmp_path: Path, experiment: str = "tests") -> str:
    """A real SQLite MLflow store with one run in ``experiment``."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_id, _ = tracking.open_run(uri, experiment, "seed-run")
    tracking.close_run(uri, run_id, "FINISHED")
    return uri


# --- the MLflow store ---------------------------------------------------------------------------


def test_a_file_store_is_refused_with_the_sqlite_store_to_use(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    for uri in (f"file://{tmp_path}/mlruns", str(tmp_path / "mlruns")):
        with pytest.raises(tracking.TrackingUnavailable) as found:
            tracking.check_store(uri)
        assert "MLflow 3 refuses unless MLFLOW_ALLOW_FILE_STORE=true" in str(found.value)
        assert f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}" in str(found.value)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    tracking.check_store(f"file://{tmp_path}/mlruns")  # the user opted in


def test_a_damaged_store_is_named_before_anything_starts(tmp_path):
    uri = a_store(tmp_path)
    tracking.check_store(uri)
    db = tmp_path / "mlflow.db"
    data = bytearray(db.read_bytes())
    data[4096:8192] = os.urandom(4096)  # a page of the store overwritten
    db.write_bytes(bytes(data))
    with pytest.raises(tracking.TrackingUnavailable, match=r"is damaged \(.*\): it is not a readable SQLite database"):
        tracking.check_store(uri)
    db.write_bytes(b"not a database at all" * 100)
    with pytest.raises(tracking.TrackingUnavailable, match="is damaged"):
        tracking.check_store(uri)


def test_a_store_locked_by_another_writer_is_named(tmp_path):
    uri = a_store(tmp_path)
    holder = sqlite3.connect(tmp_path / "mlflow.db")
    holder.execute("BEGIN IMMEDIATE")  # another process's write transaction, held open
    try:
        started = time.monotonic()
        with pytest.raises(tracking.TrackingUnavailable, match="is locked by another process"):
            tracking.check_store(uri, timeout_s=0.5)
        assert time.monotonic() - started < 5
    finally:
        holder.rollback()
        holder.close()
    tracking.check_store(uri)


def test_a_deleted_experiment_is_found_with_how_to_restore_it(tmp_path):
    uri = a_store(tmp_path, experiment="gone")
    client = tracking.mlflow_client(uri)
    experiment_id = client.get_experiment_by_name("gone").experiment_id
    client.delete_experiment(experiment_id)
    with pytest.raises(tracking.TrackingUnavailable) as found:
        tracking.StoreCheck(uri, "gone").result()
    assert f"tracking.experiment: the experiment 'gone' (id {experiment_id}) was deleted" in str(found.value)
    assert f"mlflow experiments restore --experiment-id {experiment_id}" in str(found.value)
    tracking.StoreCheck(uri, "another", registry=True).result()


def test_mlflow_never_prints_the_credentials_of_a_tracking_url(mlflow_server, capfd, caplog):
    uri = mlflow_server.replace("http://", "http://alice:s3cretpw@")
    run_id, _ = tracking.open_run(uri, "masked", "run")
    with caplog.at_level("INFO", logger="zerolab.tracking"):
        tracking.close_run(uri, run_id, "FINISHED")
    printed = capfd.readouterr()
    assert "s3cretpw" not in printed.out + printed.err + caplog.text
    assert f"http://***@{mlflow_server.removeprefix('http://')}/#/experiments/" in caplog.text


# --- the Model Registry -------------------------------------------------------------------------


def test_registry_names_mlflow_refuses_are_config_problems():
    assert tracking.model_name_problem("math-tiny.v2", "tracking.registered_model") is None
    for bad in ("bad/name", "a:b", "..", "a/../b", " "):
        problem = tracking.model_name_problem(bad, "tracking.registered_model")
        assert problem and problem.startswith(f"tracking.registered_model: {bad!r} cannot name a registered model")


def test_registry_settings_may_change_on_a_relaunch(tmp_path):
    cfg = load_config(None, tiny_overrides(tmp_path, **{"run.name": "relaunched"}))
    folder = RunFolder.of(cfg, str(tmp_path / "runs"))
    folder.write_record(RunRecord(config=tracking.mask_params(cfg.flat()), status="failed"))
    changed = load_config(None, tiny_overrides(tmp_path, **{"run.name": "relaunched", "tracking.registered_model": "other",
                                                            "tracking.model_alias": "prod", "tracking.register": "false",
                                                            "eval.num_examples": 8}))
    assert prepare_run_folder(changed, str(tmp_path / "runs"), restart=False).record is not None
    trained_otherwise = load_config(None, tiny_overrides(tmp_path, **{"run.name": "relaunched", "adapter.r": 4}))
    with pytest.raises(CheckpointError, match="with a different training config"):
        prepare_run_folder(trained_otherwise, str(tmp_path / "runs"), restart=False)


# --- storage ------------------------------------------------------------------------------------


def test_storage_paths_that_cannot_hold_runs_are_named(tmp_path):
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(StorageUnavailable, match="run.storage_path: .*a-file is a file, not a folder"):
        check_storage(str(tmp_path / "a-file"))
    with pytest.raises(StorageUnavailable, match="a part of the path is a file"):
        check_storage(str(tmp_path / "a-file" / "runs"))
    with pytest.raises(StorageUnavailable, match="is not a storage location zerolab can open"):
        check_storage("nosuchscheme://bucket/runs")
    check_storage(str(tmp_path / "new" / "runs"))
    assert (tmp_path / "new" / "runs").is_dir() and not any((tmp_path / "new" / "runs").iterdir())  # the probe is gone


def test_a_memory_snapshot_folder_that_cannot_be_written_stops_the_job_before_it_starts(tmp_path):
    from zerolab.run import run_sft

    (tmp_path / "a-file").write_text("x")
    cfg = load_config(None, tiny_overrides(tmp_path, **{"scaling.use_gpu": "true", "train.memory_snapshot_dir": str(tmp_path / "a-file")}))
    with pytest.raises(StorageUnavailable, match="train.memory_snapshot_dir: .*a-file is a file, not a folder; give a folder for the "
                                                 "allocator histories"):
        run_sft(cfg)


# --- changed data -------------------------------------------------------------------------------


def test_a_relaunch_on_changed_data_is_refused_unless_accepted(tmp_path, caplog):
    from zerolab.checkpoints import check_same_data

    cfg = load_config(None, tiny_overrides(tmp_path, **{"run.name": "data-run"}))
    folder = RunFolder.of(cfg, str(tmp_path / "runs"))
    record = RunRecord(config={}, data={"train": "a" * 64, "eval": "b" * 64})
    check_same_data(cfg, folder, record, {"train": "a" * 64, "eval": "b" * 64})
    with pytest.raises(CheckpointError) as found:
        check_same_data(cfg, folder, record, {"train": "c" * 64, "eval": "b" * 64})
    message = str(found.value)
    assert f"train data {'a' * 16} -> {'c' * 16}" in message and "eval data" not in message
    assert "start the run over" in message and "new run.name" in message and "--" not in message  # the job adds its flags
    assert found.value.remedies == ("restart", "accept_changed_data")
    check_same_data(cfg, folder, record, {"train": "c" * 64}, accept=True)
    assert "resumes on changed data" in caplog.text
    check_same_data(cfg, folder, RunRecord(config={}), {"train": "c" * 64})  # a record from before fingerprints were kept


# --- signals ------------------------------------------------------------------------------------


def test_a_signal_during_a_record_write_waits_for_the_write():
    events = []
    before = signal.getsignal(signal.SIGTERM)
    with stop.signals_interrupt():
        with pytest.raises(KeyboardInterrupt):
            with stop.shielded():
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)  # the handler runs here, and defers
                events.append("write finished")
        events.append("interrupted after it")
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
    assert events == ["write finished", "interrupted after it"]
    assert signal.getsignal(signal.SIGTERM) is before  # handlers restored


# --- jobs ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["file store", "damaged store", "storage is a file", "registry name"])
def test_environment_faults_end_the_job_with_exit_2_and_one_paragraph(tmp_path, case, monkeypatch):
    from zerolab.cli import USER_ERROR, run_job
    from zerolab.run import run_sft

    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    extra: dict[str, object] = {"run.name": "faulty"}
    if case == "file store":
        extra["tracking.uri"] = f"file://{tmp_path}/mlruns"
        expected = "is a file store (a folder of files), which MLflow 3 refuses"
    elif case == "damaged store":
        (tmp_path / "mlflow.db").write_bytes(b"\x00garbage" * 512)
        expected = "is damaged"
    elif case == "storage is a file":
        (tmp_path / "runs").write_text("not a folder")
        expected = "run.storage_path: "
    else:
        extra["tracking.registered_model"] = "team/adapter"
        expected = "tracking.registered_model: 'team/adapter' cannot name a registered model"
    code, message = run_job(lambda: run_sft(load_config(None, tiny_overrides(tmp_path, **extra))))
    assert code == USER_ERROR and expected in message, message
    assert not (tmp_path / "runs" / "faulty").exists()


def test_a_file_store_ends_the_job_in_seconds_without_a_traceback(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_ALLOW_FILE_STORE", "MLFLOW_TRACKING_URI")}
    started = time.monotonic()
    proc = subprocess.run(sft(tmp_path, **{"tracking.uri": f"file://{tmp_path}/mlruns"}), capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "MLflow 3 refuses unless MLFLOW_ALLOW_FILE_STORE=true" in proc.stderr and "Traceback" not in proc.stderr
    assert time.monotonic() - started < 60 and not any((tmp_path / "runs").iterdir())  # no run folder left


@pytest.mark.ray
def test_ctrl_c_as_the_mlflow_run_opens_stops_at_once_and_leaves_the_store_usable(tmp_path, tiny_model_path):
    """The moment the run is opened its params are being written to SQLite: Ctrl-C there waits for
    the write, then stops the job (exit 130) with the resume line; the store is not left locked."""
    cmd = sft(tmp_path, **{"run.name": "early-stop", "train.max_steps": 400})
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "MLflow run " in line and "(new)" in line:
            proc.send_signal(signal.SIGINT)
            sent = time.monotonic()
            break
    rest, _ = proc.communicate(timeout=120)
    output = "".join(lines) + rest
    assert proc.returncode == 130, output[-3000:]
    assert time.monotonic() - sent < 30
    assert "database is locked" not in output
    assert "resume: " in output and "run.name=early-stop" in output
    driver_lines = "".join(line for line in output.splitlines(keepends=True) if not line.startswith(("(", "\x1b[36m(")))
    assert "Traceback" not in driver_lines
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracking.check_store(uri, timeout_s=1)  # not locked
    client = tracking.mlflow_client(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("tests").experiment_id])
    assert run.info.status == "KILLED"


def test_a_run_stopped_after_its_final_checkpoint_finishes_on_relaunch_without_training(tmp_path, tiny_model_path):
    """A job in its own process stopped after the last step's checkpoint (during the adapter's upload,
    the registration or the evaluation) left a run to resume with nothing to train: the relaunch
    ends it at that checkpoint with its recorded metrics, where it used to fail an assertion."""
    from zerolab.run import run_sft

    cfg = load_config(None, tiny_overrides(tmp_path, **{"model.name_or_path": tiny_model_path, "scaling.num_workers": 1,
                                                        "scaling.launch": "driver", "train.max_steps": 4,
                                                        "train.checkpoint_every_n_steps": 2, "data.num_eval_rows": 0}))
    first = run_sft(cfg)
    folder = RunFolder.of(cfg, cfg.run.storage_path)
    record = folder.read_record()
    record.status = "stopped"  # as the stop handler leaves it
    folder.write_record(record)

    again = run_sft(cfg)
    assert again.checkpoint_path == first.checkpoint_path and again.metrics["step"] == 4
    assert again.metrics["train/loss"] == pytest.approx(first.metrics["train/loss"])
    assert folder.read_record().status == "finished"


@pytest.mark.ray
def test_a_registry_fault_after_training_keeps_the_run_and_changed_data_is_refused(ray_cluster, tmp_path, tiny_model_path):
    """The Model Registry refuses the trained adapter (a trigger in the real store): the job ends with
    one message, the run folder keeps its checkpoint, and once the registry works a relaunch
    registers it without training again, under a new name if the user changes it; a relaunch on
    changed data is refused in between."""
    from zerolab.run import run_sft
    from zerolab.tasks import generate_dataset

    data = generate_dataset("math_sum", 96, seed=1, path=tmp_path / "train.jsonl")
    overrides = {"run.name": "registry-fault", "data.train_path": str(data), "data.num_eval_rows": 0, "train.max_steps": 6}
    uri = a_store(tmp_path)
    db = sqlite3.connect(tmp_path / "mlflow.db")
    db.execute("CREATE TRIGGER registry_down BEFORE INSERT ON model_versions BEGIN SELECT RAISE(ABORT, 'registry unavailable'); END")
    db.commit()
    with pytest.raises(tracking.RegistrationFailed, match=r"failed \(Model Version creation error.*The training and its checkpoint are kept"):
        run_sft(load_config(None, tiny_overrides(tmp_path, **overrides)))
    record = json.loads((tmp_path / "runs" / "registry-fault" / "zerolab_job.json").read_text())
    assert record["status"] == "failed" and record["step"] == 6 and set(record["data"]) == {"train"}
    db.execute("DROP TRIGGER registry_down")
    db.commit()
    db.close()

    original = data.read_bytes()
    generate_dataset("math_sum", 96, seed=2, path=data)  # other rows, same count
    with pytest.raises(CheckpointError, match="was trained on other data than its files hold now"):
        run_sft(load_config(None, tiny_overrides(tmp_path, **overrides)))
    data.write_bytes(original)

    result = run_sft(load_config(None, tiny_overrides(tmp_path, **{**overrides, "tracking.registered_model": "renamed"})))
    versions = tracking.mlflow_client(uri).search_model_versions("name = 'renamed'")
    assert [v.run_id for v in versions] == [result.run_id]
    losses = tracking.mlflow_client(uri).get_metric_history(result.run_id, "train/loss")
    assert sorted(m.step for m in losses) == [2, 4, 6]  # trained once


def test_the_job_adds_the_flags_of_a_user_errors_remedies():
    from zerolab.checkpoints import DataChanged
    from zerolab.cli import REMEDIES, USER_ERROR, run_job

    def job():
        raise DataChanged("run 'r' was trained on other data; start the run over, or resume it on the new data knowingly.")

    assert run_job(job, remedies=REMEDIES) == (USER_ERROR, "\nerror: run 'r' was trained on other data; start the run over, or "
                                               "resume it on the new data knowingly.\n  --restart starts the run over, discarding "
                                               "its checkpoints\n  --accept-changed-data resumes the run on the changed data")
    assert "--restart" not in run_job(job)[1]  # a job without the flag offers none


def test_training_that_hands_back_no_final_checkpoint_ends_with_where_the_run_resumes(tmp_path):
    """Ray Train's result can lack the final checkpoint (its checkpoint manager missed the last
    report): the job says where the run folder's latest is and how to go on, exit 1, no traceback."""
    import pyarrow.fs as pafs

    from zerolab.checkpoints import record_checkpoint
    from zerolab.cli import TRAINING_FAILED, run_job
    from zerolab.run import no_final_checkpoint

    folder = RunFolder(fs=pafs.LocalFileSystem(), path=str(tmp_path / "r"), uri=str(tmp_path / "r"))
    assert str(no_final_checkpoint(folder, {}, "r")) == (
        f"training ended without Ray Train handing back a final checkpoint; the run folder {tmp_path / 'r'} holds none; "
        "relaunch with run.name=r to train it again.")
    (tmp_path / "ckpt" / "adapter").mkdir(parents=True)
    (tmp_path / "ckpt" / "adapter" / "adapter_config.json").write_text("{}")
    folder.fs.create_dir(folder.path)  # the job made the run folder
    record_checkpoint(folder, tmp_path / "ckpt", "checkpoint_000002", {"step": 2}, keep=2)

    def job():
        raise no_final_checkpoint(folder, {"step": 4}, "r")

    assert run_job(job) == (TRAINING_FAILED, f"\ntraining failed: training ended after step 4 without Ray Train handing back a "
                                             f"final checkpoint; the run folder {tmp_path / 'r'} holds checkpoint_000002 as its "
                                             "latest; relaunch with run.name=r to resume there.")


# --- the Ray cluster ----------------------------------------------------------------------------

def test_a_question_to_the_cluster_left_unanswered_ends_at_its_deadline():
    """Under Ray Client the cluster is asked through Ray's public API from a thread: a request that
    never returns ends in the message at the deadline; an answer, or the question's own error, passes through."""
    import threading

    from zerolab.cluster import ask_cluster
    from zerolab.errors import EnvironmentProblem

    started = time.monotonic()
    with pytest.raises(EnvironmentProblem, match="did not answer within 1 s when asked for its nodes"):
        ask_cluster(threading.Event().wait, "its nodes", timeout_s=1.0)
    assert time.monotonic() - started < 3
    assert ask_cluster(lambda: {"CPU": 2.0}, "its resources") == {"CPU": 2.0}
    with pytest.raises(KeyError):
        ask_cluster(lambda: {}["GPU"], "its resources")


@pytest.mark.ray
def test_the_nodes_and_resources_asked_with_a_deadline_are_rays_own(ray_cluster):
    from zerolab.cluster import cluster_nodes, cluster_resources

    ours = {n["NodeID"]: (n["Alive"], n["Resources"]) for n in cluster_nodes()}
    assert ours == {n["NodeID"]: (n["Alive"], n["Resources"]) for n in ray_cluster.nodes()}
    assert cluster_resources() == ray_cluster.cluster_resources()


@pytest.mark.ray
def test_a_ray_head_that_stops_answering_ends_the_preflight_with_a_message(tmp_path):
    """The launch's resource check against a real local Ray whose GCS process is stopped (SIGSTOP):
    ``ray.cluster_resources()`` would wait for ever, in native code no signal interrupts; the check
    asks through the driver's GCS client with a deadline and ends with a message naming the cluster."""
    script = tmp_path / "stopped_gcs.py"
    script.write_text(f'''
import sys, time
sys.path[:0] = [{str(REPO)!r}, {str(REPO / "platform")!r}]
import psutil, ray
from zerolab import cluster
from zerolab.config import load_config
from zerolab.errors import EnvironmentProblem
from zerolab.plan import check_resources
cluster.CLUSTER_ANSWER_S = 3.0
ray.init(address="local", num_cpus=1, include_dashboard=False, logging_level="ERROR")  # its own, whatever `ray start` left running
gcs = [p for p in psutil.Process().children(recursive=True) if p.name() == "gcs_server"]
assert gcs, "no gcs_server process under this driver"
def stopped(p):  # SIGSTOP lands when each of its threads is next scheduled: until then the GCS may still answer
    return all(open(f"/proc/{{p.pid}}/task/{{t.id}}/stat").read().rsplit(")", 1)[1].split()[0] == "T" for t in p.threads())
try:
    for p in gcs:
        p.suspend()
    deadline = time.monotonic() + 30
    while not all(stopped(p) for p in gcs):
        assert time.monotonic() < deadline, "the gcs_server did not stop within 30 s of SIGSTOP"
        time.sleep(0.01)
    started = time.monotonic()
    check_resources(load_config(None, ["scaling.use_gpu=false", "scaling.num_workers=1"]), "workers")
    print(f"ANSWERED after {{time.monotonic() - started:.1f}} s")
except EnvironmentProblem as exc:
    print(f"REFUSED after {{time.monotonic() - started:.1f}} s: {{exc}}")
finally:
    for p in gcs:
        p.resume()
    ray.shutdown()
''')
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    line = next((x for x in out.stdout.splitlines() if x.startswith(("REFUSED", "ANSWERED"))), out.stdout + out.stderr[-2000:])
    assert line.startswith("REFUSED"), line
    assert float(line.split()[2]) < 10, line
    assert "did not answer within 3 s when asked for its nodes" in line and "local Ray instance" in line, line
