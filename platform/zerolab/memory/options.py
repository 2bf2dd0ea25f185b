"""Options, estimates, verdicts: ZeRO stage × offload ranked by speed, the :class:`Estimate` of one
option and its :class:`Fit` against the machine's limits."""

from __future__ import annotations

import math
from dataclasses import dataclass

from zerolab.memory.batch import BatchShape
from zerolab.memory.calibration import Calibration
from zerolab.memory.limits import Limits
from zerolab.memory.shapes import ModelShape
from zerolab.memory.units import format_gib
from zerolab.zero import OffloadMode, Option

RELATIVE_STEP_TIME: dict[tuple[int, OffloadMode], float] = {
    (0, "none"): 1.0,
    (1, "none"): 0.9,
    (2, "none"): 0.85,
    (3, "none"): 1.3,
    (1, "optimizer"): 2.0,
    (2, "optimizer"): 2.0,
    (3, "optimizer"): 2.5,
    (3, "all"): 3.5,
}
"""Rough step time of each option relative to ZeRO-0, used only to rank options. ZeRO-2, its step's
checks batched by zerolab (``train.batch_zero_step_checks``), measured 0.77-0.87× ZeRO-0's step for
a 7B LoRA on one H100 (docs/benchmark.md, leases h100-24 and h100-26); ZeRO-1 shares that optimizer
(not measured). The rest from the seeds' measurements: ZeRO-3 pays for gathering parameters,
offload 2-3× slower, ZeRO-3 with full offload up to 6× on 14B LoRA."""


ALL_OPTIONS = tuple(Option(s, o) for (s, o) in RELATIVE_STEP_TIME if (s, o) != (3, "optimizer"))
"""Every stage × offload combination the shipped DeepSpeed configs support (``zero3_offload.json``
offloads both; ZeRO-3 with the optimizer alone needs your own ``deepspeed.config``)."""


@dataclass(frozen=True)
class Fit:
    """The verdict of an estimate against limits: ``fits`` with one line per check in ``reasons``."""

    fits: bool
    reasons: tuple[str, ...]
    gpu_fraction: float | None = None
    """Device total / GPU memory (None when not checked)."""
    host_fraction: float | None = None
    """Node total / host RAM (None when not checked)."""

    @property
    def tight(self) -> bool:
        """Fits, but within the estimator's 10% error of a limit."""
        return self.fits and max(self.gpu_fraction or 0.0, self.host_fraction or 0.0) > 0.9

    @property
    def verdict(self) -> str:
        return "does not fit" if not self.fits else "fits (tight)" if self.tight else "fits"


@dataclass(frozen=True)
class Estimate:
    """Predicted memory of one job. Device figures are per worker (per GPU; on CPU runs they sit in
    host memory), host figures per worker process and per node. Each component is given at its
    own maximum; ``device_peak`` is the phase-aware peak (components do not all peak at once:
    gradients and the optimizer step come after the activations are freed)."""

    option: Option
    shape: ModelShape
    world_size: int
    use_gpu: bool
    precision: str
    micro_batch_size: int
    """Rows of the largest micro-batch (``train.micro_batch_size`` unless measured on the data)."""
    seq_len: int
    """The longest padded sequence of a micro-batch (``data.max_seq_length`` unless measured on the data)."""
    gradient_checkpointing: bool
    total_params: int
    trainable_params: int
    device: dict[str, int]
    """Per worker: weights, gathered parameters (ZeRO-3), gradients, master weights, optimizer
    states, activations, logits and loss, DeepSpeed buffers, the offload gradient buffer (ZeRO 1-2
    with optimizer offload), framework overhead."""
    device_phases: dict[str, int]
    """Live device bytes at the moments that can peak: init, forward/backward, optimizer step."""
    device_outside_allocator: dict[str, int]
    """Per GPU, outside torch's allocator: CUDA context, NCCL."""
    device_cached: dict[str, int]
    """Large blocks each step frees and allocates again, of which the allocator keeps the largest
    cached beside the peak (``zerolab.memory.terms.cached_blocks``)."""
    reserved_share: str
    """The Calibration constant for the share of the peak the allocator keeps cached otherwise
    (``zerolab.memory.terms.reserved_share``)."""
    device_stream_pools: dict[str, int]
    """ZeRO-3 without parameter offload, and ZeRO 1-2 whose gradient partition DeepSpeed allocates on its
    reduction stream: the peak of each CUDA stream's pool, which the allocator keeps apart
    (``zerolab.memory.terms.stream_pools``); reserved is at least their sum. Empty otherwise."""
    host_worker: dict[str, int]
    """Per worker process (``checkpoint save`` on rank 0 only)."""
    host_worker_phases: dict[str, int]
    """Rank 0's RSS at model load, in training, and at the final save."""
    host_other_worker_phases: dict[str, int]
    """The RSS of every other worker (no final save; under ZeRO-3 no model load either)."""
    host_node: dict[str, int]
    """Per node, once: Ray services and the driver."""
    calibration: Calibration
    notes: tuple[str, ...] = ()
    batch: BatchShape | None = None
    """The micro-batch and shard sizes the figures are for (data-aware or the worst case by config)."""

    @property
    def data_aware(self) -> bool:
        return self.batch is not None and self.batch.from_data

    @property
    def device_peak(self) -> int:
        """Peak bytes allocated through torch's allocator (compare with ``mem/gpu_peak_allocated_gib``)."""
        return max(self.device_phases.values())

    @property
    def device_peak_phase(self) -> str:
        return max(self.device_phases, key=lambda k: self.device_phases[k])

    @property
    def device_reserved(self) -> int:
        """Peak reserved by torch's caching allocator (compare with ``mem/gpu_peak_reserved_gib``)."""
        if not self.use_gpu:
            return self.device_peak
        # What the allocator holds beyond the live tensors is the larger of a share of the peak
        # (the churn of many activation-sized blocks, LoRA's case) and one large block freed and
        # allocated again each step, cached where it no longer fits (full fine-tuning's logits and
        # gradient copies, parameter offload's gather buffers).
        # Under ZeRO-3 the gathered weights have a pool of their own, peaking at another moment.
        cached = max(int(self.device_peak * (self.reserved_factor - 1)), max(self.device_cached.values(), default=0))
        return max(self.device_peak + cached, sum(self.device_stream_pools.values()))

    @property
    def reserved_factor(self) -> float:
        return getattr(self.calibration, self.reserved_share)

    @property
    def device_total(self) -> int:
        """What one GPU must hold: reserved peak plus CUDA context and NCCL (0 on CPU runs)."""
        return self.device_reserved + sum(self.device_outside_allocator.values()) if self.use_gpu else 0

    def workers_per_node(self, limits: Limits | None = None) -> int:
        """Workers on the fullest node: one per GPU, packed (Ray's PACK placement); on CPU, all on one node."""
        if self.use_gpu and limits is not None and limits.gpus_per_node:
            return min(self.world_size, limits.gpus_per_node)
        if not self.use_gpu and limits is not None and limits.num_nodes > 1:
            return math.ceil(self.world_size / limits.num_nodes)
        return self.world_size

    def host_worker_peak(self, *, rank0: bool = True) -> int:
        return max((self.host_worker_phases if rank0 else self.host_other_worker_phases).values())

    def host_workers(self, workers_per_node: int | None = None) -> int:
        """Sum of the peak RSS of the workers of the fullest node (compare with ``mem/host_rss_peak_gib``)."""
        n = self.world_size if workers_per_node is None else workers_per_node
        return self.host_worker_peak(rank0=True) + (n - 1) * self.host_worker_peak(rank0=False)

    def host_workers_before_save(self, workers_per_node: int | None = None) -> int:
        """``host_workers`` up to the final checkpoint's save: what a run's ``mem/host_rss_peak_gib``,
        read at its last logging step, measures (the save phase is still counted by the preflight)."""
        n = self.world_size if workers_per_node is None else workers_per_node
        rank0 = max(v for k, v in self.host_worker_phases.items() if k != "checkpoint save")
        return rank0 + (n - 1) * self.host_worker_peak(rank0=False)

    def host_total(self, workers_per_node: int | None = None) -> int:
        """Host RAM the fullest node needs: its workers plus Ray services and the driver (none for a
        job that trains in its own process without Ray: :func:`without_ray`)."""
        return self.host_workers(workers_per_node) + sum(self.host_node.values())

    def fits(self, limits: Limits) -> Fit:
        """Check the estimate against ``limits``; unknown limits are not checked (and say so)."""
        reasons: list[str] = []
        ok = True
        gpu_fraction = host_fraction = None
        if self.use_gpu:
            if limits.gpus_per_node is not None and self.world_size > limits.gpus_per_node * limits.num_nodes:
                ok = False
                reasons.append(f"GPUs: the job needs {self.world_size} (scaling.num_workers) but the machine has "
                               f"{limits.gpus_per_node * limits.num_nodes}")
            if limits.gpu_mem_bytes:
                gpu_fraction = self.device_total / limits.gpu_mem_bytes
                fits_gpu = self.device_total <= limits.gpu_mem_bytes
                ok &= fits_gpu
                reasons.append(f"GPU: {format_gib(self.device_total)} of {format_gib(limits.gpu_mem_bytes)} per GPU"
                               f"{'' if fits_gpu else ' — too much'}")
            else:
                reasons.append("GPU: not checked (no GPU memory known: give --gpu-mem or run where the GPUs are)")
        n = self.workers_per_node(limits)
        if limits.host_mem_bytes:
            need = self.host_total(n)
            host_fraction = need / limits.host_mem_bytes
            fits_host = need <= limits.host_mem_bytes
            ok &= fits_host
            reasons.append(f"host: {format_gib(need)} of {format_gib(limits.host_mem_bytes)} per node ({n} worker{'s' * (n > 1)})"
                           f"{'' if fits_host else ' — too much'}")
        else:
            reasons.append("host: not checked (host RAM unknown)")
        return Fit(ok, tuple(reasons), gpu_fraction, host_fraction)

    def summary(self, limits: Limits | None = None) -> str:
        n = self.workers_per_node(limits)
        gpu = (f"{format_gib(self.device_total)} per GPU (peak allocated {format_gib(self.device_peak)}, {self.device_peak_phase})"
               if self.use_gpu else f"{format_gib(self.device_peak)} of tensors per CPU worker")
        return f"{self.option.label}: {gpu}, host {format_gib(self.host_total(n))} per node"


@dataclass(frozen=True)
class PlanRow:
    option: Option
    estimate: Estimate | None
    """None when the job's config does not allow this option (``invalid`` says why)."""
    fit: Fit | None
    invalid: str | None = None


@dataclass(frozen=True)
class Recommendation:
    option: Option
    estimate: Estimate
    reason: str
    overrides: tuple[str, ...] = ()
    """Extra ``--set`` overrides needed beyond the option (e.g. gradient checkpointing)."""
