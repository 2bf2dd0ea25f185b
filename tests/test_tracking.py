"""The MLflow record without training: secrets masking, git commit, metric de-duplication, Model
Registry versions loadable with peft, and the comparison table, against a temp SQLite store and a
real `mlflow server` on loopback."""

from __future__ import annotations

import csv
import subprocess
import sys

import pytest
import torch

from conftest import REPO
from zerolab import compare, tracking


def test_secret_keys_and_urls_are_masked_in_params():
    params = {
        "model.hub_token": "hf_abcdefSECRET",
        "tracking.uri": "https://alice:s3cr3t@mlflow.example.com/",
        "run.storage_path": "s3://bucket/runs?X-Amz-Signature=abc123&region=eu",
        "data.train.tokens": 1234,  # a count, not a credential
        "train.max_grad_norm": 1.0,
        "misc.api_key": "",
    }
    masked = tracking.mask_params(params)
    assert masked["model.hub_token"] == "***"
    assert masked["tracking.uri"] == "https://***@mlflow.example.com/"
    assert "abc123" not in masked["run.storage_path"] and "region=eu" in masked["run.storage_path"]
    assert masked["data.train.tokens"] == 1234 and masked["train.max_grad_norm"] == 1.0
    assert masked["misc.api_key"] == ""  # nothing to hide


def test_job_yaml_keeps_its_text_but_not_its_secrets():
    text = "# run me\nmodel:\n  name_or_path: Qwen/Qwen2.5-7B\n  hf_token: hf_SECRET  # mine\ntracking:\n  uri: http://bob:pw@host:5000\n"
    masked = tracking.mask_yaml(text)
    assert "hf_SECRET" not in masked and "pw@" not in masked
    assert masked.startswith("# run me\nmodel:\n  name_or_path: Qwen/Qwen2.5-7B\n")
    assert "http://***@host:5000" in masked


def test_git_commit_of_a_work_tree(tmp_path):
    assert tracking.git_commit(tmp_path) is None  # not a repository
    run = lambda *a: subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True, text=True).stdout.strip()  # noqa: E731
    run("init", "-q")
    (tmp_path / "f.txt").write_text("a")
    run("add", "f.txt")
    run("-c", "user.email=a@b", "-c", "user.name=a", "commit", "-qm", "x")
    head = run("rev-parse", "HEAD")
    assert tracking.git_commit(tmp_path) == head
    (tmp_path / "f.txt").write_text("b")
    assert tracking.git_commit(tmp_path) == head + "-dirty"


def test_metrics_logger_never_logs_a_step_twice(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_id, resumed = tracking.open_run(uri, "exp", "job")
    assert not resumed
    tracking.MetricsLogger(uri, run_id).log({"train/loss": 2.0}, step=2)
    again, resumed = tracking.open_run(uri, "exp", "job")  # a relaunch finds the same run
    assert (again, resumed) == (run_id, True)
    second = tracking.MetricsLogger(uri, run_id)  # a fresh rank 0 after a restart
    second.log({"train/loss": 1.9}, step=2)
    second.log({"train/loss": 1.5}, step=4)
    history = tracking.mlflow_client(uri).get_metric_history(run_id, "train/loss")
    assert sorted((m.step, m.value) for m in history) == [(2, 2.0), (4, 1.5)]


@pytest.fixture(params=["sqlite", "server"])
def store(request, tmp_path):
    if request.param == "server":
        return request.getfixturevalue("mlflow_server")
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


def test_registered_adapter_loads_with_peft(store, tmp_path, tiny_model_path):
    from mlflow.artifacts import download_artifacts
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_path), LoraConfig(r=4, target_modules=["q_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()  # non-zero, so a wrong adapter would change the logits
    model.save_pretrained(tmp_path / "adapter")
    run_id, _ = tracking.open_run(store, "registry", f"job-{tmp_path.name}")
    tracking.log_artifact(store, run_id, tmp_path / "adapter", "adapter")
    name = f"reg-{tmp_path.name}"
    version = tracking.register_model(store, run_id, "adapter", name, "candidate", 4, tags={"train/loss": "1.23"})
    assert tracking.register_model(store, run_id, "adapter", name, "candidate", 4) == version  # the same adapter: same version
    continued = tracking.register_model(store, run_id, "adapter", name, "candidate", 8)  # trained further: a new one
    assert int(continued) == int(version) + 1
    assert tracking.register_model(store, run_id, "adapter", name, "candidate", 4) == version

    client = tracking.mlflow_client(store)
    mv = client.get_model_version_by_alias(name, "candidate")
    assert str(mv.version) == version and mv.run_id == run_id and mv.tags["train/loss"] == "1.23"
    assert client.get_run(mv.run_id).info.run_name == f"job-{tmp_path.name}"  # the run's record, one hop away
    local = download_artifacts(artifact_uri=mv.source, dst_path=str(tmp_path / "dl"), tracking_uri=store)
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_path), local)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-6)


def _log_run(client, experiment_id, name, params, history, parent=None):
    from mlflow.entities import Metric, Param

    tags = {"mlflow.runName": name, **({"mlflow.parentRunId": parent} if parent else {})}
    run = client.create_run(experiment_id, run_name=name, tags=tags)
    metrics = [Metric(k, v, 0, step) for k, points in history.items() for step, v in points]
    client.log_batch(run.info.run_id, metrics=metrics, params=[Param(k, str(v)) for k, v in params.items()])
    client.set_terminated(run.info.run_id, "FINISHED")
    return run.info.run_id


def test_compare_table_chart_and_sweep_children(store, tmp_path):
    client = tracking.mlflow_client(store)
    exp_id = client.create_experiment(f"cmp-{tmp_path.name}")
    common = {"adapter.method": "lora", "deepspeed.stage": 2, "data.train.fingerprint": "x", "train.lr": 3e-4}
    _log_run(client, exp_id, "lone", {**common, "adapter.r": 8}, {"train/loss": [(2, 3.0), (4, 2.0)]})
    parent = client.create_run(exp_id, run_name="sweep", tags={"zerolab.sweep": "sweep"}).info.run_id
    for r, tps in ((8, [100.0, 200.0, 210.0, 220.0]), (16, [50.0, 100.0, 110.0, 120.0])):
        _log_run(client, exp_id, f"trial-r{r}", {**common, "adapter.r": r, "data.train.fingerprint": f"f{r}"},
                 {"train/loss": [(2, 3.0), (4, 1.0 + r / 100)], "perf/tokens_per_s": list(enumerate(tps)),
                  "mem/host_rss_peak_gib": [(0, 1.0), (1, 1.5 + r / 100), (2, 1.2)], "eval/accuracy": [(4, r / 100)]},
                 parent=parent)

    everything = compare.collect(store, f"cmp-{tmp_path.name}")
    assert [r.name for r in everything] == ["lone", "trial-r8", "trial-r16"]  # the sweep's parent is no row
    rows = compare.collect(store, f"cmp-{tmp_path.name}", parent="sweep")
    assert [r.name for r in rows] == ["trial-r8", "trial-r16"]
    r8 = rows[0]
    assert r8.values["tokens_per_s"] == 210.0  # median after the warm-up window
    assert r8.values["host_rss_gib"] == pytest.approx(1.58)  # the peak, not the last value
    assert r8.values["train_loss"] == pytest.approx(1.08) and r8.values["eval/accuracy"] == pytest.approx(0.08)
    assert r8.loss_curve == [(2, 3.0), (4, pytest.approx(1.08))]

    header, cells = compare.table(rows)
    assert "adapter.r" in header and "data.train.fingerprint" not in header  # choices, not per-run facts
    assert header.index("adapter.method") < header.index("tokens_per_s")
    paths = compare.write(rows, tmp_path / "out")
    with paths["csv"].open() as f:
        table = list(csv.DictReader(f))
    # Runs named by what differs between them (only adapter.r here), the MLflow name beside it.
    assert [t["run"] for t in table] == ["r=8", "r=16"] and [t["mlflow_run"] for t in table] == ["trial-r8", "trial-r16"]
    assert float(table[1]["tokens_per_s"]) == 110.0
    assert paths["md"].read_text().startswith("| run | status |")
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and paths["png"].stat().st_size > 10_000


def test_compare_cli_reports_unknown_experiment(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "jobs" / "compare.py"), "--experiment", "nope",
                           "--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}"], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2
    assert "no MLflow experiment named 'nope'" in proc.stderr and "Traceback" not in proc.stderr


def test_a_run_shorter_than_one_sampling_interval_still_records_its_system_metrics(tmp_path):
    """MLflow's monitor publishes at the end of each interval and drops an unfinished one; the
    samples taken before the end are published when the run ends."""
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run = client.create_run(client.create_experiment("system"))
    with tracking.system_metrics(uri, run.info.run_id, 60.0, "node-a"):
        pass
    metrics = client.get_run(run.info.run_id).data.metrics
    assert "system/node-a/cpu_utilization_percentage" in metrics, sorted(metrics)
