"""``run.storage_path=s3://...`` against a real S3-compatible server (moto's, on loopback): the run
folder and its checkpoints land in the bucket, a killed worker resumes from them, the pre-resume
checks read them there, the adapter reaches an MLflow artifact store on the same server, and no
credential is recorded. The settings are the ones a user exports (docs/running.md, "S3 and GCS storage")."""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

import pytest

from conftest import free_port, kill_a_training_worker, tiny_overrides
from zerolab.checkpoints import (
    JOB_CONFIG_FILE,
    LOCK_FILE,
    SNAPSHOT_FILE,
    CheckpointError,
    RunFinished,
    RunFolder,
    RunRecord,
    choose_checkpoint,
    prepare_run_folder,
)
from zerolab.config import load_config

BUCKET = "zerolab"
ACCESS_KEY, SECRET_KEY = "AKIAZEROLABTESTKEY01", "zerolab/test+secret-4f1e9c"
URI_SECRET = "zerolabUriSecret4f1e9c"  # URI user info: no characters that need escaping
STEPS = {"train.max_steps": 20, "train.checkpoint_every_n_steps": 5, "train.log_every_n_steps": 5,
         "train.micro_batch_size": 16, "data.num_train_rows": 256}


@pytest.fixture(scope="module")
def s3_endpoint():
    """A moto S3 server on a free loopback port; yields its http:// endpoint."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture
def s3_env(s3_endpoint, monkeypatch):
    """What a user exports for an S3-compatible store: credentials, region and endpoint (for
    pyarrow, boto3 and MLflow's artifact client)."""
    env = {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": s3_endpoint, "MLFLOW_S3_ENDPOINT_URL": s3_endpoint}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return env


@pytest.fixture
def s3_ray(s3_env, monkeypatch):
    """A local Ray cluster started with the S3 settings in its environment: its workers inherit the
    environment of the process that starts it, as a cluster node's workers get the node's. The
    session's cluster, where one runs, is started again without them afterwards."""
    import ray

    from zerolab.cluster import connect_ray

    was_running = ray.is_initialized()
    ray.shutdown()
    connect_ray(load_config(None, []))
    yield ray
    ray.shutdown()
    for key in s3_env:
        monkeypatch.delenv(key)
    if was_running:
        connect_ray(load_config(None, []))


def s3_client(endpoint: str):
    import boto3

    return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
                        region_name="us-east-1")


def keys_under(s3, prefix: str) -> list[str]:
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return [obj["Key"] for page in pages for obj in page.get("Contents", [])]


def latest_checkpoint(s3, run_key: str) -> str | None:
    try:
        body = s3.get_object(Bucket=BUCKET, Key=f"{run_key}/{SNAPSHOT_FILE}")["Body"].read()
        latest = json.loads(body).get("latest_checkpoint_result")
    except (s3.exceptions.NoSuchKey, json.JSONDecodeError):
        return None
    if isinstance(latest, str):
        latest = json.loads(latest)
    return (latest or {}).get("checkpoint_dir_name")


def assert_no_credentials(text: str, where: str) -> None:
    assert not any(secret in text for secret in (ACCESS_KEY, SECRET_KEY, URI_SECRET)), f"a credential in {where}"


@pytest.mark.ray
@pytest.mark.slow
def test_s3_run_folder_killed_worker_resume_and_mlflow_artifacts(s3_ray, s3_env, tmp_path, tiny_model_path):
    from mlflow import MlflowClient
    from mlflow.artifacts import download_artifacts

    from zerolab.run import run_sft, storage_path

    endpoint = s3_env["AWS_ENDPOINT_URL"]
    s3 = s3_client(endpoint)
    s3.create_bucket(Bucket=BUCKET)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    MlflowClient(uri).create_experiment("s3", artifact_location=f"s3://{BUCKET}/mlflow")
    cfg = load_config(None, tiny_overrides(tmp_path, **STEPS, **{"run.storage_path": f"s3://{BUCKET}/runs", "run.max_failures": 1,
                                                                 "tracking.uri": uri, "tracking.experiment": "s3"}))
    run_key = f"runs/{cfg.run.name}"
    outcome: dict = {}
    thread = threading.Thread(target=lambda: outcome.setdefault("result", run_sft(cfg)), daemon=True)
    thread.start()
    deadline = time.time() + 240
    while (first := latest_checkpoint(s3, run_key)) is None:
        assert time.time() < deadline and thread.is_alive(), f"no checkpoint appeared in s3://{BUCKET}/{run_key}"
        time.sleep(0.05)
    kill_a_training_worker()
    thread.join(timeout=600)
    assert "result" in outcome, "the run failed (its error is printed above)"
    result = outcome["result"]

    assert first != "checkpoint_0000020", "the run finished before a worker could be killed"
    final = f"s3://{BUCKET}/{run_key}/checkpoint_0000020"
    assert (result.checkpoint_path, result.adapter_path) == (final, f"{final}/adapter")
    keys = set(keys_under(s3, run_key))
    for name in (JOB_CONFIG_FILE, SNAPSHOT_FILE, "checkpoint_0000020/adapter/adapter_model.safetensors",
                 "checkpoint_0000020/adapter/adapter_config.json", "checkpoint_0000020/deepspeed/state/mp_rank_00_model_states.pt"):
        assert f"{run_key}/{name}" in keys, (name, sorted(keys))
    assert not any(k.startswith(f"{run_key}/checkpoint_0000005/") for k in keys)  # train.keep_checkpoints=2, deleted in S3 too

    client = MlflowClient(uri)
    resumed = client.get_metric_history(result.run_id, "train/resumed_from_step")
    assert resumed and resumed[0].value >= 5, resumed  # from an S3 checkpoint, not from step 0
    assert sorted(m.step for m in client.get_metric_history(result.run_id, "train/loss")) == list(range(5, 21, 5))

    run = client.get_run(result.run_id)
    assert run.info.artifact_uri.startswith(f"s3://{BUCKET}/mlflow/")
    logged = f"{run.info.artifact_uri.removeprefix(f's3://{BUCKET}/')}/adapter/adapter_model.safetensors"
    stored = s3.get_object(Bucket=BUCKET, Key=f"{run_key}/checkpoint_0000020/adapter/adapter_model.safetensors")["Body"].read()
    assert s3.get_object(Bucket=BUCKET, Key=logged)["Body"].read() == stored  # the final adapter, in MLflow's S3 store

    assert_no_credentials(json.dumps([run.data.params, run.data.tags]), "MLflow params or tags")
    config_dir = Path(download_artifacts(run_id=result.run_id, artifact_path="config", dst_path=str(tmp_path / "config"),
                                         tracking_uri=uri))
    assert sorted(p.name for p in config_dir.iterdir()) == ["data_report.json", "deepspeed.json", "resolved_config.yaml"]
    for path in config_dir.iterdir():
        assert_no_credentials(path.read_text(), f"the config artifact {path.name}")
    job = s3.get_object(Bucket=BUCKET, Key=f"{run_key}/{JOB_CONFIG_FILE}")["Body"].read().decode()
    record = json.loads(job)
    assert (record["status"], record["run_id"], record["checkpoint"]) == ("finished", result.run_id, "checkpoint_0000020")
    assert record["config"]["run.storage_path"] == f"s3://{BUCKET}/runs"
    assert_no_credentials(job, JOB_CONFIG_FILE)
    assert f"{run_key}/{LOCK_FILE}" not in keys  # released

    # The relaunch checks read the run folder in the bucket: the finished run is not trained again,
    # and a truncated model state in its newest checkpoint gives way to the one before.
    with pytest.raises(RunFinished, match=f"its adapter is {final}/adapter"):
        prepare_run_folder(cfg, storage_path(cfg), restart=False)
    state_key = f"{run_key}/checkpoint_0000020/deepspeed/state/mp_rank_00_model_states.pt"
    state = s3.get_object(Bucket=BUCKET, Key=state_key)["Body"].read()
    s3.put_object(Bucket=BUCKET, Key=state_key, Body=state[: len(state) // 2])
    folder = RunFolder.of(cfg, storage_path(cfg))
    assert choose_checkpoint(folder, stage=cfg.deepspeed.stage, world_size=cfg.world_size()) == "checkpoint_0000015"
    assert latest_checkpoint(s3, run_key) == "checkpoint_0000015"  # Ray Train's snapshot in the bucket, rewritten


def test_credentials_in_the_storage_uri_are_never_shown_or_stored(s3_endpoint, tmp_path, monkeypatch):
    """pyarrow also takes credentials and the endpoint in the URI itself
    (``s3://KEY:SECRET@bucket/path?endpoint_override=host:port&scheme=http``)."""
    from zerolab.run import trainer_storage
    from zerolab.tracking import mask_params

    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_PROFILE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    s3_client(s3_endpoint).create_bucket(Bucket="creds")
    host = s3_endpoint.removeprefix("http://")
    storage = f"s3://{ACCESS_KEY}:{URI_SECRET}@creds/runs?endpoint_override={host}&scheme=http"
    cfg = load_config(None, tiny_overrides(tmp_path, **{"run.storage_path": storage, "run.name": "uri-creds"}))

    folder = RunFolder.of(cfg, storage)
    assert folder.uri == "s3://creds/runs/uri-creds"
    with folder.locked():  # written through the URI's own keys and endpoint
        assert prepare_run_folder(cfg, storage, restart=False).record is None  # a new run
        folder.write_record(RunRecord(config=mask_params(cfg.flat()), status="finished", step=cfg.train.max_steps,
                                         checkpoint=f"checkpoint_{cfg.train.max_steps:07d}"))
    assert folder.read_record().config["run.storage_path"] == "s3://***@creds/runs?endpoint_override=" + f"{host}&scheme=http"

    changed = load_config(None, [*tiny_overrides(tmp_path, **{"run.storage_path": storage, "run.name": "uri-creds"}), "adapter.r=16"])
    for relaunch, error in ((cfg, RunFinished), (changed, CheckpointError)):
        with pytest.raises(error) as refused:
            prepare_run_folder(relaunch, storage, restart=False)
        assert "s3://creds/runs/uri-creds" in str(refused.value)  # the message names the folder, without the keys
        assert_no_credentials(str(refused.value), f"the relaunch error {error.__name__}")

    path, filesystem = trainer_storage(cfg)  # what Ray Train records and shows as the storage path
    assert path == "creds/runs" and filesystem is not None
    assert filesystem.get_file_info(f"{path}/uri-creds/{JOB_CONFIG_FILE}").size > 0


def test_a_missing_bucket_is_named_before_anything_starts(s3_endpoint, s3_env):
    """``run.storage_path`` in a bucket that does not exist: exit 2's message names the setting, the
    bucket and the fix, without the keys, and leaves nothing behind."""
    from zerolab.checkpoints import StorageUnavailable, check_storage

    host = s3_endpoint.removeprefix("http://")
    with pytest.raises(StorageUnavailable) as refused:
        check_storage(f"s3://{ACCESS_KEY}:{URI_SECRET}@nobucket/runs?endpoint_override={host}&scheme=http")
    message = str(refused.value)
    assert message.startswith("run.storage_path: cannot write run folders to s3://***@nobucket/runs")
    assert "create the bucket, or fix its name in run.storage_path" in message
    assert_no_credentials(message, "the storage error")
    s3_client(s3_endpoint).create_bucket(Bucket="somebucket")
    check_storage(f"s3://somebucket/runs?endpoint_override={host}&scheme=http")
    left = [obj["Key"] for obj in s3_client(s3_endpoint).list_objects_v2(Bucket="somebucket").get("Contents", [])]
    assert left == ["runs/"]  # the folder, without the write check's file


def test_refused_credentials_are_named_before_anything_starts(s3_endpoint, s3_env, tmp_path, monkeypatch):
    """A bucket that exists, keys it refuses (unknown, a wrong secret, or a user without a grant):
    the job ends with exit 2 before Ray starts, one paragraph that names the setting, the bucket,
    what was found and the variables that fix it, without a key, and leaves nothing behind. The
    keys of a user it grants pass, so the server checked them (moto's IAM enforcement, turned on
    through its API, ``INITIAL_NO_AUTH_ACTION_COUNT``, and off again for the module's other tests)."""
    import boto3
    import requests

    from zerolab.cli import USER_ERROR, run_job
    from zerolab.run import run_sft

    s3_client(s3_endpoint).create_bucket(Bucket="guarded")
    iam = boto3.client("iam", endpoint_url=s3_endpoint, aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
                       region_name="us-east-1")
    iam.create_user(UserName="no-grant")
    key = iam.create_access_key(UserName="no-grant")["AccessKey"]
    iam.create_user(UserName="writer")
    iam.put_user_policy(UserName="writer", PolicyName="runs", PolicyDocument=json.dumps({
        "Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
    writer = iam.create_access_key(UserName="writer")["AccessKey"]
    requests.post(f"{s3_endpoint}/moto-api/reset-auth", data=b"0", timeout=10).raise_for_status()  # auth enforced from here
    try:
        cfg = load_config(None, tiny_overrides(tmp_path, **{"run.storage_path": "s3://guarded/runs", "run.name": "refused"}))
        for case, key_id, secret in (("unknown key", ACCESS_KEY, SECRET_KEY), ("wrong secret", key["AccessKeyId"], SECRET_KEY),
                                     ("no grant", key["AccessKeyId"], key["SecretAccessKey"])):
            monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
            monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
            code, message = run_job(lambda: run_sft(cfg))
            assert code == USER_ERROR, (case, code, message)
            assert message.startswith("\nerror: run.storage_path: the store refused access to bucket 'guarded' with the "
                                      "credentials of this process (s3://guarded/runs: "), (case, message)
            assert "they came from AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" in message, (case, message)
            assert "export AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" in message and "AWS_PROFILE" in message, (case, message)
            assert "\n" not in message.strip() and "Traceback" not in message, (case, message)
            assert not any(s in message for s in (key_id, secret, key["SecretAccessKey"])), f"a credential in the {case} message"
        from zerolab.checkpoints import check_storage

        monkeypatch.setenv("AWS_ACCESS_KEY_ID", writer["AccessKeyId"])
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", writer["SecretAccessKey"])
        check_storage("s3://guarded/runs")  # a user the bucket grants passes the same check
    finally:
        requests.post(f"{s3_endpoint}/moto-api/reset-auth", data=b"inf", timeout=10).raise_for_status()
    assert [o["Key"] for o in s3_client(s3_endpoint).list_objects_v2(Bucket="guarded").get("Contents", [])] == ["runs/"]
    assert not (tmp_path / "mlflow.db").exists()  # found before the store was opened
