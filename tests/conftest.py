"""Shared fixtures: tiny configs, one local Ray cluster per session, a temp MLflow store."""

from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ["HF_HUB_OFFLINE"] = "1"  # tests never download; an attempt fails at once instead of timing out


def tiny_overrides(tmp_path: Path, **extra: object) -> list[str]:
    """Overrides for a short CPU run: small generated data, few steps, temp storage and MLflow."""
    values: dict[str, object] = {
        "data.num_train_rows": 192,
        "data.num_eval_rows": 32,
        "train.micro_batch_size": 8,
        "train.max_steps": 10,
        "train.log_every_n_steps": 2,
        "run.name": f"t-{uuid.uuid4().hex[:8]}",
        "run.storage_path": str(tmp_path / "runs"),
        "tracking.uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "tracking.experiment": "tests",
        "tracking.system_metrics_interval_s": 0,
    }
    values.update(extra)
    return [f"{k}={v}" for k, v in values.items()]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rows_of(lengths, seed=0):
    """Tokenized rows (ids, labels) of the given lengths, the first half of each masked as prompt."""
    import numpy as np

    from zerolab.batches import IGNORE_INDEX

    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        ids = rng.integers(5, 1000, size=n)
        labels = ids.copy()
        labels[: n // 2] = IGNORE_INDEX
        out.append((ids, labels))
    return out


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray instance for the whole session (starting Ray costs seconds each time)."""
    import ray

    from zerolab.config import load_config
    from zerolab.run import connect_ray

    connect_ray(load_config(None, []))
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    from zerolab.models import build_tiny_model

    return str(build_tiny_model())


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """A real `mlflow server` on a free loopback port with its own SQLite store and proxied
    artifacts (as a team server runs); yields its http:// URI."""
    import subprocess
    import sys
    import time
    import urllib.request

    root = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    log = (root / "server.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--artifacts-destination", str(root / "artifacts")],
        stdout=log, stderr=subprocess.STDOUT, cwd=root,
    )
    uri = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise RuntimeError(f"mlflow server did not start: {(root / 'server.log').read_text()[-2000:]}")
        time.sleep(0.5)
    yield uri
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
