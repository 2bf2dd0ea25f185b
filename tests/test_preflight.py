"""The memory preflight in front of every launch: an impossible job is refused before any worker
starts, with the estimate, the limit and what would fit; --force launches it anyway."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO, tiny_overrides

pytestmark = pytest.mark.ray

HUGE = {"train.micro_batch_size": 96, "data.max_seq_length": 32768, "train.max_steps": 2, "data.num_eval_rows": 0}
"""The estimator takes the worst case, micro-batches of 96 samples of 32k tokens (terabytes of
activations); the generated math rows are ~40 tokens, so the job itself is small."""


def sft(tmp_path, *extra: str, **overrides) -> subprocess.CompletedProcess:
    args = [sys.executable, str(REPO / "jobs" / "sft.py"), *extra]
    for item in tiny_overrides(tmp_path, **overrides):
        args += ["--set", item]
    return subprocess.run(args, capture_output=True, text=True, timeout=600)


def test_impossible_job_is_refused_with_the_options_that_fit(tmp_path, tiny_model_path):
    proc = sft(tmp_path, **HUGE)
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = proc.stderr
    assert "memory preflight: ZeRO-2" in err and "does not fit" in err and "host RAM" in err
    assert "--set model.gradient_checkpointing=true train.micro_batch_size=" in err  # what would fit
    assert "--force" in err and "Traceback" not in err
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())  # nothing launched


def test_force_launches_past_the_preflight(tmp_path, tiny_model_path):
    proc = sft(tmp_path, "--force", **HUGE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "launching anyway (--force): memory preflight: ZeRO-2" in proc.stderr
