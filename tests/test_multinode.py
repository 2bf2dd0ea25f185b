"""A multi-node Ray cluster simulated on one machine with Ray's cluster_utils: a head and two worker
nodes, each with its own raylet, object store and CPUs, token authentication on as on the clusters
infra/ starts. A 2-worker jobs/sft.py run, joined the way `ray job submit` joins a cluster, puts its
workers on different nodes, checkpoints to storage all nodes share, loses a worker node mid-run and
finishes on the nodes left, from its last checkpoint."""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

import pytest

from conftest import free_port, tiny_overrides
from zerolab.checkpoints import RunFolder, verify_checkpoint
from zerolab.cluster import connect_ray
from zerolab.config import load_config
from zerolab.run import run_sft, storage_path

pytestmark = [pytest.mark.ray, pytest.mark.slow]

STEPS, CHECKPOINT_EVERY = 16, 4


@pytest.fixture
def cluster(monkeypatch):
    """A head and two worker nodes with 1 CPU each: a node fits one training worker, so two workers
    are on two nodes. The head's CPU can take a training worker, so the two nodes left after a
    worker node is lost still fit the job. Only this cluster is shut down afterwards."""
    import ray
    from ray._private.authentication.authentication_token_setup import _enable_token_auth, ensure_token_if_auth_enabled
    from ray._private.services import get_node_ip_address
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    # What `ray.init()` does for a new local cluster: token mode for this process and the nodes it
    # starts, with the default token file (created if missing).
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    _enable_token_auth()
    ensure_token_if_auth_enabled(None, create_token_if_missing=True)
    # Other Ray instances may run on this machine. Every process of this cluster, and the driver
    # (as under `ray job submit`), gets this cluster's address: Ray Train's placement-group cleaner
    # queries the state API, which otherwise picks the instance named in <temp>/ray/ray_current_cluster.
    # cluster_utils writes that file; a temp root of our own keeps it (and the sessions) from other
    # instances' processes. Short: Ray's socket paths have a length limit.
    ray_tmp = tempfile.mkdtemp(prefix="rt", dir="/tmp")
    monkeypatch.setenv("RAY_TMPDIR", ray_tmp)
    gcs_port = free_port()
    monkeypatch.setenv("RAY_ADDRESS", f"{get_node_ip_address()}:{gcs_port}")
    # Failures and reported checkpoints are noticed at this interval (default 2 s).
    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
    simulated = Cluster()
    try:
        # The dashboard (on 127.0.0.1, as infra/ runs it) serves the state API.
        simulated.add_node(num_cpus=1, gcs_server_port=gcs_port, include_dashboard=True, dashboard_host="127.0.0.1",
                           dashboard_port=free_port())
        for _ in range(2):
            simulated.add_node(num_cpus=1)
        simulated.wait_for_nodes()
        assert simulated.address == f"{get_node_ip_address()}:{gcs_port}", simulated.address
        yield simulated
    finally:
        ray.shutdown()
        simulated.shutdown()
        shutil.rmtree(ray_tmp, ignore_errors=True)


def registered_checkpoint(folder: RunFolder) -> str | None:
    """The newest checkpoint Ray Train's controller has registered (the one a restart resumes from)."""
    try:
        return folder.latest_checkpoint()
    except json.JSONDecodeError:  # being written
        return None


def placed_worker_group() -> tuple[str, list[str]] | None:
    """(placement group id, node ids of its bundles) of the training worker group, once placed."""
    import ray

    for pg_id, pg in ray.util.placement_group_table().items():
        if pg["strategy"] == "STRICT_SPREAD" and pg["state"] == "CREATED":
            return pg_id, list(pg["bundles_to_node_id"].values())
    return None


def training_workers_by_group() -> dict[str, list[str]]:
    """Node ids of the training workers of every worker group Ray Train started (live and dead),
    by placement group id, from the state API of this cluster."""
    import ray
    from ray.util.state import list_actors

    groups: dict[str, list[str]] = defaultdict(list)
    for actor in list_actors(address=ray.get_runtime_context().gcs_address, detail=True, limit=1000,
                             filters=[("class_name", "=", "RayTrainWorker")]):
        groups[actor.placement_group_id].append(actor.node_id)
    return dict(groups)


def test_two_node_run_loses_a_node_and_resumes_on_the_rest(cluster, tmp_path, tiny_model_path, caplog):
    from mlflow import MlflowClient

    cfg = load_config(None, tiny_overrides(tmp_path, **{
        "data.num_train_rows": 64, "data.num_eval_rows": 0, "train.micro_batch_size": 8,
        "train.max_steps": STEPS, "train.checkpoint_every_n_steps": CHECKPOINT_EVERY, "train.log_every_n_steps": CHECKPOINT_EVERY,
        "scaling.placement_strategy": "STRICT_SPREAD", "run.max_failures": 1,
    }))
    outcome: dict = {}

    def train() -> None:
        try:
            outcome["result"] = run_sft(cfg)
        except BaseException as exc:  # re-raised below, in the test's thread
            outcome["error"] = exc

    connect_ray(cfg)  # joins the cluster at RAY_ADDRESS, as under `ray job submit`
    thread = threading.Thread(target=train, daemon=True)
    thread.start()
    deadline = time.time() + 300
    while (placed := placed_worker_group()) is None and thread.is_alive() and time.time() < deadline:
        time.sleep(0.05)
    assert placed, outcome.get("error") or "the training workers were never placed"
    first_group, first_nodes = placed
    victim = next(n for n in cluster.worker_nodes if n.node_id in first_nodes)
    folder = RunFolder.of(cfg, storage_path(cfg))
    run_dir = tmp_path / "runs" / cfg.run.name
    while (first := registered_checkpoint(folder)) is None and thread.is_alive() and time.time() < deadline:
        time.sleep(0.05)
    assert first is not None, outcome.get("error") or f"no checkpoint was registered in {run_dir}"
    cluster.remove_node(victim)  # its raylet, object store and the training worker on it die
    thread.join(timeout=600)
    assert not thread.is_alive(), "the run did not finish after the node was removed"
    if "error" in outcome:
        raise outcome["error"]
    result = outcome["result"]

    # Resumed once, from a checkpoint registered before the loss (not from step 0), and finished.
    client = MlflowClient(result.tracking_uri)
    resumed = {m.step: m.value for m in client.get_metric_history(result.run_id, "train/resumed_from_step")}
    assert len(resumed) == 1, f"resumed at steps {sorted(resumed)}: the run finished before the node was removed, or restarted twice"
    ((resumed_step, value),) = resumed.items()
    assert int(first.rsplit("_", 1)[1]) <= resumed_step == value < STEPS and resumed_step % CHECKPOINT_EVERY == 0, (first, resumed)
    assert result.metrics["step"] == STEPS

    # Two workers on two nodes; after the loss, two workers on the two nodes left.
    groups = training_workers_by_group()
    assert len(groups) == 2 and sorted(groups[first_group]) == sorted(first_nodes) and len(set(first_nodes)) == 2, groups
    (second_nodes,) = [nodes for group, nodes in groups.items() if group != first_group]
    assert sorted(second_nodes) == sorted([cluster.head_node.node_id, *(n.node_id for n in cluster.worker_nodes)]), groups

    # The final checkpoint is in the storage folder both nodes share, with the DeepSpeed state of
    # both ranks (each written from its own node), and is what a relaunch would resume from.
    checkpoint = Path(result.checkpoint_path)
    assert checkpoint == run_dir / f"checkpoint_{STEPS:07d}" and registered_checkpoint(folder) == checkpoint.name
    verify_checkpoint(folder, checkpoint.name, stage=cfg.deepspeed.stage, world_size=2)
    assert {"rng_rank0.pt", "rng_rank1.pt", "adapter"} <= {p.name for p in checkpoint.iterdir()}

    # One MLflow run, finished, with every logged step once across the restart. Its store is a file
    # that every node here sees; the driver says that it must be.
    assert "is a file, and the Ray cluster has 3 nodes" in caplog.text
    experiment = client.get_experiment_by_name(cfg.tracking.experiment)
    (run,) = [r for r in client.search_runs([experiment.experiment_id]) if r.info.run_name == cfg.run.name]
    assert run.info.run_id == result.run_id and run.info.status == "FINISHED"
    logged = sorted(m.step for m in client.get_metric_history(run.info.run_id, "train/loss"))
    assert logged == list(range(CHECKPOINT_EVERY, STEPS + 1, CHECKPOINT_EVERY))
