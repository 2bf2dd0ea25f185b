"""`ray job submit` against a `ray start --head` cluster, from a Python environment that has the
dependencies but not zerolab: the job must ship zerolab to its workers itself."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from conftest import free_port

pytestmark = [pytest.mark.ray, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]


def env_without_zerolab(root: Path) -> Path:
    """A venv that sees this environment's packages (a plain path in a .pth file) but not the
    editable zerolab install (whose own .pth is not processed from there)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    site = next(root.glob("lib/python*/site-packages"))
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return root / "bin" / "python"


def test_ray_job_submit_ships_zerolab(tmp_path, tiny_model_path):
    """A two-worker job ships zerolab to its workers; a one-worker job submitted with the CPUs its
    worker needs (``--entrypoint-num-cpus``) trains in the job's own process (``scaling.launch=auto``)."""
    python = env_without_zerolab(tmp_path / "env")
    probe = subprocess.run([str(python), "-c", "import ray, deepspeed, peft, mlflow; import zerolab"], capture_output=True, text=True)
    assert "No module named 'zerolab'" in probe.stderr, probe.stderr

    work = tmp_path / "checkout"
    for part in ("platform", "jobs", "ds_configs"):
        shutil.copytree(REPO / part, work / part, ignore=shutil.ignore_patterns("__pycache__"))
    config = {
        "data": {"num_train_rows": 96, "num_eval_rows": 16},
        "train": {"micro_batch_size": 8, "max_steps": 4, "log_every_n_steps": 2},
        "run": {"name": "submitted", "storage_path": str(tmp_path / "runs")},
        "tracking": {"experiment": "submit"},  # the default store: beside the run folders, not in the job's working dir
    }
    (work / "small.yaml").write_text(yaml.safe_dump(config))

    # Token authentication, as a real cluster should run: the head and the client share a token.
    token = tmp_path / "ray_token"
    token.write_text(secrets.token_hex(32))
    env = {**os.environ, "PATH": f"{python.parent}:{os.environ['PATH']}", "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    env.pop("RAY_ADDRESS", None)
    env.pop("MLFLOW_TRACKING_URI", None)
    ray_tmp = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: Ray's socket paths have a length limit
    # Every fixed default port its own: another Ray instance on this machine (the tests' session
    # cluster) holds the defaults, and a job agent that cannot bind 52365 takes no jobs.
    ports = {"--port": free_port(), "--dashboard-port": free_port(), "--ray-client-server-port": free_port(),
             "--dashboard-agent-listen-port": free_port(), "--dashboard-agent-grpc-port": free_port(),
             "--metrics-export-port": free_port(), "--runtime-env-agent-port": free_port()}
    head = subprocess.Popen(
        [str(python), "-m", "ray.scripts.scripts", "start", "--head", "--block", "--num-cpus=2", "--include-dashboard=true",
         f"--temp-dir={ray_tmp}",  # its own session files: nothing left behind for other drivers to find
         *[f"{k}={v}" for k, v in ports.items()]],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    address = f"http://127.0.0.1:{ports['--dashboard-port']}"
    try:
        deadline = time.time() + 90
        while time.time() < deadline:
            ok = subprocess.run([str(python), "-m", "ray.scripts.scripts", "job", "list", "--address", address],
                                env=env, capture_output=True, text=True)
            if ok.returncode == 0:
                break
            time.sleep(2)
        else:
            pytest.fail(f"the Ray head did not come up: {ok.stderr[-2000:]}")

        def submit(*args: str, ok: bool = True) -> str:
            for _ in range(15):  # the job API answers before the node's agent can take jobs
                done = subprocess.run(
                    [str(python), "-m", "ray.scripts.scripts", "job", "submit", "--address", address, "--working-dir", str(work),
                     *args], env=env, capture_output=True, text=True, timeout=600,
                )
                output = done.stdout + done.stderr
                if "No available agent to submit job" not in output:
                    break
                time.sleep(2)
            assert (done.returncode == 0 and "' succeeded" in output) == ok, output[-4000:]
            return output

        output = submit("--", "python", "jobs/sft.py", "--config", "small.yaml")
        submit("--entrypoint-num-cpus", "1", "--", "python", "jobs/sft.py", "--config", "small.yaml",
               "--set", "run.name=one-worker", "--set", "scaling.num_workers=1")
        # Two workers of one CPU each cannot start beside the CPU the job's own process holds (the
        # head has two): refused at once, not left waiting for resources.
        refused = submit("--entrypoint-num-cpus", "1", "--", "python", "jobs/sft.py", "--config", "small.yaml",
                         "--set", "run.name=refused", ok=False)
        assert "cluster has 2, less 1 CPU that the job's own process holds" in refused, refused[-4000:]
        assert "Traceback" not in refused
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        head.wait(timeout=60)
        shutil.rmtree(ray_tmp, ignore_errors=True)

    # The head is gone with its session files (`ray stop`); the record is where the job said it is.
    store = f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}"
    assert f"mlflow ui --backend-store-uri {store}" in output and "/ray/session_" not in output.split("mlflow ui")[-1]
    from mlflow import MlflowClient

    client = MlflowClient(store)
    runs = client.search_runs([client.get_experiment_by_name("submit").experiment_id])
    by_name = {r.info.run_name: r for r in runs}
    assert sorted(by_name) == ["one-worker", "submitted"] and all(r.info.status == "FINISHED" for r in runs)
    assert {n: r.data.params["derived.launch"] for n, r in by_name.items()} == {"submitted": "workers", "one-worker": "driver"}
    for run in runs:
        assert len(client.get_metric_history(run.info.run_id, "train/loss")) == 2
        assert client.list_artifacts(run.info.run_id, "adapter")
