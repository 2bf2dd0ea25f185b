"""Host terms: the RSS of each worker process by phase (model load, training, the final save)
and what a node holds besides its workers."""

from __future__ import annotations

import math

from zerolab.memory.activations import offloaded_checkpoints
from zerolab.memory.calibration import DEFAULT_IMPORTS_CPU_BYTES, worker_imports_rss
from zerolab.memory.context import EstimateContext
from zerolab.memory.units import pow2


def _cpu_imports(job: EstimateContext) -> int:
    """What a CPU worker's imports hold (:attr:`Calibration.host_imports_cpu_bytes`)."""
    if job.cal.host_imports_cpu_bytes is not None:
        return job.cal.host_imports_cpu_bytes
    return worker_imports_rss() or DEFAULT_IMPORTS_CPU_BYTES


def host_components(job: EstimateContext, device_peak: int) -> tuple[dict[str, int], dict[str, int], dict[str, int], dict[str, int]]:
    """Per worker: process baseline (on CPU: what its imports hold, measured here, plus the rest of
    the process, fitted); dataset shard (⌈rows/N⌉ × (16·S + row overhead)); model
    load (ZeRO 0-2 every rank reads the whole checkpoint, ZeRO-3 rank 0 alone: P × the file's
    bytes per element, plus P·e when converting dtype, × host_load_factor; on GPU with ZeRO 0-2,
    where tensors go to the GPU as they are read, the checkpoint's largest file
    (:meth:`~zerolab.memory.shapes.ModelShape.largest_checkpoint_file`) on top of what the process
    holds before the load (``host_gpu_before_load_bytes``), or P × the file's bytes ×
    host_load_factor when converting dtype; ZeRO-3 with parameter offload: + the pinned partitions,
    filled while the checkpoint is held); offloaded optimizer (ZeRO 1-2: fp32 master, fp32 gradient and
    bit16 parameter partitions pinned, 10·⌈T/N⌉, AdamW states 8·⌈T/N⌉ unpinned, a staging
    buffer of the largest parameter; ZeRO-3: fp32 master pinned, gradient partition e pinned,
    states, and the fp32 gradient of the step: 18·⌈T/N⌉); offloaded parameters (every
    partition pinned separately, plus the trainable flat buffer); offloaded checkpoints
    (``model.offload_checkpoints``: a pinned copy of each layer's input but the last, B·S·e·h bytes
    each, through the step); pinned-memory rounding (torch rounds each pinned allocation up to a
    power of two); on CPU runs the device peak ×
    host_cpu_tensor_factor (host_cpu_tensor_factor_checkpointing with gradient checkpointing); the
    final save on rank 0 (full fine-tuning gathers the whole state dict: P·e)."""
    cal, e, n = job.cal, job.e, job.n
    dataset = 16 * job.batch.shard_tokens + job.batch.shard_rows * cal.host_row_bytes
    base = cal.host_process_gpu_bytes if job.gpu else cal.host_process_cpu_bytes + _cpu_imports(job)
    # Loaded in the training precision; peft's adapters are created in fp32 before DeepSpeed casts them.
    weights_bytes = sum(p.total * (4 if p.adapter else e) for p in job.inv)
    base_params = sum(p.total for p in job.inv if not p.adapter)
    file_bytes = job.shape.weights_bytes_per_param or e
    # The checkpoint's pages as they are read, plus a converted private copy when dtypes differ.
    # Under ZeRO 0-2 on GPU (zerolab.models.load_model) tensors go to the GPU as they are read
    # and peft wraps the model there: no converted copy stays on the host, and DoRA's weight-norm
    # set-up reads no checkpoint pages there. A checkpoint in the training dtype loads lazily:
    # transformers maps each file and a file's pages stay resident from the copy of its first
    # tensor to the release of its last, when it is unmapped, so at most the largest file is
    # resident (an RSS trace of a sharded checkpoint on CPU; 1.5B on one H100: the run's peak is
    # the process before the load plus its one 2.875 GiB file). Converting goes through the
    # device map, whose files all stay mapped until the load ends; so does a quantized base, which
    # loads through the device map at every stage, quantized on the GPU as it arrives.
    lazy = job.gpu and job.stage < 3 and file_bytes == e and job.quantization == "none"
    if lazy:
        load = job.shape.largest_checkpoint_file(file_bytes)
    elif job.gpu and (job.stage < 3 or job.quantization != "none"):
        load = int(base_params * file_bytes * cal.host_load_factor)
    else:
        load = int(base_params * (file_bytes + (e if file_bytes != e else 0)) * cal.host_load_factor)

    groups = [g for g in (sum(p.total for p in job.inv if p.trainable and (p.ndim >= 2) == big) for big in (True, False)) if g]
    opt_pinned: list[int] = []
    opt_unpinned = 0
    if job.offload_opt and job.stage < 3:
        for g in groups:
            part = job.part(g)
            opt_pinned += [4 * part, 4 * part, e * part]  # fp32 master, fp32 gradient, bit16 staging
            opt_unpinned += 8 * part  # DeepSpeedCPUAdam's exp_avg, exp_avg_sq
        opt_pinned.append(job.largest_trainable() * e)  # gradient staging buffer
        if job.cfg.train.grad_accum_steps > 1:  # per-parameter gradient accumulators
            opt_pinned += [p.numel * e for p in job.inv if p.trainable for _ in range(math.ceil(p.count / n))]
    elif job.offload_opt:
        for g in groups:
            opt_pinned.append(4 * job.part(g))  # fp32 master partition
            opt_unpinned += 12 * job.part(g)  # states and the fp32 gradient of the step
        opt_pinned.append(job.e * job.part(job.T))  # flat gradient partition buffer
    param_pinned: list[int] = []
    if job.offload_param:
        param_pinned = [job.part(job.stored_bytes(p)) for p in job.inv if not job.persistent(p) for _ in range(p.count)]
        param_pinned += [job.e * job.part(g) for g in groups]
    pin = job.gpu and job.knobs.pin_memory
    # Checkpoint offload pins its copies through torch whatever DeepSpeed's pin_memory says.
    checkpoints = offloaded_checkpoints(job)
    rounding = (sum(pow2(x) - x for x in opt_pinned + param_pinned) if pin else 0) + sum(pow2(x) - x for x in checkpoints)
    retained = cal.host_cpu_tensor_factor_checkpointing if job.cfg.model.gradient_checkpointing else cal.host_cpu_tensor_factor
    cpu_tensors = 0 if job.gpu else int(device_peak * retained)
    save = weights_bytes if not job.peft else 4 * job.T
    worker = {
        "worker process": base,
        "dataset shard": dataset,
        "model loading": load,
        "offloaded optimizer": sum(opt_pinned) + opt_unpinned,
        "offloaded parameters": sum(param_pinned),
        "offloaded checkpoints": sum(checkpoints),
        "pinned-memory rounding": rounding,
        "tensors (CPU training)": cpu_tensors,
        "checkpoint save (rank 0)": save,
    }
    resident = worker["offloaded optimizer"] + worker["offloaded parameters"] + worker["offloaded checkpoints"] + rounding + cpu_tensors
    # ZeRO-3 with parameter offload fills the pinned partitions while rank 0 still holds the
    # checkpoint it reads (measured: rank 0's peak is the sum of both).
    partitions = sum(param_pinned) + (sum(pow2(x) - x for x in param_pinned) if pin else 0)
    # A GPU process that holds the whole checkpoint (ZeRO-3's rank 0, a dtype conversion) reads it
    # before its first steps bring in the rest of its baseline; with parameter offload it fills
    # pinned partitions while it reads, and its load peaks on the whole baseline (measured).
    whole = job.gpu and not job.offload_param and (job.stage == 3 or file_bytes != e or job.quantization != "none")
    # A lazy load peaks on what the process holds before it reads the checkpoint (fitted), not on
    # its steady-state baseline. So does a quantized base's: zerolab.engine.build_model loads it through
    # the device map at every stage before DeepSpeed starts (under ZeRO-3 before the partitioning
    # switch is turned on), at the point of the worker's life where a lazy load runs, and bitsandbytes
    # quantizes each weight on the GPU as it arrives. Its files' pages stay resident to the end of the
    # load (the whole checkpoint, above). The 25 quantized runs of the benchmark's results (0.5B, 7B,
    # 14B; nf4 and int8; ZeRO 0, 2 and 3; one and two GPUs) sat 0.17-0.42 GiB per worker below the
    # training baseline less its first steps, whatever the checkpoint's size.
    before_load = lazy or (whole and job.quantization != "none")
    load_base = cal.host_gpu_before_load_bytes if before_load else base - (cal.host_gpu_first_steps_bytes if whole else 0)
    rank0 = {
        "model load": load_base + dataset + load + partitions,
        "training": base + dataset + resident,
        "checkpoint save": base + dataset + resident + save,
    }
    # ZeRO-3: rank 0 alone reads the checkpoint into the partitions; ZeRO 0-2, and a quantized base at
    # every stage (each rank quantizes the whole base through its device map): every rank loads it
    # (14B nf4 and int8 ZeRO-3 on 2 GPUs, h200x2-59: 58.1 GiB for both workers, as under ZeRO-2).
    every_rank = job.stage < 3 or job.quantization != "none"
    other = {"model load": (load_base + load if every_rank else base) + dataset, "training": rank0["training"]}
    node = {"Ray services and driver": cal.host_ray_node_bytes} if cal.host_ray_node_bytes else {}
    return worker, rank0, other, node
