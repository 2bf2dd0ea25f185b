"""The first step's kernels compiled ahead in a process of their own (``zerolab.kernels_ahead``): the
process really starts, imports, builds the job's model at one layer with the job's code and runs its
first micro-batch; on CPU, where no Triton kernel exists, that checks the protocol and the build, and
the GPU benchmark the cache it fills."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
import torch

from conftest import rows_of, save_random_qwen2, tiny_overrides
from zerolab import kernels_ahead
from zerolab.batches import MicroBatches
from zerolab.config import ModelSpec, load_config
from zerolab.models import load_model


@pytest.fixture
def compiler(tmp_path):
    """A compiling process for a packed tiny-model job (what :func:`kernels_ahead.start` starts where
    it is wanted: on a GPU host), ended after the test."""
    cfg = load_config(None, tiny_overrides(tmp_path, **{"data.packing": "true", "train.micro_batch_size": 2}))
    kernels_ahead._compiler = kernels_ahead._Compiler(cfg)
    yield kernels_ahead._compiler
    kernels_ahead.stop()


def _batches() -> MicroBatches:
    return MicroBatches(rows_of([30, 50, 70, 20, 40]), micro_batch_size=2, max_seq_length=128, packing=True, pad_id=0, seed=0)


def _until(compiler, stage: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while compiler.stage != stage and time.monotonic() < deadline:
        time.sleep(0.1)
    assert compiler.stage == stage, (compiler.stage, compiler.reason())


def test_a_fed_process_runs_the_first_micro_batch_and_the_worker_waits_for_it(compiler, caplog):
    _until(compiler, "imported")
    compiler.budget = 1 << 34
    kernels_ahead.feed(_batches(), total_steps=10)
    with caplog.at_level(logging.INFO, logger="zerolab.kernels_ahead"):
        kernels_ahead.wait()
    assert "compiled ahead in a process of their own" in caplog.text, caplog.text
    assert compiler.proc.returncode is not None and not compiler.folder.exists()  # ended (killed once done)
    assert kernels_ahead._compiler is None


def test_a_process_with_no_gpu_memory_beside_the_job_builds_nothing(compiler, caplog):
    _until(compiler, "imported")
    compiler.budget = 0  # what allow() gives where the estimate leaves no room, or where there is none
    kernels_ahead.feed(_batches(), total_steps=10)
    with caplog.at_level(logging.INFO, logger="zerolab.kernels_ahead"):
        kernels_ahead.wait()
    assert "were not compiled ahead (no GPU memory beside the job by its estimate)" in caplog.text, caplog.text


def test_a_process_still_importing_at_the_first_step_is_stopped_at_once(compiler, caplog):
    compiler.budget = 1 << 34
    kernels_ahead.feed(_batches(), total_steps=10)
    began = time.perf_counter()
    with caplog.at_level(logging.INFO, logger="zerolab.kernels_ahead"):
        kernels_ahead.wait()
    assert time.perf_counter() - began < 5
    assert "was still importing; the first step compiles them" in caplog.text, caplog.text
    assert compiler.proc.returncode is not None and not compiler.folder.exists()


def test_a_model_cut_to_one_layer_keeps_the_widths_and_reads_no_weights(tmp_path):
    folder = Path(save_random_qwen2(tmp_path / "m", dict(hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                                                          num_attention_heads=4, num_key_value_heads=2)))
    for weights in folder.glob("*.safetensors"):
        weights.unlink()
    model = load_model(ModelSpec(name_or_path=str(folder)), torch.bfloat16, torch.device("cpu"), layers=1)
    assert len(model.model.layers) == 1 and model.config.num_hidden_layers == 1
    layer = model.model.layers[0]
    assert layer.mlp.gate_proj.weight.shape == (160, 64) and layer.self_attn.k_proj.weight.shape[0] == 2 * 16
    assert model.lm_head.weight.shape == model.model.embed_tokens.weight.shape and model.dtype == torch.bfloat16
