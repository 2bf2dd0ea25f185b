"""The training loop that runs on every Ray Train worker (or in the job's own process).

``train_loop_per_worker(config)`` reads top to bottom: the driver's plan (``config["plan"]``, a
:class:`~zerolab.worker_plan.WorkerPlan`), seed, data shard, tokenizer, model and adapter,
``deepspeed.initialize`` (:mod:`zerolab.engine`), resume from a checkpoint if there is one
(:mod:`zerolab.snapshot`), then the optimizer-step loop, whose cadences (:mod:`zerolab.cadence`)
decide when a metric window is logged, the run stops, evaluates, checkpoints and reports. Where it
runs (:mod:`zerolab.placement`) decides where the data shard comes from, where checkpoints go and
how the process group forms.

The loss of a step is the mean over every target token of the step, across gradient-accumulation
micro-batches and ranks (not a mean of per-batch means, which over-weights short samples): each
micro-batch's summed loss is divided by the step's global target-token count times ``1/dp``
(``dp``: the data-parallel ranks, the workers over ``scaling.sequence_parallel_size``), and
DeepSpeed's gradient sum over all ranks divided by ``dp`` completes the mean. With sequence
parallelism (:mod:`zerolab.sequence_parallel`) the ranks of a group read the same micro-batches
and each trains on its slice of every sequence.
"""

from __future__ import annotations

import contextlib
import functools
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from zerolab import adapters, long_rows, perf, snapshot
from zerolab.batches import Batch, MicroBatches
from zerolab.cadence import STOPPED_AT_DEADLINE, Cadence, MetricWindow
from zerolab.config import SFTConfig
from zerolab.ds_runtime import clear_stale_build_locks
from zerolab.engine import Zero3Loading, build_model, initialize_engine
from zerolab.models import load_tokenizer
from zerolab.placement import InDriver, Place, RayWorker
from zerolab.sequence_parallel import UlyssesAttention
from zerolab.tracking import MetricsLogger, log_params, system_metrics
from zerolab.worker_log import log_rank0, setup_worker_logging
from zerolab.worker_plan import TrackingTarget, WorkerPlan


def train_loop_per_worker(config: dict) -> None:
    """Ray Train's training function, on every worker: ``config["plan"]`` is the driver's
    :class:`WorkerPlan`."""
    started = time.perf_counter()
    plan: WorkerPlan = config["plan"]
    place: Place = plan.in_driver or RayWorker()
    backend = "nccl" if plan.sft.scaling.use_gpu else "gloo"
    zero3, ulysses = Zero3Loading(), UlyssesAttention()
    try:
        with place.process_group(backend):
            _train(plan, place, zero3, ulysses, started)
    finally:
        ulysses.close()
        zero3.close()


@dataclass(frozen=True)
class _Setup:
    """What the set-up made, for the loop."""

    plan: WorkerPlan
    place: Place
    ctx: Any
    """Ray Train's training context (or :class:`~zerolab.placement.OneRank`)."""
    rank: int
    world: int
    ulysses: UlyssesAttention
    """The sequence-parallel attention: each micro-batch's slice for this rank."""
    device: torch.device
    tokenizer: Any
    engine: Any
    total_steps: int
    trainable: int
    total: int
    """Parameter counts: trainable, and all of the model's."""
    flops_per_token: float
    peak_flops: float
    """The world's, 0 where the device's is unknown."""


def _train(plan: WorkerPlan, place: Place, zero3: Zero3Loading, ulysses: UlyssesAttention, started: float) -> None:
    import ray

    cfg, ds_config = plan.sft, plan.deepspeed
    # A Ray worker (a group's, a Tune trial's actor) logs through its own handler; the job's process has one.
    setup_worker_logging(own_handler=ray.is_initialized() and ray.get_runtime_context().worker.mode == ray.WORKER_MODE)
    ctx = place.context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    snapshot.seed_everything(cfg.train.seed + rank)
    device = place.device(cfg.scaling.use_gpu)
    if isinstance(place, InDriver):  # this process may have trained before (a reused Tune actor)
        perf.reset_memory_peaks(device)
    clear_stale_build_locks()

    # Recorded from before the model loads, so that its weights are in the history too.
    with perf.allocator_history(cfg.train.memory_snapshot_dir, rank, device):
        batches = MicroBatches(
            place.rows("train"),
            micro_batch_size=cfg.train.micro_batch_size,
            max_seq_length=cfg.data.max_seq_length,
            packing=cfg.data.packing,
            pad_id=0,  # set once the tokenizer is loaded
            seed=cfg.train.seed,
            width_multiple=cfg.scaling.sequence_parallel_size,
        )
        total_steps = _total_steps(cfg, batches.batches_per_epoch(), device)
        data_ready = time.perf_counter()

        tokenizer = load_tokenizer(cfg.model)
        batches.pad_id = tokenizer.pad_token_id
        model = build_model(cfg, ds_config, total_steps, zero3=zero3, ulysses=ulysses, device=device)
        model_ready = time.perf_counter()
        trainable, total = adapters.parameter_counts(model)
        log_rank0("model %s: %s trainable of %s parameters (%.3f%%), method %s, ZeRO-%d%s, world %d%s",
                  cfg.model.name_or_path, f"{trainable:,}", f"{total:,}", 100 * trainable / total, cfg.adapter.method,
                  cfg.deepspeed.stage, _offload_label(cfg), world,
                  f" (sequence parallel {ulysses.sp} × data parallel {world // ulysses.sp})" if ulysses.sp > 1 else "")

        engine = initialize_engine(model, cfg, ds_config, total_steps, mpu=ulysses.mpu)
        if cfg.adapter.method == "adalora":
            # AdaLoRA reads the gradients after the optimizer step and before they are zeroed.
            engine.optimizer.register_step_post_hook(lambda *_: engine.module.base_model.update_and_allocate(engine.global_steps))

        start_step = snapshot.restore(engine, rank, place.checkpoint(), adapter_only=cfg.adapter.is_peft(), packing=cfg.data.packing)
        now = time.perf_counter()
        log_rank0("worker ready in %.1f s: process group and data shard %.1f s, model %.1f s, DeepSpeed engine%s %.1f s",
                  now - started, data_ready - started, model_ready - data_ready, " and checkpoint" if start_step else "", now - model_ready)
        stream = map(ulysses.shard, batches.iterate(start=start_step * cfg.train.grad_accum_steps))
        setup = _Setup(plan=plan, place=place, ctx=ctx, rank=rank, world=world, ulysses=ulysses, device=device, tokenizer=tokenizer, engine=engine,
                       total_steps=total_steps, trainable=trainable, total=total,
                       flops_per_token=perf.train_flops_per_token(total, trainable, cfg.adapter.method == "full"),
                       peak_flops=perf.peak_flops(device) * world)
        _loop(setup, stream, start_step)


def _loop(s: _Setup, stream: Iterator[Batch], start_step: int) -> None:
    """The optimizer steps from ``start_step`` to the last, or to a stop (after its checkpoint)."""
    cfg, engine = s.plan.sft, s.engine
    cadence = Cadence(total_steps=s.total_steps, log_every=cfg.train.log_every_n_steps,
                      checkpoint_every=cfg.train.checkpoint_every_n_steps, report_every_log=s.plan.report_every_log,
                      deadline_unix=s.plan.deadline_unix)
    # Each rank's loss is its share of the step's token mean times dp (optimizer_step), so the
    # ranks' losses sum to dp times the mean.
    window = MetricWindow(s.device, s.world // s.ulysses.sp)
    run_start = window.start
    tracker: MetricsLogger | _NoTracker = _NoTracker()
    metrics: dict[str, float] = {}
    eval_rows = functools.cache(lambda: s.place.rows("eval"))  # read at the first checkpoint, off the way to the first step
    first_step = _FirstStepClock(s.device)

    with contextlib.ExitStack() as after_first_step, perf.frozen_heap():
        engine.train()
        for step in range(start_step, s.total_steps):
            micro: list[Batch] = [next(stream) for _ in range(cfg.train.grad_accum_steps)]
            loss, grad_norm = optimizer_step(engine, micro, s.device, want_grad_norm=cadence.logs(step + 1))
            if step == start_step:
                first_step.mark()
                # MLflow's set-up (client, metric history, system-metrics thread) takes seconds; done
                # here it keeps off the way to the first step (the GPU works through the queued step meanwhile).
                tracker = _start_tracking(s, after_first_step, start_step)
            window.add(loss, sum(b.num_tokens for b in micro))

            done, stop = step + 1, 0
            if cadence.logs(done):
                metrics, stop = _log_window(s, window, cadence, grad_norm, tracker, done)
            if cadence.reports_window(done, stop) and metrics:
                s.place.report({"step": done, **metrics})
            if cadence.checkpoints(done, stop):
                final = done == s.total_steps
                report = {"step": done, **metrics, **({"stopped": stop} if stop and not final else {})}
                if final:
                    report["perf/wall_s"] = time.perf_counter() - run_start
                    report["perf/first_step_unix"] = first_step.unix() or 0.0
                _checkpoint(s, report, done, eval_rows(), tracker)
                if stop and not final:
                    log_rank0("stopped %s after step %d; relaunch to resume",
                              "at the wall-time limit" if stop == STOPPED_AT_DEADLINE else "on request", done)
                    return


def _log_window(s: _Setup, window: MetricWindow, cadence: Cadence, grad_norm: torch.Tensor | None,
                tracker: MetricsLogger | _NoTracker, done: int) -> tuple[dict[str, float], int]:
    """End the logging window at step ``done``, all ranks together; returns its metrics and rank 0's stop code."""
    elapsed = window.elapsed()
    stop_code = (cadence.stop_code(now=time.time(), window_s=elapsed, requested=functools.partial(_stop_requested, s.plan.stop_flag))
                 if s.rank == 0 else None)
    means = window.reduce(elapsed, stop_code)
    metrics = {
        "train/loss": means.loss,
        "train/lr": s.engine.lr_scheduler.get_last_lr()[0],
        "perf/tokens_per_s": means.tokens_per_s,
        "perf/step_s": means.step_s,
        **perf.memory_metrics(s.device, s.ctx),
    }
    norm = grad_norm if grad_norm is not None else s.engine.get_global_grad_norm()
    if norm is not None:
        metrics["train/grad_norm"] = float(norm)
    if s.peak_flops:
        metrics["perf/mfu"] = metrics["perf/tokens_per_s"] * s.flops_per_token / s.peak_flops
    eta = (s.total_steps - done) * metrics["perf/step_s"]
    log_rank0("step %d/%d | loss %.4f | lr %.2e | %.0f tok/s | %.2f s/step | eta %s",
              done, s.total_steps, metrics["train/loss"], metrics["train/lr"], metrics["perf/tokens_per_s"],
              metrics["perf/step_s"], _hms(eta))
    tracker.log(metrics, step=done)
    window.restart()
    return metrics, means.stop


def _checkpoint(s: _Setup, report: dict[str, Any], done: int, eval_rows: list[tuple[np.ndarray, np.ndarray]] | None,
                tracker: MetricsLogger | _NoTracker) -> None:
    """Evaluate (where there is an eval split), then save and report the checkpoint of step ``done``."""
    if eval_rows is not None:
        report["eval/loss"] = evaluate_loss(s.engine, s.plan.sft, s.device, eval_rows, s.ulysses)
        log_rank0("step %d eval/loss %.4f", done, report["eval/loss"])
        tracker.log({"eval/loss": report["eval/loss"]}, step=done)
    with snapshot.saved(s.engine, s.plan.sft, s.tokenizer, done) as folder:
        s.place.report(report, folder, f"checkpoint_{done:07d}")


class _NoTracker:
    """Where a rank that logs no metrics logs them (every rank but 0, and all of an untracked run)."""

    def log(self, metrics: dict[str, float], step: int) -> None:
        pass


def _start_tracking(s: _Setup, stack: contextlib.ExitStack, start_step: int) -> MetricsLogger | _NoTracker:
    """This node's system metrics (sampled until ``stack`` closes) and this rank's metric logger."""
    stack.enter_context(_system_metrics(s.plan, s.ctx))
    if s.rank != 0 or s.plan.tracking is None:
        return _NoTracker()
    return _open_tracker(s.plan.tracking, start_step, {"derived.trainable_params": s.trainable, "derived.total_params": s.total,
                                                       "derived.total_steps": s.total_steps,
                                                       "derived.fp8_layers": _fp8_layers(s.engine.module),
                                                       **_long_row_params(s.engine.module)})


def _open_tracker(tracking: TrackingTarget, start_step: int, params: dict[str, Any]) -> MetricsLogger:
    """Rank 0's metric logger for the run, noting where a resumed run picked up (or, for a new
    run, the parameters only the workers know)."""
    tracker = MetricsLogger(tracking.uri, tracking.run_id)
    if start_step > 0:
        tracker.log({"train/resumed_from_step": start_step}, step=start_step)
    else:
        log_params(tracking.uri, tracking.run_id, params)
    return tracker


def _stop_requested(flag: Any) -> bool:
    """The driver's stop flag (``zerolab.stop.StopSignal``): an Event in the job's own process, else an actor."""
    if flag is None:
        return False
    if isinstance(flag, threading.Event):
        return flag.is_set()
    import ray

    return ray.get(flag.get.remote())


def _system_metrics(plan: WorkerPlan, ctx: Any) -> contextlib.AbstractContextManager:
    """MLflow system metrics for this node, sampled by its local rank 0, labelled by host and Ray node."""
    target, interval = plan.tracking, plan.sft.tracking.system_metrics_interval_s
    if target is None or ctx.get_local_rank() != 0 or not interval:
        return contextlib.nullcontext()
    import ray

    node = f"{socket.gethostname()}-{ray.get_runtime_context().get_node_id()[:8]}" if ray.is_initialized() else socket.gethostname()
    return system_metrics(target.uri, target.run_id, interval, node)


def _total_steps(cfg: SFTConfig, batches_per_epoch: int, device: torch.device) -> int:
    """``train.max_steps``, or epochs × the smallest rank's optimizer steps per epoch (packing makes
    shards pack into different numbers of batches)."""
    if cfg.train.max_steps:
        return cfg.train.max_steps
    n = torch.tensor(batches_per_epoch, device=device)
    dist.all_reduce(n, op=dist.ReduceOp.MIN)
    return max(1, cfg.train.num_epochs * (int(n.item()) // cfg.train.grad_accum_steps))


def _long_row_params(model: torch.nn.Module) -> dict[str, int]:
    offloaded, tiled = long_rows.long_row_modules(model)
    return {"derived.offloaded_checkpoint_layers": offloaded, "derived.tiled_mlps": tiled}


def _fp8_layers(model: torch.nn.Module) -> int:
    return sum(getattr(m, "zerolab_fp8", False) for m in model.modules())


def optimizer_step(engine: Any, micro: list[Batch], device: torch.device, want_grad_norm: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One optimizer step over the step's micro-batches; returns the summed loss of the
    micro-batches and, under ZeRO-0 when asked, the global gradient norm (other stages keep
    their own, ``engine.get_global_grad_norm()``).

    Each micro-batch's summed token loss is divided by the step's global target count over the
    data-parallel world size (``num_items_in_batch``), so the gradients accumulate to the token mean
    of the whole step once DeepSpeed sums them over all ranks and divides by the data-parallel ones
    (with sequence parallelism the ranks of a group hold slices of the same rows, and the sum adds
    up the slices' gradients); DeepSpeed must not divide again by the accumulation steps
    (``scale_wrt_gas=False``).
    """
    # A fill on the device: a copy from the host would wait for the GPU to finish the previous step.
    n_targets = torch.full((), float(sum(b.num_targets for b in micro)), device=device)
    dist.all_reduce(n_targets)
    world = dist.get_world_size() // getattr(engine, "sequence_parallel_size", 1)
    scale = _zero3_sequence_parallel_scale(engine)
    total = torch.zeros((), dtype=torch.float64, device=device)
    grad_norm = None
    for b in micro:
        inputs = {k: v.to(device, non_blocking=True) for k, v in b.inputs.items()}
        out = engine(**inputs, num_items_in_batch=n_targets / world)
        # DeepSpeed (0.19) hooks every tensor the model returns to divide its gradient by the
        # accumulation steps unless engine.backward() marked the graph first; the model's own
        # loss tensor is hooked before that mark, so without a copy ZeRO-0's gradients came out
        # divided by grad_accum_steps. Backward from a copy runs the mark first.
        engine.backward(out.loss.clone() * scale, scale_wrt_gas=False)
        if want_grad_norm and engine.zero_optimization_stage() == 0 and engine.is_gradient_accumulation_boundary():
            grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
            grad_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])) if grads else torch.zeros(())
        engine.step()
        total += out.loss.detach().double()
    return total, grad_norm


def _zero3_sequence_parallel_scale(engine: Any) -> int:
    """What the backward pass's loss is multiplied by so that DeepSpeed's reduction divides the
    summed gradients by the data-parallel ranks only. ZeRO-1/2 divide by them (the world over
    ``sequence_parallel_size``); ZeRO-3 (DeepSpeed 0.19) does so only in its all-reduce path
    (``reduce_scatter: false``), while its default reduce-scatter (``reduce_scatter_coalesced``)
    averages over every rank, which under sequence parallelism would leave the gradients divided by
    the group size too (measured: half the gradient norm over two GPUs; the update under Adam and
    clipping nearly the same, under plain SGD half)."""
    sp = getattr(engine, "sequence_parallel_size", 1)
    if sp == 1 or engine.zero_optimization_stage() != 3 or not getattr(engine.optimizer, "reduce_scatter", True):
        return 1
    return sp


def evaluate_loss(engine: Any, cfg: SFTConfig, device: torch.device, rows: list[tuple[np.ndarray, np.ndarray]],
                  ulysses: UlyssesAttention | None = None) -> float:
    """Token-weighted mean loss over this rank's ``rows`` of the eval split, all ranks together
    (with sequence parallelism, each rank's slice of its group's rows). Every rank runs the same
    number of forward passes (ZeRO-3 gathers parameters collectively, sequence-parallel attention
    exchanges slices); a rank with fewer batches repeats one with zero weight."""
    sp = ulysses.sp if ulysses is not None else 1
    evals = MicroBatches(rows, micro_batch_size=cfg.train.micro_batch_size,
                         max_seq_length=cfg.data.max_seq_length, packing=False, pad_id=0, seed=0, width_multiple=sp)
    batches = [ulysses.shard(b) for b in evals.sequential()] if ulysses is not None else evals.sequential()
    n = torch.tensor(len(batches), device=device)
    dist.all_reduce(n, op=dist.ReduceOp.MAX)
    filler = batches[0] if batches else _filler_batch(ulysses)
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    engine.eval()
    with torch.no_grad():
        for i in range(int(n.item())):
            b, weight = (batches[i], 1) if i < len(batches) else (filler, 0)
            inputs = {k: v.to(device) for k, v in b.inputs.items()}
            out = engine(**inputs, num_items_in_batch=max(b.num_targets, 1))
            totals[0] += weight * out.loss.double() * b.num_targets
            totals[1] += weight * b.num_targets
    engine.train()
    dist.all_reduce(totals)
    return (totals[0] / totals[1].clamp(min=1)).item()


def _filler_batch(ulysses: UlyssesAttention | None) -> Batch:
    ids = np.array([0, 0], dtype=np.int64)
    sp = ulysses.sp if ulysses is not None else 1
    batch = MicroBatches([(ids, np.array([-100, 0]))], micro_batch_size=1, max_seq_length=2, packing=False, pad_id=0, seed=0,
                         width_multiple=sp).sequential()[0]
    return ulysses.shard(batch) if ulysses is not None else batch


class _FirstStepClock:
    """The wall-clock time at which the run's first optimizer step finished on the device: the end of
    start-up (``perf/first_step_unix``), what a benchmark's step callback reads after a device sync.

    :meth:`mark` is called as the step has been issued. On a GPU it records a CUDA event, read (with
    one reference event synchronised before the step) when the time is asked for, so the clock
    neither waits for the device nor counts the host's work after the step is queued (MLflow's
    set-up, which overlaps the step there); on the CPU the step is done when it returns."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._unix: float | None = None
        self._end: Any = None
        if self._cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
            self._start.synchronize()  # the device has done all queued work (the model's set-up): now
            self._start_unix = time.time()

    def mark(self) -> None:
        if self._cuda:
            self._end = torch.cuda.Event(enable_timing=True)
            self._end.record()
        else:
            self._unix = time.time()

    def unix(self) -> float | None:
        if self._end is not None and self._unix is None:
            self._end.synchronize()
            self._unix = self._start_unix + self._start.elapsed_time(self._end) / 1000
        return self._unix


def _offload_label(cfg: SFTConfig) -> str:
    parts = [name for name, on in (("optimizer", cfg.deepspeed.offload_optimizer), ("params", cfg.deepspeed.offload_param)) if on]
    return f" + offload {'/'.join(parts)}" if parts else ""


def _hms(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"
