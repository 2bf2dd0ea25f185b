"""The memory preflight in front of every launch, on the prepared data: a job that cannot fit by
the micro-batches its shards will really make is refused before any worker starts, with the
estimate, the worst case by config, the limit and what would fit; a job that fits by its data is
launched although the worst case by config would not fit; --force lets a refused job through."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

from conftest import REPO, tiny_overrides

pytestmark = pytest.mark.ray

HUGE = {"train.micro_batch_size": 96, "data.max_seq_length": 32768, "train.max_steps": 2, "data.num_eval_rows": 0,
        "model.rope_scaling": "yarn", "model.rope_factor": 16}
"""By config, micro-batches of 96 samples of 32k tokens (terabytes of activations; the tiny model's
2,048 positions reach 32k by YaRN); the generated math rows are ~40 tokens, so the job itself is small."""


def sft(tmp_path, *extra: str, **overrides) -> subprocess.CompletedProcess:
    args = [sys.executable, str(REPO / "jobs" / "sft.py"), *extra]
    for item in tiny_overrides(tmp_path, **overrides):
        args += ["--set", item]
    return subprocess.run(args, capture_output=True, text=True, timeout=600)


def long_rows(tmp_path) -> str:
    """16 rows of ~14k tokens each: 8 per worker make a micro-batch of ~110k tokens, far beyond this machine."""
    path = tmp_path / "long.jsonl"
    text = " ".join(str(i) for i in range(3000))
    path.write_text("".join(json.dumps({"instruction": f"{k} {text}", "output": str(k)}) + "\n" for k in range(16)))
    return str(path)


def test_impossible_job_is_refused_with_the_options_that_fit(tmp_path, tiny_model_path):
    proc = sft(tmp_path, **{**HUGE, "train.micro_batch_size": 8, "data.train_path": long_rows(tmp_path)})
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = proc.stderr
    assert "memory preflight: ZeRO-2" in err and "does not fit" in err and "host RAM" in err
    assert "largest micro-batch of the data" in err and "(8 rows, padded to ≤ 13" in err
    assert "worst case by config (micro-batch 8 × 32768 tokens)" in err
    assert "this would: model.gradient_checkpointing=true train.micro_batch_size=" in err  # what would fit
    assert "--force launches anyway" in err and "Traceback" not in err
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())  # nothing launched


@pytest.mark.slow
def test_a_job_that_fits_by_its_data_launches(tmp_path, tiny_model_path):
    proc = sft(tmp_path, **HUGE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "memory preflight" not in proc.stderr
    assert "largest micro-batch of the data" in proc.stderr and "; worst case by config (micro-batch 96 × 32768" in proc.stderr


def test_force_lets_a_refused_job_past_the_preflight(ray_cluster, tmp_path, tiny_model_path, caplog):
    from zerolab.config import load_config
    from zerolab.models import load_model_config
    from zerolab.plan import check_memory, prepare_data

    cfg = load_config(None, tiny_overrides(tmp_path, **{**HUGE, "train.micro_batch_size": 8,
                                                        "data.train_path": long_rows(tmp_path)}))
    datasets = prepare_data(cfg, tiny_model_path)
    with caplog.at_level(logging.WARNING, logger="zerolab"):
        check = check_memory(cfg, load_model_config(cfg.model), force=True, datasets=datasets)
    assert "launching anyway, as asked: memory preflight: ZeRO-2" in caplog.text
    assert check.estimate.data_aware and check.estimate.seq_len < 32768
    assert check.params()["memory.estimate_by_config"].startswith("worst case by config")


def test_a_jobs_plan_resolves_model_data_and_deepspeed_once(ray_cluster, tmp_path, tiny_model_path):
    """The plan holds what the driver resolved; a second plan of the same job reads the tokenized cache."""
    from zerolab import ds_config
    from zerolab.config import load_config
    from zerolab.plan import plan_job

    cfg = load_config(None, tiny_overrides(tmp_path, **{"train.max_steps": 2}))
    first, second = plan_job(cfg), plan_job(cfg)
    assert first.model_path == tiny_model_path and first.model_config.hidden_size > 0
    assert first.deepspeed == ds_config.resolve(cfg, first.model_config)
    assert first.memory.estimate.data_aware and first.memory.params()["memory.estimate"]
    assert all(split.from_cache for split in second.splits.values())
    assert {k: r.fingerprint for k, r in second.reports.items()} == {k: r.fingerprint for k, r in first.reports.items()}


def test_a_plan_resolves_an_auto_length_once(ray_cluster, tmp_path, tiny_model_path):
    """``data.max_seq_length: auto`` is resolved on the driver with the data: the plan's config (the
    workers', the estimate's) holds the length, the run's params the configured value beside it."""
    from zerolab.config import load_config
    from zerolab.plan import plan_job
    from zerolab.run import derived_params

    cfg = load_config(None, tiny_overrides(tmp_path, **{"train.max_steps": 2, "data.max_seq_length": "auto", "data.packing": "true"}))
    plan = plan_job(cfg)
    longest = max(r.max_tokens for r in plan.reports.values())
    assert plan.configured.data.max_seq_length == "auto" and plan.cfg.data.max_seq_length == -(-longest // 64) * 64
    assert plan.memory.estimate.data_aware and plan.memory.estimate.seq_len <= plan.cfg.data.max_seq_length
    assert derived_params(plan)["derived.max_seq_length"] == plan.cfg.data.max_seq_length


def test_where_one_worker_trains_is_resolved_against_the_cluster(ray_cluster):
    """``scaling.launch``: ``auto`` trains one worker in the job's process on the Ray instance the job
    started, and in a worker group when the job has several workers or retries; ``driver`` on a node
    without a GPU for a GPU job is refused with what to do, ``auto`` then takes the worker group."""
    from zerolab.cluster import resolve_launch
    from zerolab.config import load_config
    from zerolab.errors import EnvironmentProblem

    def launch(*overrides: str) -> str:
        return resolve_launch(load_config(None, list(overrides)))

    assert launch("scaling.num_workers=1") == "driver"
    assert launch("scaling.num_workers=2") == "workers"
    assert launch("scaling.num_workers=1", "run.max_failures=1") == "workers"
    assert launch("scaling.num_workers=1", "scaling.launch=workers") == "workers"
    if not ray_cluster.cluster_resources().get("GPU"):
        assert launch("scaling.num_workers=1", "scaling.use_gpu=true") == "workers"
        with pytest.raises(EnvironmentProblem, match="node has no GPU; submit the job with `ray job submit --entrypoint-num-gpus 1`"):
            launch("scaling.num_workers=1", "scaling.use_gpu=true", "scaling.launch=driver")
