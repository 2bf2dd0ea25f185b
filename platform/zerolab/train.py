"""The training loop that runs on every Ray Train worker (or in the job's own process).

``train_loop_per_worker(config)`` reads top to bottom: rebuild the config, seed, load the data
shard, tokenizer, model and adapter, ``deepspeed.initialize``, resume from a checkpoint if Ray
Train hands one over, then the optimizer-step loop with metric reports and checkpoints. Where it
runs is a :class:`RayWorker` (a process of Ray Train's worker group) or :class:`InDriver` (the
job's own process, ``scaling.launch=driver``): they differ only in where the data shard comes
from, where checkpoints go and how the process group forms.

The loss of a step is the mean over every target token of the step, across gradient-accumulation
micro-batches and ranks (not a mean of per-batch means, which over-weights short samples): each
micro-batch's summed loss is divided by the step's global target-token count times ``1/world``,
and DeepSpeed's average over ranks completes the mean.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import shutil
import socket
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from zerolab import adapters, kernels, perf
from zerolab.batches import PACKER, Batch, MicroBatches
from zerolab.cadence import STOPPED_AT_DEADLINE, Cadence
from zerolab.checkpoints import RunFolder
from zerolab.cluster import quiet_ray_data_logging
from zerolab.config import SFTConfig
from zerolab.data import PreparedSplit, load_shard, shard_rows
from zerolab.models import decoder_layers, load_model, load_tokenizer

logger = logging.getLogger("zerolab.train")

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def log_rank0(msg: str, *args: Any) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        logger.info(msg, *args)


class RayWorker:
    """A process of Ray Train's worker group: its rank, data shard and checkpoints come through
    Ray Train (which persists each checkpoint to the run folder and hands the newest back on a
    retry or a relaunch); ``fit()`` returns the last report."""

    def context(self) -> Any:
        import ray.train

        return ray.train.get_context()

    def device(self, use_gpu: bool) -> torch.device:
        import ray.train.torch

        return ray.train.torch.get_device() if use_gpu else torch.device("cpu")

    @contextlib.contextmanager
    def process_group(self, backend: str) -> Iterator[None]:
        init_distributed(backend)  # Ray Train set the rendezvous variables
        yield

    def rows(self, split: str) -> list[tuple[np.ndarray, np.ndarray]] | None:
        import ray.train

        try:
            return load_shard(ray.train.get_dataset_shard(split))
        except KeyError:
            return None

    def checkpoint(self) -> Any:
        import ray.train

        return ray.train.get_checkpoint()

    def report(self, metrics: dict[str, Any], folder: Path | None = None, name: str | None = None) -> None:
        import ray.train
        from ray.train import Checkpoint

        checkpoint = Checkpoint.from_directory(str(folder)) if folder is not None else None
        ray.train.report(metrics, checkpoint=checkpoint, checkpoint_dir_name=name)


class OneRank:
    """The training context of a one-process world (what ``ray.train.get_context()`` says of a
    worker group's only rank; Ray Train's own is not available inside a Tune trial)."""

    def get_world_rank(self) -> int:
        return 0

    def get_world_size(self) -> int:
        return 1

    def get_local_rank(self) -> int:
        return 0

    def get_node_rank(self) -> int:
        return 0


@dataclass
class InDriver:
    """The job's own process as its one worker (``scaling.launch=driver``: Ray Train's local mode,
    which starts no worker group, persists no checkpoint and hands none back): the driver's
    prepared splits are the shard, checkpoints are written into the run folder as Ray Train
    writes them (:func:`zerolab.checkpoints.record_checkpoint`), a Tune trial gets each report,
    and the last report is ``last`` (``fit()``'s result holds none)."""

    splits: dict[str, PreparedSplit]
    folder: RunFolder
    resume_from: str | None
    """The run folder's checkpoint to resume (chosen by the driver), if any."""
    keep: int
    in_tune: bool
    last: tuple[dict[str, Any], Any] = ({}, None)
    """The last report's metrics and checkpoint (a ``ray.train.Checkpoint`` in the run folder)."""

    def context(self) -> OneRank:
        return OneRank()

    def device(self, use_gpu: bool) -> torch.device:
        # Ray reserved this process's GPU (a Tune trial, `--entrypoint-num-gpus`) through
        # CUDA_VISIBLE_DEVICES, or the job owns the node's Ray instance.
        return torch.device("cuda", 0) if use_gpu else torch.device("cpu")

    @contextlib.contextmanager
    def process_group(self, backend: str) -> Iterator[None]:
        """A one-rank process group on a free local port (DeepSpeed needs one), the rendezvous
        variables set only while it lives: the process goes on after the run (a Tune trial's
        actor trains the next trial)."""
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            init_distributed(backend, auto_mpi_discovery=False)
            yield
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
            _forget_deepspeed_groups()
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def rows(self, split: str) -> list[tuple[np.ndarray, np.ndarray]] | None:
        prepared = self.splits.get(split)
        if prepared is None:
            return None
        (indices,) = shard_rows(prepared.num_rows, 1, equal=split == "train")
        return prepared.rows(indices)

    def checkpoint(self) -> Any:
        from ray.train import Checkpoint

        return Checkpoint(f"{self.folder.path}/{self.resume_from}", filesystem=self.folder.fs) if self.resume_from else None

    def report(self, metrics: dict[str, Any], folder: Path | None = None, name: str | None = None) -> None:
        from ray.train import Checkpoint

        from zerolab.checkpoints import record_checkpoint

        checkpoint = None
        if folder is not None:
            assert name is not None
            checkpoint = Checkpoint(record_checkpoint(self.folder, folder, name, metrics, self.keep), filesystem=self.folder.fs)
        self.last = (metrics, checkpoint)
        if self.in_tune:
            import ray.tune

            ray.tune.report({**metrics, **({"checkpoint_path": checkpoint.path} if checkpoint else {})})


SHM_COMM_OP = "deepspeed_shm_comm"
"""DeepSpeed's shared-memory all-reduce op for CPU processes: only its inference path
(``inference_all_reduce``) calls it, yet its CPU accelerator compiles it at the first process
group of every machine (about 30 s on two cores). Training never uses it, so it is not built."""


def init_distributed(backend: str, **kwargs: Any) -> None:
    """``deepspeed.init_distributed`` without building :data:`SHM_COMM_OP` (DeepSpeed skips an op
    marked incompatible and falls back to the process group's all-reduce)."""
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__[SHM_COMM_OP] = False
    deepspeed.init_distributed(dist_backend=backend, **kwargs)


def _forget_deepspeed_groups() -> None:
    """Drop the process groups DeepSpeed cached from a destroyed world (it clones the world group
    once per process and keeps it), so the next run in this process builds them afresh."""
    from deepspeed.utils import groups

    for name, value in list(vars(groups).items()):
        if isinstance(value, dist.ProcessGroup) or type(value).__name__ == "DeviceMesh":
            setattr(groups, name, None)
        elif isinstance(value, dict) and any(isinstance(v, dist.ProcessGroup) for v in value.values()):
            value.clear()


def train_loop_per_worker(config: dict) -> None:
    started = time.perf_counter()
    place: RayWorker | InDriver = config.get("in_driver") or RayWorker()
    backend = "nccl" if config["sft"].scaling.use_gpu else "gloo"
    try:
        with place.process_group(backend):
            _train(config, place, started)
    finally:
        _forget_zero3_loading()


def _forget_zero3_loading() -> None:
    """Drop the ZeRO-3 loading state ``_build_model`` set: a process that trains again (the job's
    own, a reused Tune actor) would otherwise load its next model partitioned, whatever its stage."""
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    _build_model.hf_ds_config = None  # type: ignore[attr-defined]
    unset_hf_deepspeed_config()


def _train(config: dict, place: RayWorker | InDriver, started: float) -> None:
    import ray

    cfg: SFTConfig = config["sft"]  # the driver's validated config; its data files need not exist here
    ds_config: dict = config["deepspeed"]
    # A Ray worker (a group's, a Tune trial's actor) logs through its own handler; the job's process has one.
    _setup_worker_logging(own_handler=ray.is_initialized() and ray.get_runtime_context().worker.mode == ray.WORKER_MODE)
    ctx = place.context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    _seed_everything(cfg.train.seed + rank)
    device = place.device(cfg.scaling.use_gpu)
    if isinstance(place, InDriver):  # this process may have trained before (a reused Tune actor)
        perf.reset_memory_peaks(device)
    clear_stale_build_locks()

    batches = MicroBatches(
        place.rows("train"),
        micro_batch_size=cfg.train.micro_batch_size,
        max_seq_length=cfg.data.max_seq_length,
        packing=cfg.data.packing,
        pad_id=0,  # set once the tokenizer is loaded
        seed=cfg.train.seed,
    )
    total_steps = _total_steps(cfg, batches.batches_per_epoch(), device)
    data_ready = time.perf_counter()

    tokenizer = load_tokenizer(cfg.model)
    batches.pad_id = tokenizer.pad_token_id
    model = _build_model(cfg, ds_config, total_steps, device=device)
    model_ready = time.perf_counter()
    trainable, total = adapters.parameter_counts(model)
    log_rank0("model %s: %s trainable of %s parameters (%.3f%%), method %s, ZeRO-%d%s, world %d",
              cfg.model.name_or_path, f"{trainable:,}", f"{total:,}", 100 * trainable / total, cfg.adapter.method,
              cfg.deepspeed.stage, _offload_label(cfg), world)

    engine = initialize_engine(model, cfg, ds_config, total_steps)
    if cfg.adapter.method == "adalora":
        # AdaLoRA reads the gradients after the optimizer step and before they are zeroed.
        engine.optimizer.register_step_post_hook(lambda *_: engine.module.base_model.update_and_allocate(engine.global_steps))

    start_step = _restore(engine, rank, place.checkpoint(), adapter_only=cfg.adapter.is_peft(), packing=cfg.data.packing)
    now = time.perf_counter()
    log_rank0("worker ready in %.1f s: process group and data shard %.1f s, model %.1f s, DeepSpeed engine%s %.1f s",
              now - started, data_ready - started, model_ready - data_ready, " and checkpoint" if start_step else "", now - model_ready)
    stream = _FirstStepClock(batches.iterate(start=start_step * cfg.train.grad_accum_steps), cfg.train.grad_accum_steps, device)
    tracker = None
    flops_per_token = perf.train_flops_per_token(total, trainable, cfg.adapter.method == "full")
    peak_flops = perf.peak_flops(device) * world
    stop_flag = config.get("stop_flag")
    cadence = Cadence(total_steps=total_steps, log_every=cfg.train.log_every_n_steps, checkpoint_every=cfg.train.checkpoint_every_n_steps,
                      report_every_log=bool(config.get("report_every_log")), deadline_unix=config.get("deadline_unix"))
    # Sum of step losses, non-padding tokens, and rank 0's stop code (all-reduced together).
    window = torch.zeros(3, dtype=torch.float64, device=device)
    window_steps, window_start = 0, time.perf_counter()
    run_start = window_start
    metrics: dict[str, float] = {}
    eval_rows: list | None = None  # read at the first checkpoint, off the way to the first step
    eval_read = False

    with contextlib.ExitStack() as after_first_step:
        engine.train()
        for step in range(start_step, total_steps):
            micro: list[Batch] = [next(stream) for _ in range(cfg.train.grad_accum_steps)]
            loss, grad_norm = optimizer_step(engine, micro, device, want_grad_norm=cadence.logs(step + 1))
            if step == start_step:
                # MLflow's set-up (client, metric history, system-metrics thread) takes seconds; done
                # here it keeps off the way to the first step (the GPU works through the queued step meanwhile).
                after_first_step.enter_context(_system_metrics(config, ctx))
                if rank == 0 and config.get("tracking"):
                    tracker = _open_tracker(config["tracking"], start_step,
                                            {"derived.trainable_params": trainable, "derived.total_params": total,
                                             "derived.total_steps": total_steps, "derived.fp8_layers": _fp8_layers(engine.module)})
            window[0] += loss
            window[1] += sum(b.num_tokens for b in micro)
            window_steps += 1

            done = step + 1
            stop = 0
            if cadence.logs(done):
                elapsed = time.perf_counter() - window_start
                if rank == 0:
                    window[2] = cadence.stop_code(now=time.time(), window_s=elapsed,
                                                  requested=lambda: _stop_requested(stop_flag))
                dist.all_reduce(window)
                stop = int(window[2].item())
                metrics = {
                    "train/loss": window[0].item() / (world * window_steps),
                    "train/lr": engine.lr_scheduler.get_last_lr()[0],
                    "perf/tokens_per_s": window[1].item() / elapsed,
                    "perf/step_s": elapsed / window_steps,
                    **perf.memory_metrics(device, ctx),
                }
                norm = grad_norm if grad_norm is not None else engine.get_global_grad_norm()
                if norm is not None:
                    metrics["train/grad_norm"] = float(norm)
                if peak_flops:
                    metrics["perf/mfu"] = metrics["perf/tokens_per_s"] * flops_per_token / peak_flops
                eta = (total_steps - done) * metrics["perf/step_s"]
                log_rank0("step %d/%d | loss %.4f | lr %.2e | %.0f tok/s | %.2f s/step | eta %s",
                          done, total_steps, metrics["train/loss"], metrics["train/lr"], metrics["perf/tokens_per_s"],
                          metrics["perf/step_s"], _hms(eta))
                if tracker is not None:
                    tracker.log(metrics, step=done)
                window.zero_()
                window_steps, window_start = 0, time.perf_counter()

            if cadence.reports_window(done, stop) and metrics:
                place.report({"step": done, **metrics})
            if cadence.checkpoints(done, stop):
                final = done == total_steps
                report = {"step": done, **metrics, **({"stopped": stop} if stop and not final else {})}
                if final:
                    report["perf/wall_s"] = time.perf_counter() - run_start
                    report["perf/first_step_unix"] = stream.first_step_unix or 0.0
                if not eval_read:
                    eval_rows, eval_read = place.rows("eval"), True
                if eval_rows is not None:
                    report["eval/loss"] = evaluate_loss(engine, cfg, device, eval_rows)
                    log_rank0("step %d eval/loss %.4f", done, report["eval/loss"])
                    if tracker is not None:
                        tracker.log({"eval/loss": report["eval/loss"]}, step=done)
                _save_and_report(engine, cfg, tokenizer, done, report, place)
                if stop and not final:
                    log_rank0("stopped %s after step %d; relaunch to resume",
                              "at the wall-time limit" if stop == STOPPED_AT_DEADLINE else "on request", done)
                    return


def _open_tracker(tracking: dict, start_step: int, params: dict[str, Any]) -> Any:
    """Rank 0's metric logger for the run, noting where a resumed run picked up (or, for a new
    run, the parameters only the workers know)."""
    from zerolab.tracking import MetricsLogger, log_params

    tracker = MetricsLogger(tracking["uri"], tracking["run_id"])
    if start_step > 0:
        tracker.log({"train/resumed_from_step": start_step}, step=start_step)
    else:
        log_params(tracking["uri"], tracking["run_id"], params)
    return tracker


def _stop_requested(flag: Any) -> bool:
    """The driver's stop flag (``zerolab.stop.StopSignal``): an Event in the job's own process, else an actor."""
    if flag is None:
        return False
    if isinstance(flag, threading.Event):
        return flag.is_set()
    import ray

    return ray.get(flag.get.remote())


def _system_metrics(config: dict, ctx: Any) -> contextlib.AbstractContextManager:
    """MLflow system metrics for this node, sampled by its local rank 0, labelled by host and Ray node."""
    tracking_info, interval = config.get("tracking"), config["sft"].tracking.system_metrics_interval_s
    if not tracking_info or ctx.get_local_rank() != 0 or not interval:
        return contextlib.nullcontext()
    import ray

    from zerolab.tracking import system_metrics

    node = f"{socket.gethostname()}-{ray.get_runtime_context().get_node_id()[:8]}" if ray.is_initialized() else socket.gethostname()
    return system_metrics(tracking_info["uri"], tracking_info["run_id"], interval, node)


def _total_steps(cfg: SFTConfig, batches_per_epoch: int, device: torch.device) -> int:
    """``train.max_steps``, or epochs × the smallest rank's optimizer steps per epoch (packing makes
    shards pack into different numbers of batches)."""
    if cfg.train.max_steps:
        return cfg.train.max_steps
    n = torch.tensor(batches_per_epoch, device=device)
    dist.all_reduce(n, op=dist.ReduceOp.MIN)
    return max(1, cfg.train.num_epochs * (int(n.item()) // cfg.train.grad_accum_steps))


def _fp8_layers(model: torch.nn.Module) -> int:
    return sum(getattr(m, "zerolab_fp8", False) for m in model.modules())


def _build_model(cfg: SFTConfig, ds_config: dict, total_steps: int, device: torch.device | None = None) -> torch.nn.Module:
    """The model with its adapter. Under ZeRO 0-2 it goes to ``device`` (where
    ``deepspeed.initialize`` would move it) as it loads (``zerolab.models.load_model``), before peft
    wraps it: DoRA's set-up, which reads every wrapped weight to compute its norm, made the whole
    memory-mapped checkpoint resident on the host (7B: 14.4 GiB RSS per worker against LoRA's 6.2)."""
    dtype = DTYPES[cfg.precision()]
    if cfg.deepspeed.stage == 3:
        # Keeps a global reference that makes from_pretrained partition weights as they load
        # (deepspeed.zero.Init), so no rank ever holds the whole model.
        from transformers.integrations import HfDeepSpeedConfig

        _build_model.hf_ds_config = HfDeepSpeedConfig(ds_config)  # type: ignore[attr-defined]
    # On CPU the model is where it loads; ZeRO-3 partitions the weights as they load.
    on_device = device is not None and device.type != "cpu" and cfg.deepspeed.stage < 3
    model = load_model(cfg.model, dtype, device if on_device else None)
    head_trains = not cfg.adapter.is_peft() or "lm_head" in cfg.adapter.target_modules
    fused_loss = kernels.use_fused_loss(cfg.model.kernels, use_gpu=cfg.scaling.use_gpu, head_trains=head_trains)
    if cfg.model.kernels != "none" and cfg.scaling.use_gpu:
        applied = kernels.apply_liger(model, fused_loss=fused_loss, layers=not cfg.model.compile)
        log_rank0("Liger kernels: %s", ", ".join(applied) or ("none (compiled layers)" if kernels.liger_available() else
                                                               "not available (liger_kernel not installed)"))
    # Training needs no KV cache, and with one transformers ignores the per-sample position ids
    # of packed batches: packed samples would attend to each other.
    model.config.use_cache = False
    if cfg.model.gradient_checkpointing and cfg.adapter.is_peft():
        model.enable_input_require_grads()
    model = adapters.apply_adapter(model, cfg.adapter, total_steps)
    if cfg.model.kernels != "none":
        kernels.fuse_lora(model)
    if cfg.model.fp8:
        layers, reason = kernels.use_fp8(model, device, cfg.model.fp8_min_features)
        log_rank0("FP8 base products: %s", f"{layers} frozen linear layers" if layers else f"off, {reason}")
    if cfg.model.compile:
        log_rank0("torch.compile: %d decoder layers (the first steps compile)", kernels.compile_layers(decoder_layers(model)))
    return model


def initialize_engine(model: torch.nn.Module, cfg: SFTConfig, ds_config: dict, total_steps: int) -> Any:
    """``deepspeed.initialize`` with zerolab's optimizer and schedule.

    Under ZeRO-0 in bf16/fp16, DeepSpeed wraps the optimizer in its FP16 optimizer, which runs one
    step with zero gradients when it is built to create the optimizer state. AdamW counts that
    step, so its bias correction was one step off for the whole run (the first update 0.74× that
    of ZeRO 1-3, where no such step runs). The state is dropped here and the first real step
    creates it; a resumed run loads its own.

    Under ZeRO-3 with ``deepspeed.z3_leaf_layers`` the decoder layers become leaf modules first
    (:func:`make_zero3_leaf_layers`).
    """
    import deepspeed
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    if ds_config.get("zero_optimization", {}).get("stage") == 3 and cfg.deepspeed.z3_leaf_layers:
        layers = make_zero3_leaf_layers(model)
        log_rank0("ZeRO-3: %d decoder layers (%s) gathered as one leaf module each", len(layers),
                  type(layers[0]).__name__ if layers else "none found")
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=_build_optimizer(model, cfg),
        lr_scheduler=lambda optimizer: _build_scheduler(optimizer, cfg, total_steps),
        config=ds_config,
        dist_init_required=False,
    )
    if isinstance(engine.optimizer, (FP16_Optimizer, FP16_UnfusedOptimizer)):
        engine.optimizer.optimizer.state.clear()
    if batch_zero_step_checks(engine.optimizer) or batch_zero3_grad_norm(engine.optimizer):
        log_rank0("ZeRO-%d: the step's gradient checks in one multi-tensor norm", ds_config["zero_optimization"]["stage"])
    return engine


def batch_zero_step_checks(optimizer: Any) -> bool:
    """Under ZeRO-1/2 in bf16, let the gradient norm alone decide whether a step is skipped, and take
    it with one multi-tensor kernel; returns whether it applied.

    Before each step DeepSpeed's ZeRO-1/2 optimizer tests every gradient for inf/NaN (six kernels and
    an add each, then an all-reduce and a host synchronisation), then takes the norm of every gradient
    on its own in float64 (a copy and a reduction each): some 3,500 kernel launches per step for the
    392 adapter matrices of a 7B LoRA, which the GPU waits for, since the synchronisation emptied its
    queue. The norm already settles the first question: a non-finite gradient makes it non-finite,
    DeepSpeed masks that to its invalid-norm value and skips the step (``check_grad_overflow``, on by
    default in bf16), as its ZeRO-3 does without the per-gradient test. So the test is dropped and the
    norm becomes ``torch._foreach_norm`` over the step's gradients with float32 accumulation, their
    squares summed in float32 (DeepSpeed: float64 norms and sum, then float32; the two norms agree
    within 1e-3 in the test named below).

    Not applied where the norm does not decide (fp16's loss scaling, ``check_grad_overflow=false``,
    ``compute_grad_norm=false``) or is taken elsewhere (optimizer offload). Nothing else of the step
    changes; ``tests/test_train_step.py`` checks the step against DeepSpeed's own on CPU.
    """
    from deepspeed.runtime.utils import mask_nan_or_inf_with_val_inplace
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if (not isinstance(optimizer, DeepSpeedZeroOptimizer) or optimizer.dtype != torch.bfloat16 or optimizer.cpu_offload
            or not optimizer.compute_grad_norm or not optimizer.check_grad_overflow):
        return False

    def check_overflow(partition_gradients: bool = True) -> None:
        optimizer.overflow = False

    def get_grad_norm_direct(gradients: list, params: list, norm_type: float = 2) -> torch.Tensor:
        grads = [g for g in gradients if not getattr(g, "_zero_padding", False)]
        if float(norm_type) != 2.0 or not grads or optimizer.model_parallel_world_size > 1:
            return DeepSpeedZeroOptimizer.get_grad_norm_direct(optimizer, gradients, params, norm_type)
        total = _global_l2_norm(grads, optimizer.dp_process_group)
        mask_nan_or_inf_with_val_inplace(total, device=optimizer.device)
        return total

    optimizer.check_overflow = check_overflow
    optimizer.get_grad_norm_direct = get_grad_norm_direct
    return True


def _global_l2_norm(tensors: list[torch.Tensor], group: Any) -> torch.Tensor:
    """The L2 norm of this rank's ``tensors`` and every other rank's of ``group`` together: one
    multi-tensor kernel for the per-tensor norms (float32 accumulation), their squares summed and
    all-reduced."""
    total = torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32)).square().sum()
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return total.sqrt()


def batch_zero3_grad_norm(optimizer: Any) -> bool:
    """ZeRO-3's gradient norm in one multi-tensor kernel (bf16, optimizer on the GPU, no model or
    expert parallelism); returns whether it applied.

    DeepSpeed's ZeRO-3 optimizer takes the norm of each gradient partition on its own in float64 (a
    cast and a reduction each: ~800 launches per 7B LoRA step) before it sums them; here
    ``torch._foreach_norm`` in float32, as :func:`batch_zero_step_checks` does for ZeRO-1/2, with
    DeepSpeed's all-reduce over the partition group and its −1 for a non-finite norm (which skips
    the step). Anything else, and other norm types, take DeepSpeed's own method;
    ``tests/test_train_step.py`` checks the step against DeepSpeed's own on CPU."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    if (not isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3) or optimizer.dtype != torch.bfloat16 or optimizer.offload_optimizer
            or optimizer.model_parallel_group is not None):
        return False

    def get_grad_norm_direct(gradients: list, params: list, norm_type: float = 2) -> torch.Tensor:
        if float(norm_type) != 2.0 or not gradients or optimizer._autoep_expert_parallel_group(params) is not None:
            return DeepSpeedZeroOptimizer_Stage3.get_grad_norm_direct(optimizer, gradients, params, norm_type)
        total = _global_l2_norm(gradients, optimizer._get_param_partition_group(params[0]))
        return torch.where(total.isfinite(), total, torch.full_like(total, -1.0))

    optimizer.get_grad_norm_direct = get_grad_norm_direct
    return True


def make_zero3_leaf_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Mark the model's decoder layers as ZeRO-3 leaf modules (before ``deepspeed.initialize``);
    returns them.

    DeepSpeed then hooks each layer instead of every module inside it: the layer's partitioned
    weights are gathered in one coalesced all-gather when the layer starts (forward, backward, and
    the recomputation under gradient checkpointing) and released after it, where per-module hooks
    gathered and released each weight on its own (a 7B LoRA step: ~800 all-gathers and the GPU idle
    a third of the step in the hooks). Trainable parameters of a leaf (adapters, or every weight in
    full fine-tuning) have their gradients reduced together by a full backward hook on the layer,
    which fires once the gradient of the layer's positional inputs is computed; when none of them
    requires a gradient, torch fires it at the gradient of the layer's *output*, before the layer's
    own backward has produced them. With frozen embeddings that is the first layer's input, so a
    pre-hook makes it require a gradient (the first layer then also computes its input gradient, as
    every other layer does); a training layer that gets no positional tensor input is an error.
    """
    from deepspeed.utils import set_z3_leaf_modules

    layers = decoder_layers(model)
    if not layers:
        return []
    set_z3_leaf_modules(model, [type(layers[0])])
    for layer in layers:
        if any(p.requires_grad for p in layer.parameters()):
            layer.register_forward_pre_hook(_input_requires_grad)
    return layers


def _input_requires_grad(layer: torch.nn.Module, args: tuple) -> None:
    if not torch.is_grad_enabled():
        return
    inputs = [a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
    if not inputs:
        raise RuntimeError(f"{type(layer).__name__} is called without a positional tensor input, so DeepSpeed's ZeRO-3 "
                           "leaf module could not reduce its gradients after its backward pass; set "
                           "deepspeed.z3_leaf_layers=false")
    if not any(a.requires_grad for a in inputs):
        inputs[0].requires_grad_(True)


def _build_optimizer(model: torch.nn.Module, cfg: SFTConfig) -> torch.optim.Optimizer:
    """AdamW over trainable parameters; no weight decay on biases, norms and DoRA magnitudes (1-D).

    Torch's fused AdamW on GPU (no DeepSpeed JIT build on the critical path); DeepSpeedCPUAdam when
    optimizer states are offloaded, since DeepSpeed rejects other optimizers with offload.
    """
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.train.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if cfg.deepspeed.offload_optimizer:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, lr=cfg.train.lr, betas=(0.9, 0.999), adamw_mode=True)
    return torch.optim.AdamW(groups, lr=cfg.train.lr, betas=(0.9, 0.999), fused=cfg.scaling.use_gpu or None)


def _build_scheduler(optimizer: torch.optim.Optimizer, cfg: SFTConfig, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    warmup = int(cfg.train.warmup_ratio * total_steps)
    kind = cfg.train.lr_scheduler

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = (step - warmup) / max(1, total_steps - warmup)
        if kind == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
        if kind == "linear":
            return max(0.0, 1.0 - progress)
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def optimizer_step(engine: Any, micro: list[Batch], device: torch.device, want_grad_norm: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One optimizer step over the step's micro-batches; returns the summed loss of the
    micro-batches and, under ZeRO-0 when asked, the global gradient norm (other stages keep
    their own, ``engine.get_global_grad_norm()``).

    Each micro-batch's summed token loss is divided by the step's global target count over the
    world size (``num_items_in_batch``), so the gradients accumulate to the token mean of the
    whole step once DeepSpeed averages them over ranks; DeepSpeed must not divide again by the
    accumulation steps (``scale_wrt_gas=False``).
    """
    n_targets = torch.tensor(float(sum(b.num_targets for b in micro)), device=device)
    dist.all_reduce(n_targets)
    world = dist.get_world_size()
    total = torch.zeros((), dtype=torch.float64, device=device)
    grad_norm = None
    for b in micro:
        inputs = {k: v.to(device, non_blocking=True) for k, v in b.inputs.items()}
        out = engine(**inputs, num_items_in_batch=n_targets / world)
        # DeepSpeed (0.19) hooks every tensor the model returns to divide its gradient by the
        # accumulation steps unless engine.backward() marked the graph first; the model's own
        # loss tensor is hooked before that mark, so without a copy ZeRO-0's gradients came out
        # divided by grad_accum_steps. Backward from a copy runs the mark first.
        engine.backward(out.loss.clone(), scale_wrt_gas=False)
        if want_grad_norm and engine.zero_optimization_stage() == 0 and engine.is_gradient_accumulation_boundary():
            grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
            grad_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])) if grads else torch.zeros(())
        engine.step()
        total += out.loss.detach().double()
    return total, grad_norm


def evaluate_loss(engine: Any, cfg: SFTConfig, device: torch.device, rows: list[tuple[np.ndarray, np.ndarray]]) -> float:
    """Token-weighted mean loss over this rank's ``rows`` of the eval split, all ranks together.
    Every rank runs the same number of forward passes (ZeRO-3 gathers parameters collectively); a
    rank with fewer batches repeats one with zero weight."""
    evals = MicroBatches(rows, micro_batch_size=cfg.train.micro_batch_size,
                         max_seq_length=cfg.data.max_seq_length, packing=False, pad_id=0, seed=0)
    batches = evals.sequential()
    n = torch.tensor(len(batches), device=device)
    dist.all_reduce(n, op=dist.ReduceOp.MAX)
    filler = batches[0] if batches else _filler_batch()
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


def _filler_batch() -> Batch:
    ids = np.array([0, 0], dtype=np.int64)
    return MicroBatches([(ids, np.array([-100, 0]))], micro_batch_size=1, max_seq_length=2, packing=False, pad_id=0, seed=0).sequential()[0]



def _save_and_report(engine: Any, cfg: SFTConfig, tokenizer: Any, step: int, metrics: dict, place: RayWorker | InDriver) -> None:
    """Every rank saves its DeepSpeed shard (a collective) and reports; rank 0 adds the adapter."""
    rank = dist.get_rank()
    tmp = Path(tempfile.mkdtemp(prefix="zerolab-ckpt-"))
    try:
        # An adapter run saves only what trains: the frozen base weights are the model it started from.
        engine.save_checkpoint(str(tmp / "deepspeed"), tag="state", client_state={"step": step, "packer": PACKER},
                               exclude_frozen_parameters=cfg.adapter.is_peft())
        torch.save(_rng_state(), tmp / f"rng_rank{rank}.pt")
        state = _gather_for_save(engine, full=not cfg.adapter.is_peft())
        if rank == 0:
            n = adapters.save_trained(engine.module, state, tmp / "adapter", tokenizer)
            log_rank0("saved %s (%d tensors, checked) at step %d", "adapter" if cfg.adapter.is_peft() else "model", n, step)
        dist.barrier()
        place.report(metrics, tmp, f"checkpoint_{step:07d}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _gather_for_save(engine: Any, *, full: bool) -> dict[str, torch.Tensor]:
    """Full CPU tensors of what gets saved (rank 0; empty elsewhere). Under ZeRO-3 the parameters
    are gathered from all ranks first, which every rank must join."""
    import deepspeed

    module = engine.module
    rank0 = dist.get_rank() == 0
    if engine.zero_optimization_stage() == 3:
        if full:
            state = engine._zero3_consolidated_16bit_state_dict()
            return state if rank0 else {}
        params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=None):
            return {n: p.detach().cpu().clone() for n, p in params} if rank0 else {}
    if not rank0:
        return {}
    if full:
        return {k: v.detach().cpu() for k, v in module.state_dict().items()}
    return {n: p.detach().cpu().clone() for n, p in module.named_parameters() if p.requires_grad}


def _restore(engine: Any, rank: int, checkpoint: Any, *, adapter_only: bool, packing: bool) -> int:
    """Load ``checkpoint`` (a retry's or a relaunch's); returns the step to start at."""
    if checkpoint is None:
        return 0
    from zerolab.checkpoints import CheckpointError

    with checkpoint.as_directory() as folder:
        try:
            # Adapter checkpoints hold the trained parameters only (the rest was loaded from the model).
            path, client_state = engine.load_checkpoint(str(Path(folder) / "deepspeed"), tag="state",
                                                         load_module_strict=not adapter_only)
        except (OSError, RuntimeError, KeyError, ValueError) as exc:
            raise CheckpointError(f"checkpoint {checkpoint.path} cannot be loaded ({type(exc).__name__}: {exc}); "
                                  "delete it to resume from an earlier one, or pass --restart") from exc
        if path is None:
            raise CheckpointError(f"checkpoint {checkpoint.path} holds no DeepSpeed state; it is incomplete. "
                                  "Delete it to resume from an earlier one, or pass --restart")
        rng_file = Path(folder) / f"rng_rank{rank}.pt"
        if rng_file.is_file():
            _set_rng_state(torch.load(rng_file, weights_only=False))
    step = int(client_state["step"])
    log_rank0("resumed from %s at step %d", checkpoint.path, step)
    change = packer_change(client_state, packing=packing)
    if change and rank == 0:
        logger.warning(change)
    return step


def packer_change(client_state: dict[str, Any], *, packing: bool) -> str | None:
    """What a packed run resumed from ``client_state`` cannot reproduce, if its checkpoint's packer
    planned sequences otherwise (checkpoints before best fit recorded none: next fit)."""
    was = client_state.get("packer", "next-fit")
    if not packing or was == PACKER:
        return None
    return (f"this checkpoint was written while packing planned sequences {was}, now {PACKER}: the rest of its epoch "
            "groups that epoch's rows anew, so some of them are seen twice and others not at all (later epochs are "
            "unaffected); pass --restart to train from the start instead")


class _FirstStepClock:
    """The micro-batch stream, noting the wall-clock time at which the first optimizer step has
    finished on the device (when the next step asks for its first micro-batch): the end of start-up."""

    def __init__(self, stream: Iterator[Batch], grad_accum_steps: int, device: torch.device) -> None:
        self.stream, self.device = stream, device
        self.first_step_unix: float | None = None
        self._until = grad_accum_steps

    def __iter__(self) -> _FirstStepClock:
        return self

    def __next__(self) -> Batch:
        if self._until == 0 and self.first_step_unix is None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # once per run
            self.first_step_unix = time.time()
        self._until -= 1
        return next(self.stream)


def _rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


STALE_BUILD_LOCK_S = 600
"""Older than any build of a DeepSpeed op (about a minute on two cores)."""


def clear_stale_build_locks(max_age_s: float = STALE_BUILD_LOCK_S) -> list[Path]:
    """Remove the lock files that killed just-in-time builds of DeepSpeed ops left behind.

    torch builds an op (CPU Adam for optimizer offload, the CPU accelerator's shared-memory
    collectives) under ``<extensions dir>/<op>/lock`` and every later process waits, silently and
    forever, while that file exists: a worker killed mid-build would hang every run that needs the
    op. A lock older than any build is taken for such a leftover."""
    from torch.utils.cpp_extension import get_default_build_root

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    removed = []
    for lock in [*root.glob("*/lock"), *root.glob("*/*/lock")]:
        with contextlib.suppress(FileNotFoundError):  # another worker of this node was first
            if time.time() - lock.stat().st_mtime > max_age_s:
                lock.unlink()
                logger.warning("removed %s, left by an interrupted build of a DeepSpeed op (it would wait forever)", lock)
                removed.append(lock)
    return removed


def _setup_worker_logging(*, own_handler: bool) -> None:
    # Its own handler on a Ray worker: Ray has configured the worker's root logger already
    # (basicConfig would do nothing). The job's own process keeps the job's logging.
    ours = logging.getLogger("zerolab")
    if own_handler and not ours.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", datefmt="%H:%M:%S"))
        ours.addHandler(handler)
        ours.propagate = False
    ours.setLevel(logging.INFO)
    for noisy in ("DeepSpeed", "deepspeed", "torch.distributed", "transformers", "peft"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    quiet_ray_data_logging()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # DeepSpeed still calls torch.distributed's deprecated collectives on every step.
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_warning()


def _offload_label(cfg: SFTConfig) -> str:
    parts = [name for name, on in (("optimizer", cfg.deepspeed.offload_optimizer), ("params", cfg.deepspeed.offload_param)) if on]
    return f" + offload {'/'.join(parts)}" if parts else ""


def _hms(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"

