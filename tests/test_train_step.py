"""The worker's training step on a real 2-rank DeepSpeed engine (gloo, CPU): one optimizer step
applies the token mean gradient over every micro-batch of both ranks whatever the ZeRO stage, and
reports that gradient's norm under ZeRO-0; AdamW's first bf16 step is a full step on every stage;
the fused loss reads ZeRO-3's partitioned head; leftovers of interrupted op builds are cleared."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.multiprocessing as mp

from conftest import free_port, rows_of

ACCUM = 2


def micro_batches(rank: int) -> list:
    """This rank's ACCUM micro-batches of 2 rows, collated by zerolab (padded per batch); rows of
    different lengths and prompt lengths, where a mean of per-batch means would be wrong."""
    from zerolab.batches import MicroBatches

    rows = rows_of([6, 7, 9, 14][: 2 * ACCUM], seed=100 + rank)
    return MicroBatches(rows, micro_batch_size=2, max_seq_length=64, packing=False, pad_id=0, seed=0).sequential()


def reference_gradient() -> tuple[dict[str, torch.Tensor], float]:
    """Plain PyTorch: sum of token losses over all four micro-batches / all their targets."""
    from zerolab.config import ModelSpec
    from zerolab.models import load_model

    torch.manual_seed(0)
    model = load_model(ModelSpec(), torch.float32)
    batches = micro_batches(0) + micro_batches(1)
    n = float(sum(b.num_targets for b in batches))
    for b in batches:
        model(**b.inputs, num_items_in_batch=torch.tensor(n)).loss.backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    return grads, torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()])).item()


def worker(rank: int, stage: int, mode: str, port: int, results: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                      DS_ACCELERATOR="cpu")
    import deepspeed

    from zerolab.config import load_config
    from zerolab.models import load_model
    from zerolab.train import initialize_engine, optimizer_step

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": ACCUM, "gradient_clipping": 0.0,
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True}
    if mode == "sgd":  # fp32, SGD with lr 1 and no momentum: the update is exactly the applied gradient
        cfg = load_config(None, [])
        model = load_model(cfg.model, torch.float32)
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), config=config)
    else:  # bf16 as on GPUs, zerolab's AdamW at a constant learning rate
        cfg = load_config(None, ["adapter.method=full", "train.lr=1e-2", "train.warmup_ratio=0", "train.lr_scheduler=constant"])
        model = load_model(cfg.model, torch.bfloat16)
        engine = initialize_engine(model, cfg, {**config, "bf16": {"enabled": True}}, total_steps=10)
    before = {k: p.detach().float().clone() for k, p in engine.module.named_parameters()}
    _, norm = optimizer_step(engine, micro_batches(rank), torch.device("cpu"), want_grad_norm=True)
    if rank == 0:
        results["applied"] = {k: before[k] - p.detach().float() for k, p in engine.module.named_parameters()}
        results["norm"] = None if norm is None else float(norm)


def run_step(stage: int, mode: str) -> tuple[dict[str, torch.Tensor], float | None]:
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(worker, args=(stage, mode, free_port(), results), nprocs=2)
        return results["applied"], results["norm"]


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 2])
def test_accumulated_step_applies_the_token_mean_gradient(stage):
    expected, expected_norm = reference_gradient()
    applied, norm = run_step(stage, "sgd")
    for key, grad in expected.items():
        torch.testing.assert_close(applied[key], grad, rtol=1e-4, atol=1e-6, msg=key)
    if stage == 0:
        assert norm == pytest.approx(expected_norm, rel=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 2])
def test_first_adamw_step_in_bf16_moves_each_weight_by_the_learning_rate(stage):
    """AdamW's first step is m/sqrt(v) = g/|g| per weight (bias-corrected): every weight with a
    gradient moves by the learning rate, on every stage (ZeRO-0 wraps the optimizer in bf16)."""
    applied, _ = run_step(stage, "adamw")
    moved = torch.cat([d.flatten() for d in applied.values()])
    moved = moved[moved != 0]  # embedding rows of tokens absent from the batches get no gradient
    assert moved.abs().mean().item() / 1e-2 == pytest.approx(1.0, abs=0.05)


def fused_loss_worker(rank: int, port: int, results: dict) -> None:
    """ZeRO-3 partitions the head's weight, and the fused loss (Liger's, here a plain-torch stand-in
    of the same function) reads it outside the head's forward: DeepSpeed must gather it there, and
    the loss must be the model's own."""
    import sys
    import types

    import torch.nn.functional as F

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                      DS_ACCELERATOR="cpu")
    import deepspeed

    from zerolab import kernels
    from zerolab.config import ModelSpec
    from zerolab.models import load_model

    def fused(hidden, weight, target, ignore_index=-100, reduction="mean"):
        return F.cross_entropy((hidden @ weight.t()).float(), target, ignore_index=ignore_index, reduction=reduction)

    functional = types.ModuleType("liger_kernel.transformers.functional")
    functional.liger_fused_linear_cross_entropy = fused
    sys.modules["liger_kernel.transformers.functional"] = functional
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = load_model(ModelSpec(), torch.float32)
    model.config.use_cache = False
    # An untied head, as in 7B models (a tied one is gathered for the embedding's own forward).
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    model.config.tie_word_embeddings = False
    model.requires_grad_(False)
    model.model.layers[0].mlp.down_proj.weight.requires_grad_(True)
    # Nothing persistent and nothing kept for reuse: every weight is released after its module runs.
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0}
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": zero, "zero_allow_untested_optimizer": True}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD([model.model.layers[0].mlp.down_proj.weight], lr=0.0),
                                      config=config)
    engine.train()  # the fused loss is for training
    batch = micro_batches(rank)[0]
    # The fused loss first: once the head's own forward has run, ZeRO-3 prefetches it by its trace.
    engine.module.forward = types.MethodType(kernels._fused_loss_forward, engine.module)
    got = engine(**batch.inputs)
    engine.backward(got.loss)
    head_shape = tuple(engine.module.lm_head.weight.shape)
    del engine.module.forward
    expected = engine(**batch.inputs).loss.item()
    results[rank] = (got.loss.item(), expected, head_shape)


@pytest.mark.slow
def test_fused_loss_reads_the_zero3_partitioned_head():
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(fused_loss_worker, args=(free_port(), results), nprocs=2)
        results = dict(results)
    for got, expected, head_shape in results.values():
        assert got == pytest.approx(expected, rel=1e-5)
        assert 0 in head_shape  # partitioned again after the loss


def test_stale_build_locks_are_removed_and_live_ones_kept(tmp_path, monkeypatch):
    from zerolab.train import STALE_BUILD_LOCK_S, clear_stale_build_locks

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    stale, live = tmp_path / "cpu_adam" / "lock", tmp_path / "py311_cpu" / "deepspeed_shm_comm" / "lock"
    for lock in (stale, live):
        lock.parent.mkdir(parents=True)
        lock.touch()
    old = time.time() - STALE_BUILD_LOCK_S - 60
    os.utime(stale, (old, old))
    assert clear_stale_build_locks() == [stale]
    assert not stale.exists() and live.exists()
