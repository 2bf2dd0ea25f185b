"""The whole MLflow record of a real 2-worker job against a real `mlflow server` on loopback:
params, tags, metrics, system metrics from the workers' node, artifacts with secrets masked, the
registered adapter, the comparison job, and the web UI driven in headless Chromium."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from conftest import REPO, ensure_ray, tiny_overrides
from zerolab.config import load_config
from zerolab.run import run_sft

pytestmark = pytest.mark.ray

PASSWORD = "hunter2-not-for-logs"


@pytest.fixture(scope="module")
def recorded(_ray_session, mlflow_server, tmp_path_factory, tiny_model_path):
    """One finished job whose tracking URI carries credentials and whose job YAML has them too."""
    ensure_ray()
    tmp = tmp_path_factory.mktemp("record")
    uri = mlflow_server.replace("http://", f"http://zerolab:{PASSWORD}@")
    job = tmp / "job.yaml"
    job.write_text(f"# a job as a user writes it\ntracking:\n  uri: {uri}\n  experiment: record\n"
                   "adapter:\n  r: 4\n")
    overrides = [o for o in tiny_overrides(tmp, **{"run.name": "record-job", "tracking.system_metrics_interval_s": 1,
                                                   "tracking.registered_model": "record-adapter"})
                 if not o.startswith(("tracking.uri=", "tracking.experiment="))]
    cfg = load_config(str(job), overrides)
    result = run_sft(cfg, config_file=job)
    return cfg, result, mlflow_server


def test_params_tags_metrics_and_masked_secrets(recorded):
    from mlflow import MlflowClient

    cfg, result, server = recorded
    client = MlflowClient(server)
    run = client.get_run(result.run_id)
    params, tags, metrics = run.data.params, run.data.tags, run.data.metrics
    assert run.info.status == "FINISHED" and run.info.run_name == "record-job"
    for key in cfg.flat():  # the whole resolved config, flattened
        if key != "tracking.uri":
            assert key in params, key
    assert params["tracking.uri"] == server.replace("http://", "http://***@")
    assert params["adapter.r"] == "4" and params["derived.world_size"] == "2" and params["derived.global_batch_size"] == "16"
    assert int(params["derived.trainable_params"]) > 0 and int(params["derived.total_params"]) > int(params["derived.trainable_params"])
    assert params["data.train.bad_reasons"] == "none" and len(params["data.train.fingerprint"]) == 16
    assert params["versions.deepspeed"] == "0.19.8" and params["versions.ray"] == "2.60.0"
    assert params["derived.git_commit"] != ""
    assert {tags["task"], tags["method"], tags["stage"]} == {"math_sum", "lora", "2"}
    for key in ("train/loss", "train/lr", "train/grad_norm", "perf/tokens_per_s", "perf/step_s", "mem/host_rss_peak_gib", "eval/loss"):
        assert key in metrics, key
    # The memory estimate next to the measured peak, and how far off it was.
    assert metrics["mem/pred_host_rss_peak_gib"] > 0 and "mem/pred_error_host_rss_peak_gib_pct" in metrics
    assert params["memory.estimate"].startswith("ZeRO-2")
    steps = sorted(m.step for m in client.get_metric_history(result.run_id, "train/loss"))
    assert steps == [2, 4, 6, 8, 10]

    config_dir = Path(client.download_artifacts(result.run_id, "config"))
    job_text = (config_dir / "job.yaml").read_text()
    assert job_text.startswith("# a job as a user writes it\n") and "***@127.0.0.1" in job_text
    assert yaml.safe_load((config_dir / "resolved_config.yaml").read_text())["adapter"]["r"] == 4
    assert (config_dir / "deepspeed.json").is_file() and (config_dir / "data_report.json").is_file()
    everything = "\n".join(p.read_text() for p in config_dir.iterdir()) + "\n".join(params.values())
    assert PASSWORD not in everything


def test_system_metrics_come_from_the_worker_node(recorded):
    import ray
    from mlflow import MlflowClient

    _, result, server = recorded
    metrics = MlflowClient(server).get_run(result.run_id).data.metrics
    system = {k: v for k, v in metrics.items() if k.startswith("system/")}
    node = ray.get_runtime_context().get_node_id()[:8]  # one node here: the workers' node is this one
    cpu = [k for k in system if k.endswith("/cpu_utilization_percentage")]
    assert cpu and all(f"-{node}/" in k for k in cpu), sorted(system)
    assert any(k.endswith("/system_memory_usage_megabytes") and v > 100 for k, v in system.items())


def test_registered_version_is_the_trained_adapter(recorded, tmp_path):
    from mlflow import MlflowClient
    from mlflow.artifacts import download_artifacts
    from safetensors.torch import load_file

    cfg, result, server = recorded
    mv = MlflowClient(server).get_model_version_by_alias("record-adapter", "candidate")
    assert mv.run_id == result.run_id and float(mv.tags["train/loss"]) == pytest.approx(result.metrics["train/loss"], rel=1e-4)
    local = Path(download_artifacts(artifact_uri=mv.source, dst_path=str(tmp_path), tracking_uri=server))
    registered = load_file(local / "adapter_model.safetensors")
    trained = load_file(Path(result.adapter_path) / "adapter_model.safetensors")
    assert registered.keys() == trained.keys() and all(torch.equal(registered[k], trained[k]) for k in trained)


def test_compare_job_on_the_experiment(recorded, tmp_path):
    _, result, server = recorded
    proc = subprocess.run([sys.executable, str(REPO / "jobs" / "compare.py"), "--experiment", "record", "--tracking-uri", server,
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "record-job" in proc.stdout and "tokens_per_s" in proc.stdout
    assert {p.name for p in tmp_path.iterdir()} >= {"runs.csv", "runs.md", "runs.png"}


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


@pytest.mark.skipif(_chromium() is None, reason="needs Chromium (apt-get install chromium; .ci/run installs it)")
def test_mlflow_ui_shows_the_run_and_its_metric_chart(recorded, tmp_path):
    from mlflow import MlflowClient
    from playwright.sync_api import sync_playwright

    _, result, server = recorded
    experiment_id = MlflowClient(server).get_run(result.run_id).info.experiment_id
    shots = Path(os.environ.get("ZEROLAB_UI_SCREENSHOTS", tmp_path))
    shots.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=_chromium(), args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync"])
        page = browser.new_page(viewport={"width": 1600, "height": 1000})
        runs = f"{server}/#/experiments/{experiment_id}/runs?workflowType=machine_learning"
        page.goto(runs, wait_until="domcontentloaded")
        page.get_by_text("record-job").first.wait_for(timeout=60_000)
        page.screenshot(path=str(shots / "mlflow_experiment.png"))
        page.goto(f"{runs}&compareRunsMode=CHART", wait_until="domcontentloaded")
        page.get_by_placeholder("Search metric charts").fill("train/loss")
        page.get_by_text("record-job (train/loss)").first.wait_for(timeout=60_000)  # the chart's legend
        page.locator("canvas, svg.main-svg, .js-plotly-plot").first.wait_for(timeout=60_000)  # a drawn chart
        page.wait_for_timeout(2000)  # let the chart finish drawing before the screenshot
        page.screenshot(path=str(shots / "mlflow_run_metrics.png"))
        browser.close()
    for name in ("mlflow_experiment.png", "mlflow_run_metrics.png"):
        assert (shots / name).stat().st_size > 20_000, name
