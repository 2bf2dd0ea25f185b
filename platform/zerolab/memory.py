"""Memory estimator and preflight: what a job needs per GPU and per node, before anything launches.

:func:`estimate` turns a job config and the model's Hugging Face config (no weights are loaded)
into an :class:`Estimate`: bytes per worker on the accelerator, component by component, and bytes
per node of host RAM. :func:`plan_options` repeats it over ZeRO stage × offload, :func:`recommend`
picks the fastest option that fits, and :func:`preflight` refuses a job that cannot fit with a
:class:`MemoryPreflightError` naming the estimate, the limit and the options that would fit.

The formulas follow what the training loop really does (``zerolab.train``):

- the model is loaded in the training precision ``e`` bytes per element (bf16/fp16: 2, fp32: 4);
  peft creates adapter weights in fp32 and DeepSpeed casts every parameter to bf16/fp16 at
  ``deepspeed.initialize`` — except under ZeRO-3, whose parameters were partitioned at load time
  (``zero.Init``) and are not cast, so there the adapters stay fp32 and so does their compute;
- the client optimizer is torch AdamW (fp32 ``exp_avg`` and ``exp_avg_sq``: 8 bytes per trainable
  parameter), or DeepSpeedCPUAdam in host memory under optimizer offload;
- in bf16/fp16 DeepSpeed keeps an fp32 master copy of every trainable parameter (ZeRO-0: the whole
  copy plus fp32 gradient copies at the step; ZeRO 1-3: this rank's partition), and ZeRO 1-3 keep
  that fp32 partition even in fp32 training;
- the loss is Hugging Face's ``ForCausalLMLoss`` on the full logits: the logits in ``e`` bytes,
  upcast to fp32, log-softmax (fp32, saved), and in the backward two more fp32 tensors of the
  logits' size; with 150k-token vocabularies this is often the largest single item;
- every Ray Train worker is its own process with its own host RSS (Python, torch, CUDA runtime,
  its dataset shard; on GPU the whole model passes through host memory while it loads).

Sizes of saved activations were checked tensor by tensor against autograd's saved tensors on
CPU (``tests/test_memory.py`` repeats that check on tiny models). Terms that depend on the
software stack rather than on arithmetic (CUDA context, allocator fragmentation, process RSS) are
the named constants of :class:`Calibration`, fitted from measurements with
``bench/calibrate_memory.py``; ``docs/calibration/memory_calibration.md`` lists the measured errors.

Everything here is arithmetic on configs: importing this module starts nothing, and only
:meth:`Limits.detect` and :func:`worker_imports_rss` (what the installed software costs a CPU
worker, measured once per environment) look at the machine.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zerolab.config import AdapterSpec, ConfigError, SFTConfig, validate
from zerolab.errors import UserError
from zerolab.zero import OffloadMode, Option

logger = logging.getLogger(__name__)

KIB, MIB, GIB = 1024, 1024**2, 1024**3

"""What ZeRO offloads to host memory: nothing, the optimizer (states, fp32 master weights and
gradients), or the optimizer and the parameters (ZeRO-3 only)."""

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The linear modules of a Llama/Qwen2-style decoder layer, in forward order (peft's
``all-linear`` selects exactly these: every linear layer except the output head)."""


class MemoryEstimateError(ValueError):
    """The memory of this job cannot be estimated (for instance an unsupported architecture)."""


class MemoryPreflightError(UserError, MemoryEstimateError):
    """The job cannot fit the memory it would run on. ``estimate``, ``limits``, ``fit`` and
    ``fitting`` (the options that would fit, fastest first) are kept for callers."""

    remedies = ("force",)

    def __init__(self, message: str, *, estimate: Estimate, limits: Limits, fit: Fit, fitting: list[PlanRow]) -> None:
        super().__init__(message)
        self.estimate, self.limits, self.fit, self.fitting = estimate, limits, fit, fitting


# --- calibration: every term that measurement, not arithmetic, decides ------------------------


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """Constants of the estimate that depend on the software stack rather than on the model's
    arithmetic. GPU values are fitted to the runs in ``docs/calibration/memory_calibration.md``
    (H100, 2 × and 4 × H200, torch 2.11, DeepSpeed 0.19.8, Ray 2.60; ``bench/calibrate_memory.py``
    measures and fits them); CPU values were measured on the test machine."""

    framework_device_bytes: int = 93 * MIB
    """GPU memory that torch and DeepSpeed allocate through torch's allocator besides the model's
    tensors: cuBLAS workspaces, communication staging tensors, RNG state, bookkeeping tensors
    (fitted: the median residual of the measured allocated peaks)."""
    reserved_factor: float = 1.003
    """Peak reserved / peak allocated of torch's caching allocator at ZeRO 0-2, with the expandable
    segments zerolab's workers use (``zerolab.cluster.CUDA_ALLOC_CONF``): the median of the calibration
    runs (1.001-1.004 with LoRA, 1.07 for full fine-tuning). With fixed-size blocks it was 1.01-2.8."""
    reserved_factor_zero3: float = 1.049
    """The same under ZeRO-3 without parameter offload, which gathers and frees every frozen weight
    each pass (measured 1.04-1.06 with LoRA)."""
    reserved_param_offload_bytes: int = 1354 * MIB
    """ZeRO-3 with parameter offload: what the allocator holds on top of ``reserved_factor_zero3`` ×
    allocated — the freed buffers of whole gathered parameters and of partitions copied from the
    host, cached between modules (fitted: the median of measured reserved − factor × allocated;
    measured 1.1-1.6 GiB on 0.5B and 7B, 1 and 2 GPUs)."""
    cuda_context_bytes: int = 600 * MIB
    """Per GPU process, outside torch's allocator (so not in ``mem/gpu_*``, but on the card): CUDA
    context, loaded kernel images, cuBLAS/cuDNN handles."""
    nccl_bytes: int = 512 * MIB
    """Per GPU process when world size > 1, outside torch's allocator: NCCL communicator buffers."""
    host_imports_cpu_bytes: int | None = None
    """Host RSS of the software a worker training on CPU imports (:data:`WORKER_IMPORTS`: Python,
    torch, DeepSpeed, transformers, peft, Ray Train and Ray Data), which depends on what is
    installed rather than on the job: None measures it in this environment
    (:func:`worker_imports_rss`: 600 MiB with torch 2.13.0+cpu on the 2-core machine, where
    :data:`DEFAULT_IMPORTS_CPU_BYTES` stands in when it cannot be measured). torch's CUDA build
    alone holds 491 MiB once imported against 220 MiB for its CPU build (torch 2.11.0+cu130 with no
    GPU visible; 2.13.0+cpu), which a constant fitted on one of them cannot follow."""
    host_process_cpu_bytes: int = 131 * MIB
    """Host RSS of one Ray Train worker training on CPU beyond its imports and its tensors: Ray's
    worker runtime, the gloo process group, DeepSpeed's engine, MLflow's client and system-metrics
    monitor (rank 0's runs 50-56 MiB above the other ranks'). Fitted: the median residual of the
    default job and the DoRA ZeRO-3 NER job on the 2-core machine (docs/calibration/heldout.md)."""
    host_process_gpu_bytes: int = 2105 * MIB
    """The same on a GPU worker: adds the CUDA runtime and the host side of the CUDA context, cuBLAS,
    cuDNN and NCCL (fitted, with ``host_load_factor_gpu``, to LoRA runs of the 0.5B and 7B shapes)."""
    host_gpu_first_steps_bytes: int = 460 * MIB
    """The part of ``host_process_gpu_bytes`` that comes only with the first training steps (the
    kernel images and library state the CUDA runtime loads as each is first used), so is not yet
    resident while a process reads the whole checkpoint: traced (``bench/torchrun_loop.py
    --rss-trace``, 0.5B ZeRO-3 on one H100, lease h100-23) 1.76 GiB at the end of the load, 2.22-2.23
    GiB after the first steps; the 0.43-0.48 GiB by which such loads were over-predicted
    (docs/calibration/heldout.md, set D)."""
    host_load_factor: float = 1.0
    """Host RSS of loading the weights, as a multiple of the bytes read, where the whole checkpoint
    is held on the host at once: CPU training, rank 0 under ZeRO-3 (it reads the checkpoint,
    then partitions it), and ZeRO 0-2 on GPU converting the checkpoint's dtype on the way to the GPU
    (its files' pages stay mapped until the load ends). ``from_pretrained`` maps the safetensors
    files and pages come in as they are read; a dtype conversion on the host adds a private copy.
    Measured +1.0× on CPU and under ZeRO-3 on GPU; 0.93× (7B) and 0.4-0.5× (0.5B) converting to
    the GPU."""
    host_load_factor_gpu: float = 0.285
    """The same for ZeRO 0-2 on GPU, where every rank loads the model and DeepSpeed moves it to its
    GPU: only part of the checkpoint is resident at the peak (fitted: 0.29× the file)."""
    host_cpu_tensor_factor: float = 1.5
    """CPU training only: worker RSS growth / peak bytes of live tensors. glibc keeps freed heap
    chunks of activation-sized tensors mapped, so RSS runs ahead of what is allocated, by an
    amount that depends on the allocation pattern: measured 1.2× (full fine-tuning), 1.24× (LoRA,
    packed) and 1.5× (DoRA, padded) in Ray runs of the tiny model with 8-16k-token micro-batches
    (docs/calibration/heldout.md). With a fixed mmap threshold (``MALLOC_TRIM_THRESHOLD_=0`` or
    ``MALLOC_MMAP_THRESHOLD_=65536`` in the workers' environment) glibc returns them and RSS follows
    the live tensors (1.0-1.13×), but CPU steps took 30-65% longer on the 2-core machine."""
    host_cpu_tensor_factor_checkpointing: float = 2.7
    """The same with gradient checkpointing, whose forward pass allocates and frees every layer's
    activations and whose backward pass does it again, one layer at a time, beside the saved
    inputs: glibc keeps far more than the (smaller) live peak. Measured 2.15-2.67× in Ray runs
    (LoRA, full and DoRA; 2.85-3.6× in one process without DeepSpeed), 1.13× with a fixed mmap
    threshold; fitted as the highest of the Ray runs, so that they are not under-predicted."""
    host_ray_node_bytes: int = 3 * GIB
    """Per node, outside the training workers (so not in ``mem/host_rss_peak_gib``): raylet, GCS,
    dashboard, the driver with its tokenizer and Ray Data, idle pooled Ray workers."""
    host_row_bytes: int = 400
    """Host bytes per tokenized row held by a worker beyond its token ids and labels (Python and
    numpy object overhead); the ids and labels add 16 bytes per token (two int64 arrays)."""


DEFAULT_CALIBRATION = Calibration()

WORKER_IMPORTS = ("zerolab.train", "ray.train.torch", "ray.data", "deepspeed", "peft")
"""What a worker has imported by its first step: ``zerolab.train`` (torch, transformers, Ray
Train) and what it imports where it builds the engine, the adapter and its data shard."""

DEFAULT_IMPORTS_CPU_BYTES = 600 * MIB
""":data:`WORKER_IMPORTS`' RSS with torch 2.13.0+cpu on the 2-core machine, where
:func:`worker_imports_rss` cannot measure it."""


@functools.lru_cache(maxsize=1)
def worker_imports_rss() -> int | None:
    """RSS of a fresh Python process of this environment once it has imported
    :data:`WORKER_IMPORTS` on DeepSpeed's CPU accelerator: the part of a CPU worker's baseline that
    the installed software decides. Measured once in a subprocess (about 10 s on the 2-core machine)
    and kept in ``<zerolab cache>/host_baseline/``, keyed by this Python and the versions of the
    packages (torch's names its build) and of zerolab; None where it cannot be measured.

    Measured on the driver, it stands for workers on nodes with the same software (a cluster's
    nodes run one image)."""
    import hashlib
    import importlib.metadata
    import json
    import os
    import subprocess
    import sys

    import zerolab
    from zerolab.models import cache_dir

    versions: dict[str, str | None] = {}
    for package in ("torch", "deepspeed", "transformers", "peft", "ray", "numpy", "pyarrow"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    key = hashlib.sha256(json.dumps([sys.executable, sys.version, versions, zerolab.__version__, WORKER_IMPORTS]).encode()).hexdigest()
    path = cache_dir() / "host_baseline" / f"{key[:32]}.json"
    try:
        return int(json.loads(path.read_text())["rss_bytes"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    probe = f"import {', '.join(WORKER_IMPORTS)}\nprint(open('/proc/self/status').read())"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    try:
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300, check=True).stdout
        found = re.search(r"^VmRSS:\s+(\d+) kB", out, re.MULTILINE)
        if found is None:
            raise ValueError("no VmRSS in /proc/self/status")
        rss = int(found.group(1)) * KIB
    except (OSError, ValueError, subprocess.SubprocessError) as exc:
        logger.warning("could not measure what a CPU worker's imports hold (%s); the host estimate takes %d MiB",
                       exc, DEFAULT_IMPORTS_CPU_BYTES // MIB)
        return None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.partial")
        partial.write_text(json.dumps({"rss_bytes": rss, "versions": versions, "python": sys.executable}))
        partial.replace(path)
    except OSError as exc:
        logger.debug("could not keep the measured import RSS in %s: %s", path, exc)
    return rss

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


# --- the model: parameters by module, from the config alone ------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a Llama/Qwen2-style decoder that memory depends on."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool = False
    mlp_bias: bool = False
    model_type: str = "qwen2"
    weights_bytes_per_param: int | None = None
    """Bytes per element of the saved checkpoint (config ``dtype``/``torch_dtype``), None if unknown."""

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        """Read a transformers config (or any object or dict with its attribute names)."""
        get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
        model_type = str(get("model_type", "") or "")
        missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
                   if not isinstance(get(k), int)]
        if missing:
            raise MemoryEstimateError(
                f"the memory estimator supports Llama/Qwen2-style decoders; this model config (model_type "
                f"{model_type or 'unknown'!r}) lacks {', '.join(missing)}"
            )
        heads = get("num_attention_heads")
        head_dim = get("head_dim") or get("hidden_size") // heads
        attention_bias = bool(get("attention_bias", False))
        qwen2 = model_type in ("qwen2", "qwen2_moe")
        return cls(
            hidden_size=get("hidden_size"),
            intermediate_size=get("intermediate_size"),
            num_layers=get("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=get("num_key_value_heads") or heads,
            head_dim=head_dim,
            vocab_size=get("vocab_size"),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases and none on o_proj; Llama-style models follow attention_bias.
            qkv_bias=qwen2 or attention_bias,
            o_bias=attention_bias and not qwen2,
            mlp_bias=bool(get("mlp_bias", False)),
            model_type=model_type or "unknown",
            weights_bytes_per_param=_dtype_bytes(get("dtype", None) or get("torch_dtype", None)),
        )

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of each projection of one decoder layer."""
        h, i = self.hidden_size, self.intermediate_size
        return {
            "q_proj": (h, self.q_dim), "k_proj": (h, self.kv_dim), "v_proj": (h, self.kv_dim), "o_proj": (self.q_dim, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h),
        }

    def describe(self) -> str:
        return (f"{self.model_type} {_count(self.num_params())} params: {self.num_layers} layers, hidden {self.hidden_size}, "
                f"intermediate {self.intermediate_size}, {self.num_heads} heads / {self.num_kv_heads} KV, "
                f"vocab {self.vocab_size}{', tied embeddings' if self.tie_word_embeddings else ''}")

    def num_params(self) -> int:
        return sum(p.total for p in parameter_inventory(self, AdapterSpec(method="full")) if not p.adapter)


@dataclass(frozen=True)
class ParamSpec:
    """``count`` parameters of ``numel`` elements each (one per layer for layer parameters)."""

    name: str
    numel: int
    count: int
    trainable: bool
    adapter: bool
    ndim: int
    module: str
    """The module that uses it (``layers.q_proj``, ``embed_tokens``, ``lm_head``, ``norm``...)."""

    @property
    def total(self) -> int:
        return self.numel * self.count


def target_projections(spec: AdapterSpec) -> tuple[list[str], list[str]]:
    """(the projections peft wraps, the target names this estimator does not know) for ``spec``.
    peft matches a target against the end of each module's name; ``all-linear`` is every linear
    layer but the output head."""
    if not spec.is_peft():
        return [], []
    if list(spec.target_modules) == ["all-linear"]:
        return list(PROJECTIONS), []
    known = [p for p in PROJECTIONS if any(p == t or p.endswith(f".{t}") or t.endswith(p) for t in spec.target_modules)]
    unknown = [t for t in spec.target_modules if not any(t == p or t.endswith(p) for p in PROJECTIONS) and t != "lm_head"]
    if "lm_head" in spec.target_modules:
        known.append("lm_head")
    return known, unknown


def parameter_inventory(shape: ModelShape, spec: AdapterSpec) -> list[ParamSpec]:
    """Every parameter of the model with ``spec``'s adapter applied, grouped by module.

    Base model: embeddings V·h; per layer q (h·q_dim), k and v (h·kv_dim), o (q_dim·h), gate and up
    (h·I), down (I·h), their biases, two RMSNorm weights (h); the final norm (h); the output head
    h·V unless tied to the embeddings. Adapters, per wrapped projection with (in, out) features:
    LoRA/rsLoRA ``lora_A`` r·in and ``lora_B`` out·r; DoRA adds the magnitude vector (out);
    AdaLoRA starts at ``adalora_init_r``: A init_r·in, B out·init_r, E init_r (and a frozen
    ``ranknum``). Only adapter parameters train, or every base parameter with ``full``.
    """
    h, v, layers = shape.hidden_size, shape.vocab_size, shape.num_layers
    full = spec.method == "full"
    out: list[ParamSpec] = [ParamSpec("embed_tokens.weight", v * h, 1, full, False, 2, "embed_tokens")]
    for name, (fan_in, fan_out) in shape.linear_shapes().items():
        out.append(ParamSpec(f"{name}.weight", fan_in * fan_out, layers, full, False, 2, f"layers.{name}"))
        has_bias = shape.qkv_bias if name in ("q_proj", "k_proj", "v_proj") else shape.o_bias if name == "o_proj" else shape.mlp_bias
        if has_bias:
            out.append(ParamSpec(f"{name}.bias", fan_out, layers, full, False, 1, f"layers.{name}"))
    out.append(ParamSpec("input_layernorm.weight", h, layers, full, False, 1, "layers.input_layernorm"))
    out.append(ParamSpec("post_attention_layernorm.weight", h, layers, full, False, 1, "layers.post_attention_layernorm"))
    out.append(ParamSpec("norm.weight", h, 1, full, False, 1, "norm"))
    if not shape.tie_word_embeddings:
        out.append(ParamSpec("lm_head.weight", h * v, 1, full, False, 2, "lm_head"))

    targets, _ = target_projections(spec)
    shapes = {**shape.linear_shapes(), "lm_head": (h, v)}
    for name in targets:
        fan_in, fan_out = shapes[name]
        count = 1 if name == "lm_head" else layers
        module = name if name == "lm_head" else f"layers.{name}"
        if spec.method == "adalora":
            r = spec.adalora_init_r
            out += [ParamSpec(f"{name}.lora_A", r * fan_in, count, True, True, 2, module),
                    ParamSpec(f"{name}.lora_B", fan_out * r, count, True, True, 2, module),
                    ParamSpec(f"{name}.lora_E", r, count, True, True, 2, module),
                    ParamSpec(f"{name}.ranknum", 1, count, False, True, 1, module)]
            continue
        out += [ParamSpec(f"{name}.lora_A", spec.r * fan_in, count, True, True, 2, module),
                ParamSpec(f"{name}.lora_B", fan_out * spec.r, count, True, True, 2, module)]
        if spec.method == "dora":
            out.append(ParamSpec(f"{name}.lora_magnitude_vector", fan_out, count, True, True, 1, module))
    return out


def trainable_params(shape: ModelShape, spec: AdapterSpec) -> int:
    """Trainable parameters: Σ over wrapped projections of r·(in + out) (+ out for DoRA;
    AdaLoRA: init_r·(in + out + 1)) × layers, or every parameter for full fine-tuning."""
    return sum(p.total for p in parameter_inventory(shape, spec) if p.trainable)


# --- the data: the largest micro-batch the workers will see ------------------------------------


@dataclass(frozen=True)
class MicroBatch:
    """The size of one micro-batch as the model gets it: ``rows`` sequences padded to ``seq_len``."""

    rows: int
    seq_len: int
    tokens: int
    """Tokens of the padded tensors, rows × seq_len (padding included: every layer runs on it)."""


def worst_micro_batch(lengths_by_rank: Sequence[Sequence[int]], *, micro_batch_size: int, max_seq_length: int,
                      packing: bool, seed: int = 0, num_micro_batches: int | None = None,
                      shuffled: bool = True) -> MicroBatch | None:
    """The largest micro-batch any rank will run, from the token length of every row of each
    rank's shard (None when every shard is empty). Micro-batches are planned by
    :func:`zerolab.batches.plan_micro_batches`, exactly as the workers plan them, and padded to their
    longest sequence (``MicroBatches.collate``).

    ``tokens`` is the most tokens (rows × padded width) of any micro-batch and ``seq_len`` the
    widest micro-batch; they can come from different micro-batches, so the pair bounds both the
    per-token and the per-token × length terms of the estimate.

    - ``shuffled`` (training) with ``num_micro_batches``: each rank's epochs are planned from
      ``seed`` (``zerolab.batches.epoch_order``) for the ``num_micro_batches`` micro-batches the run
      takes, the stream its workers will run. A short run need not meet the longest row at all (3 steps
      of one row each over a shard where one row in ten is long: most such runs see none).
    - ``shuffled`` without packing and without ``num_micro_batches``: a run of unknown length, bounded
      by min(micro_batch_size, rows) × the longest row (whatever the order, no padded micro-batch
      is larger, and over enough epochs one reaches it).
    - ``shuffled`` with packing and without ``num_micro_batches``: one epoch planned.
    - not ``shuffled`` (evaluation: one pass in file order): the micro-batches of that pass.
    """
    from zerolab.batches import epoch_order, plan_micro_batches

    best: MicroBatch | None = None
    widest = 0
    for lengths in lengths_by_rank:
        lengths = [int(n) for n in lengths]
        if not lengths:
            continue
        bound = MicroBatch(min(micro_batch_size, len(lengths)), max(lengths), 0)
        if shuffled and not packing and num_micro_batches is None:
            candidates = [bound]
        else:
            candidates = []
            epoch, planned = 0, 0
            while True:
                order = epoch_order(len(lengths), seed, epoch) if shuffled else list(range(len(lengths)))
                plan = plan_micro_batches(lengths, order, micro_batch_size=micro_batch_size, max_seq_length=max_seq_length,
                                          packing=packing)
                if shuffled and num_micro_batches is not None:
                    plan = plan[: num_micro_batches - planned]
                batches = [MicroBatch(len(b), max(sum(lengths[i] for i in seq) for seq in b), 0) for b in plan]
                candidates += batches
                planned += len(plan)
                epoch += 1
                # Padded, no micro-batch exceeds the bound: once one reaches it, later epochs add nothing.
                reached = not packing and bound in batches
                if not shuffled or num_micro_batches is None or planned >= num_micro_batches or not plan or reached:
                    break
        for c in candidates:
            widest = max(widest, c.seq_len)
            if best is None or c.rows * c.seq_len > best.tokens:
                best = MicroBatch(c.rows, c.seq_len, c.rows * c.seq_len)
    return None if best is None else MicroBatch(best.rows, widest, best.tokens)


@dataclass(frozen=True)
class BatchShape:
    """What the estimate takes from the data: the largest micro-batch (training or evaluation) and
    the largest shard a worker holds in host memory."""

    micro_batch: MicroBatch
    shard_rows: int
    """Rows of one worker's train and eval shards together (the largest over ranks)."""
    shard_tokens: int
    """Their tokens (unpadded: a worker keeps its rows as they are)."""
    from_data: bool
    """True when measured on the job's shards, False for the worst case by config."""

    @classmethod
    def from_config(cls, cfg: SFTConfig) -> BatchShape:
        """The worst case the config allows: every micro-batch ``micro_batch_size`` × ``max_seq_length``,
        every row ``max_seq_length`` tokens, ⌈rows / N⌉ rows of each split per worker. Raises
        MemoryEstimateError for ``max_seq_length: auto``, which only the data decides."""
        s, n = cfg.data.max_seq_length, cfg.world_size()
        if s == "auto":
            raise MemoryEstimateError("data.max_seq_length: auto is the length of the data's longest row, so the estimate needs "
                                      "the data; estimate on it (jobs/estimate.py tokenizes it) or set a number of tokens")
        rows = math.ceil(cfg.data.num_train_rows / n) + math.ceil(cfg.data.num_eval_rows / n)
        return cls(MicroBatch(cfg.train.micro_batch_size, s, cfg.train.micro_batch_size * s), rows, rows * s, False)

    def describe(self) -> str:
        b = self.micro_batch
        if not self.from_data:
            return f"micro-batch {b.rows} × {b.seq_len} tokens (the worst case by config)"
        return f"largest micro-batch of the data {b.tokens:,} tokens ({b.rows} rows, padded to ≤ {b.seq_len})"


class ShardLengths:
    """The token length of every row of each rank's shards, as the workers get them: ``train[r]``
    (``zerolab.data.shard_rows``, equal shards) and ``eval[r]`` (empty without an eval split). Valid for the
    world size it was split for; :meth:`batch_shape` is cached per batching setting."""

    def __init__(self, train: Sequence[Sequence[int]], eval: Sequence[Sequence[int]] = ()) -> None:
        self.train = [list(map(int, r)) for r in train]
        self.eval = [list(map(int, r)) for r in eval]
        self._cache: dict[tuple[Any, ...], BatchShape] = {}

    @property
    def world_size(self) -> int:
        return len(self.train)

    @property
    def longest_row(self) -> int:
        """Tokens of the longest row of any shard."""
        return max((n for shards in (self.train, self.eval) for shard in shards for n in shard), default=0)

    def batch_shape(self, cfg: SFTConfig) -> BatchShape:
        """The largest micro-batch of ``cfg``'s training run over these shards (its epochs are
        planned for the micro-batches the run takes, as ``zerolab.train`` counts its steps) and of
        its evaluation pass, and the largest shard."""
        t, d = cfg.train, cfg.data
        key = (t.micro_batch_size, d.max_seq_length, d.packing, t.seed, t.max_steps, t.num_epochs, t.grad_accum_steps)
        if key not in self._cache:
            # zerolab.train._total_steps: max_steps, or epochs × the smallest rank's steps per epoch.
            if t.max_steps:
                steps = t.max_steps
            else:
                per_epoch = min(len(_epoch0_plan(r, t.micro_batch_size, d.max_seq_length, t.seed)) if d.packing
                                else math.ceil(len(r) / t.micro_batch_size) for r in self.train)
                steps = max(1, t.num_epochs * (per_epoch // t.grad_accum_steps))
            consumed = steps * t.grad_accum_steps
            train = worst_micro_batch(self.train, micro_batch_size=t.micro_batch_size, max_seq_length=d.max_seq_length,
                                      packing=d.packing, seed=t.seed, num_micro_batches=consumed)
            evals = worst_micro_batch(self.eval, micro_batch_size=t.micro_batch_size, max_seq_length=d.max_seq_length,
                                      packing=False, shuffled=False)
            assert train is not None, "the train shards hold no rows"
            # Evaluation runs without gradients, so its micro-batch counts as a training one (an upper bound).
            largest = train if evals is None or train.tokens >= evals.tokens else evals
            micro = MicroBatch(largest.rows, max(train.seq_len, evals.seq_len if evals else 0), largest.tokens)
            ranks = range(self.world_size)
            shard_rows = max(len(self.train[r]) + (len(self.eval[r]) if r < len(self.eval) else 0) for r in ranks)
            shard_tokens = max(sum(self.train[r]) + (sum(self.eval[r]) if r < len(self.eval) else 0) for r in ranks)
            self._cache[key] = BatchShape(micro, shard_rows, shard_tokens, True)
        return self._cache[key]


def _epoch0_plan(lengths: Sequence[int], micro_batch_size: int, max_seq_length: int, seed: int) -> list[Any]:
    """Epoch 0's packed micro-batches of one shard (how ``MicroBatches.batches_per_epoch`` counts them)."""
    from zerolab.batches import epoch_order, plan_micro_batches

    return plan_micro_batches(lengths, epoch_order(len(lengths), seed, 0), micro_batch_size=micro_batch_size,
                              max_seq_length=max_seq_length, packing=True)


# --- limits of the machine --------------------------------------------------------------------


@dataclass(frozen=True)
class Limits:
    """Memory of the machine a job runs on. ``None`` means unknown (that check is skipped)."""

    gpu_mem_bytes: int | None = None
    """Memory of each GPU (the smallest, if they differ)."""
    gpus_per_node: int | None = None
    host_mem_bytes: int | None = None
    """Host RAM of each node (the cgroup limit where one applies)."""
    num_nodes: int = 1
    source: str = "given"
    """Where the figures come from (shown in reports)."""

    @classmethod
    def detect(cls) -> Limits:
        """This machine: GPUs from torch.cuda (none without CUDA), RAM from /proc/meminfo or
        psutil, capped by a cgroup memory limit."""
        gpu_mem = gpus = None
        try:
            import torch

            if torch.cuda.is_available():
                gpus = torch.cuda.device_count()
                gpu_mem = min(torch.cuda.get_device_properties(i).total_memory for i in range(gpus))
        except ImportError:
            pass
        return cls(gpu_mem_bytes=gpu_mem, gpus_per_node=gpus, host_mem_bytes=_host_memory_bytes(), source="detected on this machine")

    @classmethod
    def detect_with_nvml(cls) -> Limits:
        """This node, seen by NVML: every GPU whatever CUDA_VISIBLE_DEVICES says (Ray hides GPUs from
        tasks that reserve none); :meth:`detect` where NVML is missing."""
        try:
            import pynvml
        except ImportError:
            return cls.detect()
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError:  # no NVIDIA driver here: a machine without NVIDIA GPUs
            return cls.detect()
        try:
            gpus = pynvml.nvmlDeviceGetCount()
            mem = [pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i)).total for i in range(gpus)]
        finally:
            pynvml.nvmlShutdown()
        return cls(gpu_mem_bytes=min(mem) if mem else None, gpus_per_node=gpus or None, host_mem_bytes=_host_memory_bytes(),
                   source="detected on this node")

    def describe(self) -> str:
        gpu = f"{self.gpus_per_node} × {_gib(self.gpu_mem_bytes)} GPU" if self.gpu_mem_bytes and self.gpus_per_node else (
            f"GPUs of {_gib(self.gpu_mem_bytes)}" if self.gpu_mem_bytes else "no GPU known")
        host = f"{_gib(self.host_mem_bytes)} host RAM" if self.host_mem_bytes else "host RAM unknown"
        nodes = f" per node, {self.num_nodes} nodes" if self.num_nodes > 1 else ""
        return f"{gpu}, {host}{nodes} ({self.source})"


def _host_memory_bytes() -> int | None:
    total = None
    try:
        import psutil

        total = int(psutil.virtual_memory().total)
    except ImportError:
        meminfo = Path("/proc/meminfo")
        if meminfo.is_file():
            match = re.search(r"MemTotal:\s+(\d+) kB", meminfo.read_text())
            total = int(match.group(1)) * KIB if match else None
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and (total is None or int(text) < total):
            total = int(text)
    return total


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)(B?)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from ``24GiB``, ``80GB``, ``500MiB``, ``64G`` (a bare K/M/G/T is binary) or a plain
    byte count. Raises ValueError with the accepted forms."""
    match = _SIZE.match(str(text))
    if not match or (match.group(3) and not match.group(2)):
        raise ValueError(f"{text!r} is not a size; write e.g. 24GiB, 80GB, 500MiB or 64G")
    number, prefix, binary, unit = match.groups()
    power = "KMGT".find(prefix.upper()) + 1 if prefix else 0
    base = 1000 if (unit and not binary) else 1024
    return int(float(number) * base**power)


# --- options, estimates, verdicts -------------------------------------------------------------


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
        cal = self.calibration
        if self.option.stage < 3:
            return int(self.device_peak * cal.reserved_factor)
        return int(self.device_peak * cal.reserved_factor_zero3) + (cal.reserved_param_offload_bytes if self.option.offload == "all" else 0)

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
                reasons.append(f"GPU: {_gib(self.device_total)} of {_gib(limits.gpu_mem_bytes)} per GPU"
                               f"{'' if fits_gpu else ' — too much'}")
            else:
                reasons.append("GPU: not checked (no GPU memory known: give --gpu-mem or run where the GPUs are)")
        n = self.workers_per_node(limits)
        if limits.host_mem_bytes:
            need = self.host_total(n)
            host_fraction = need / limits.host_mem_bytes
            fits_host = need <= limits.host_mem_bytes
            ok &= fits_host
            reasons.append(f"host: {_gib(need)} of {_gib(limits.host_mem_bytes)} per node ({n} worker{'s' * (n > 1)})"
                           f"{'' if fits_host else ' — too much'}")
        else:
            reasons.append("host: not checked (host RAM unknown)")
        return Fit(ok, tuple(reasons), gpu_fraction, host_fraction)

    def summary(self, limits: Limits | None = None) -> str:
        n = self.workers_per_node(limits)
        gpu = (f"{_gib(self.device_total)} per GPU (peak allocated {_gib(self.device_peak)}, {self.device_peak_phase})"
               if self.use_gpu else f"{_gib(self.device_peak)} of tensors per CPU worker")
        return f"{self.option.label}: {gpu}, host {_gib(self.host_total(n))} per node"


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


# --- the estimate -----------------------------------------------------------------------------


@dataclass(frozen=True)
class _ZeroKnobs:
    """The DeepSpeed JSON values memory depends on, with DeepSpeed's defaults where absent."""

    reduce_bucket_size: int
    overlap_comm: bool
    contiguous_gradients: bool
    prefetch_bucket_size: int
    persistence_threshold: int
    max_reuse_distance: int
    max_live_parameters: int
    pin_memory: bool
    memory_efficient_linear: bool

    @classmethod
    def resolve(cls, cfg: SFTConfig, hidden_size: int) -> _ZeroKnobs:
        from zerolab import ds_config

        zero = ds_config.resolve(cfg, hidden_size).get("zero_optimization", {})
        stage3 = cfg.deepspeed.stage == 3
        offload = [zero.get(k) or {} for k in ("offload_optimizer", "offload_param")]
        return cls(
            reduce_bucket_size=int(zero.get("reduce_bucket_size", 5e8)),
            overlap_comm=bool(zero.get("overlap_comm", stage3)),
            contiguous_gradients=bool(zero.get("contiguous_gradients", True)),
            prefetch_bucket_size=int(zero.get("stage3_prefetch_bucket_size", 5e7)),
            persistence_threshold=int(zero.get("stage3_param_persistence_threshold", 1e5)),
            max_reuse_distance=int(zero.get("stage3_max_reuse_distance", 1e9)),
            max_live_parameters=int(zero.get("stage3_max_live_parameters", 1e9)),
            pin_memory=any(bool(o.get("pin_memory", False)) for o in offload if o.get("device", "none") != "none"),
            memory_efficient_linear=stage3 and bool(zero.get("memory_efficient_linear", True)),
        )


KNOWN_CONFIGS: dict[str, dict[str, Any]] = {
    "Qwen/Qwen2.5-0.5B": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                              num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "Qwen/Qwen2.5-1.5B": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                              num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "Qwen/Qwen2.5-3B": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                            num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "Qwen/Qwen2.5-7B": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                            num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "Qwen/Qwen2.5-14B": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40,
                             num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
    "Qwen/Qwen2.5-32B": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                             num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
    "Qwen/Qwen2.5-72B": dict(hidden_size=8192, intermediate_size=29568, num_hidden_layers=80, num_attention_heads=64,
                             num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
}
"""Shapes of the Qwen2.5 models the shipped job configs use (from their config.json; the
-Instruct variants share them), so that estimates work offline. Keys: hub ids without -Instruct."""


def load_model_config(cfg: SFTConfig) -> Any:
    """The Hugging Face config of ``cfg.model``: a local folder, ``builtin:tiny-qwen2`` (built on
    first use), a hub id found in the local Hugging Face cache, a hub id in :data:`KNOWN_CONFIGS`
    (a dict, no network), or else the hub. No weights are read. Raises ModelLoadError."""
    from transformers import AutoConfig

    from zerolab.models import LOAD_ERRORS, ModelLoadError, _load_failure, resolve_model_path

    path = resolve_model_path(cfg.model.name_or_path)
    kwargs = dict(revision=cfg.model.revision, trust_remote_code=cfg.model.trust_remote_code)
    if not Path(path).expanduser().exists():
        try:
            return AutoConfig.from_pretrained(path, local_files_only=True, **kwargs)
        except LOAD_ERRORS:
            known = KNOWN_CONFIGS.get(path.removesuffix("-Instruct"))
            if known is not None:
                return {"model_type": "qwen2", "dtype": "bfloat16", **known}
    try:
        return AutoConfig.from_pretrained(path, **kwargs)
    except LOAD_ERRORS as exc:
        raise ModelLoadError(_load_failure(cfg.model.name_or_path, "model config", exc)) from exc


def without_ray(calibration: Calibration = DEFAULT_CALIBRATION) -> Calibration:
    """``calibration`` for a job that trains in its own process on a machine where no Ray runs
    (``zerolab.cluster.needs_ray``): the node holds that one process, which the worker figures
    cover (measured on CPU: within ±1.2% of its RSS), and no Ray services."""
    return dataclasses.replace(calibration, host_ray_node_bytes=0)


def estimate(cfg: SFTConfig, model_config: Any, *, calibration: Calibration = DEFAULT_CALIBRATION,
             data: ShardLengths | None = None) -> Estimate:
    """Predict the memory of ``cfg`` on the model described by ``model_config`` (a transformers
    config, a dict of its fields, or a :class:`ModelShape`).

    With ``data`` (the token lengths of the job's shards, for ``cfg``'s world size) every term
    that depends on tokens or sequence length takes the largest micro-batch the workers will
    really run (:meth:`ShardLengths.batch_shape`) and the shards' real tokens; without it, or
    when ``cfg`` has another world size than ``data`` was split for, the worst case by config:
    ``micro_batch_size`` × ``data.max_seq_length`` tokens (:meth:`BatchShape.from_config`).
    ``data.max_seq_length: auto`` is resolved from ``data`` (without it: MemoryEstimateError).
    Raises ConfigError when the DeepSpeed JSON does not resolve and MemoryEstimateError for
    unsupported models.
    """
    shape = model_config if isinstance(model_config, ModelShape) else ModelShape.from_config(model_config)
    if cfg.data.max_seq_length == "auto" and data is not None and data.longest_row:
        # As zerolab.data.resolve_max_seq_length does on the driver (jobs resolve it there: the
        # shards here miss the rows that equal train shards drop).
        from zerolab.batches import auto_max_seq_length

        length = auto_max_seq_length(data.longest_row, _max_positions(model_config))
        cfg = cfg.replace(data=dataclasses.replace(cfg.data, max_seq_length=length))
    knobs = _ZeroKnobs.resolve(cfg, shape.hidden_size)
    option = Option.of(cfg)
    inventory = parameter_inventory(shape, cfg.adapter)
    _, unknown = target_projections(cfg.adapter)
    notes = []
    if unknown:
        notes.append(f"adapter.target_modules {unknown} are not projections this estimator knows; they were left out")
    if shape.model_type not in ("qwen2", "llama", "mistral"):
        notes.append(f"model_type {shape.model_type!r} estimated as a Llama/Qwen2-style decoder")
    batch = data.batch_shape(cfg) if data is not None and data.world_size == cfg.world_size() else BatchShape.from_config(cfg)
    return _Estimator(cfg, shape, inventory, knobs, option, calibration, tuple(notes), batch).run()


class _Estimator:
    """The formulas, one method per component. Notation: N world size, P all parameters, T
    trainable parameters, e bytes per element of the training precision, B×S tokens per
    micro-batch (B rows padded to S: ``batch``), h hidden, I intermediate, V vocabulary, L layers."""

    def __init__(self, cfg: SFTConfig, shape: ModelShape, inventory: list[ParamSpec], knobs: _ZeroKnobs, option: Option,
                 calibration: Calibration, notes: tuple[str, ...], batch: BatchShape | None = None) -> None:
        self.cfg, self.shape, self.inv, self.knobs, self.option, self.cal = cfg, shape, inventory, knobs, option, calibration
        self.notes = list(notes)
        self.n = cfg.world_size()
        self.gpu = cfg.scaling.use_gpu
        self.stage = option.stage
        self.offload_opt = option.offload != "none"
        self.offload_param = option.offload == "all"
        self.e = 4 if cfg.precision() == "fp32" else 2
        self.peft = cfg.adapter.is_peft()
        self.batch = batch or BatchShape.from_config(cfg)
        self.tokens = self.batch.micro_batch.tokens
        self.seq_len = self.batch.micro_batch.seq_len
        # varlen attention runs on GPUs only; elsewhere the model loads with sdpa (zerolab.kernels).
        self.attn = "sdpa" if cfg.model.attn_implementation == "varlen" and not self.gpu else cfg.model.attn_implementation
        from zerolab.kernels import fp8_eligible, use_fused_loss, use_liger

        head_trains = not self.peft or "lm_head" in target_projections(cfg.adapter)[0]
        self.liger = use_liger(cfg.model.kernels, use_gpu=self.gpu)
        self.fused_loss = use_fused_loss(cfg.model.kernels, use_gpu=self.gpu, head_trains=head_trains)
        # The projections that keep e4m3 copies (zerolab.kernels.fp8_layers).
        self.fp8_shapes = [(i, o) for i, o in shape.linear_shapes().values() if fp8_eligible(i, o, cfg.model.fp8_min_features)] \
            if cfg.model.fp8 and self.gpu and self.peft and self.stage < 3 else []
        self.P = sum(p.total for p in inventory)
        self.T = sum(p.total for p in inventory if p.trainable)

    # -- helpers
    def _part(self, numel: int) -> int:
        """Elements of ``numel`` held by one rank under ZeRO partitioning (padded to a multiple of N)."""
        return math.ceil(numel / self.n)

    def _persistent(self, p: ParamSpec) -> bool:
        """ZeRO-3 keeps parameters below stage3_param_persistence_threshold whole on every rank."""
        return p.numel < self.knobs.persistence_threshold

    def _largest_trainable(self) -> int:
        return max((p.numel for p in self.inv if p.trainable), default=0)

    # -- device components (bytes per worker)
    def weights(self) -> int:
        """ZeRO 0-2: every parameter on every rank, P·e. ZeRO-3: persistent parameters whole, the
        rest ⌈numel/N⌉ each; with parameter offload only the persistent ones stay."""
        if self.stage < 3:
            return self.P * self.e
        total = 0
        for p in self.inv:
            if self._persistent(p):
                total += p.total * self.e
            elif not self.offload_param:
                total += self._part(p.numel) * p.count * self.e
        return total

    def fp8_weights(self) -> int:
        """``model.fp8``: the e4m3 copy of every FP8 projection and its transpose, two bytes per
        weight, beside the bf16 one."""
        return 2 * self.shape.num_layers * sum(i * o for i, o in self.fp8_shapes)

    def fp8_transient(self) -> int:
        """``model.fp8``, during a product: the input's (or gradient's) e4m3 copy, B·S·max(in, out) bytes."""
        return self.tokens * max((max(i, o) for i, o in self.fp8_shapes), default=0)

    def gathered(self) -> int:
        """ZeRO-3 at the start of the backward pass: parameters gathered whole and still held.

        DeepSpeed releases a module's parameters after use unless they are used again within the
        next ``stage3_max_reuse_distance`` elements of the recorded module trace (forward, then
        backward, re-running each layer's forward first under gradient checkpointing). Simulating
        that rule on the trace gives what is held when the loss is computed, plus what is prefetched
        for what comes next (``_prefetched``). With N = 1 and no parameter offload, gathering is a
        view of the partition (0 bytes).
        """
        if not self._gathers():
            return 0
        # Module -> its non-persistent parameters (name, numel); a tied head uses the embedding's.
        modules: dict[str, list[tuple[str, int]]] = {}
        for p in self.inv:
            if not self._persistent(p):
                key = p.module.removeprefix("layers.")
                modules.setdefault(key, []).append((p.name, p.numel))
        if self.shape.tie_word_embeddings:
            modules["lm_head"] = modules.get("lm_head", []) + [m for m in modules.get("embed_tokens", []) if m[0] == "embed_tokens.weight"]
        layer_mods = [m for m in PROJECTIONS if m in modules]
        Step = tuple[str, int | None]
        forward: list[Step] = [("embed_tokens", None)]
        forward += [(m, i) for i in range(self.shape.num_layers) for m in layer_mods]
        forward.append(("lm_head", None))
        if self.cfg.model.gradient_checkpointing:
            backward: list[Step] = [("lm_head", None)]
            for i in reversed(range(self.shape.num_layers)):
                backward += [(m, i) for m in layer_mods] + [(m, i) for m in reversed(layer_mods)]
            backward.append(("embed_tokens", None))
        else:
            backward = list(reversed(forward))
        trace = forward + backward

        def params_of(step: Step) -> list[tuple[tuple[str, int | None], int]]:
            name, layer = step
            return [((pname, layer), numel) for pname, numel in modules.get(name, [])]

        held: dict[tuple[str, int | None], int] = {}
        peak_step = len(forward) - 1  # the head's forward: the loss follows and the backward starts
        for k in range(peak_step + 1):
            for pid, numel in params_of(trace[k]):
                held[pid] = numel * self.e
            if k == peak_step:
                break
            candidates = {pid for pid, _ in params_of(trace[k])}
            traversed = 0
            for later in trace[k + 1:]:
                if traversed >= self.knobs.max_reuse_distance or not candidates:
                    break
                for pid, numel in params_of(later):
                    candidates.discard(pid)
                    traversed += numel
            for pid in candidates:
                held.pop(pid, None)
        return sum(held.values()) + self._prefetched()

    def _gathers(self) -> bool:
        """Whether ZeRO-3 gathers parameters into new buffers (not with N = 1 and no parameter offload)."""
        return self.stage == 3 and (self.n > 1 or self.offload_param)

    def _layer_gathered(self) -> int:
        """One decoder layer's non-persistent parameters, whole: e·Σ numel."""
        return sum(p.numel * self.e for p in self.inv if p.module.startswith("layers.") and not self._persistent(p))

    def _prefetched(self) -> int:
        """Parameters DeepSpeed fetches ahead of their use: one prefetch bucket (``stage3_prefetch_bucket_size``·e)."""
        return self.knobs.prefetch_bucket_size * self.e

    def gathered_at_start(self) -> int:
        """ZeRO-3 at the first decoder layer of the forward pass: the embeddings whole, the first
        layer and one prefetch bucket (the next layer, at zerolab's bucket size); with Liger's fused
        loss the output head's weight as well (the loss reads it outside the head module, so
        DeepSpeed keeps it gathered into the next step); with parameter offload over N > 1 ranks,
        the partition copied to the GPU for a gather in flight, ⌈numel/N⌉·e of the largest
        parameter. Measured with ``bench/memory_trace.py`` (7B LoRA, parameter offload, 2 GPUs:
        the step's peak is here; ``docs/benchmark/results/h200x2-4/memory_trace.txt``)."""
        if not self._gathers():
            return 0
        big = {p.module: p.numel for p in self.inv if p.module in ("embed_tokens", "lm_head") and not p.adapter}
        held = big.get("embed_tokens", 0) + (big.get("lm_head", 0) if self.fused_loss else 0)
        staging = self._part(max(p.numel for p in self.inv if not self._persistent(p))) if self.offload_param and self.n > 1 else 0
        return self.e * (held + staging) + self._layer_gathered() + self._prefetched()

    def master_weights(self) -> int:
        """fp32 copies of the trainable parameters: ZeRO-0 keeps 4·T when training in bf16/fp16 (none
        in fp32); ZeRO 1-3 keep this rank's partition, 4·⌈T/N⌉, in any precision. Offload: on host."""
        if self.stage == 0:
            return 4 * self.T if self.e != 4 else 0
        return 0 if self.offload_opt else 4 * self._part(self.T)

    def optimizer_states(self) -> int:
        """AdamW's exp_avg and exp_avg_sq in fp32: 8·T (ZeRO-0) or 8·⌈T/N⌉; on host under offload.
        AdaLoRA adds its rank allocator's three fp32 importance tensors per adapter weight (12·T)."""
        states = 0 if self.offload_opt else 8 * (self.T if self.stage == 0 else self._part(self.T))
        if self.cfg.adapter.method == "adalora":
            states += 12 * self.T
        return states

    def gradients(self) -> int:
        """Gradients alive after the backward pass (DeepSpeed 0.19, ``stage_1_and_2.py``).

        ZeRO-0: every trainable parameter's gradient, T·e. ZeRO-2 (``partition_gradients``): each
        gradient is reduced in the backward hooks as it is produced; this rank's partition is kept,
        ⌈T/N⌉·e (``copy_grads_in_partition`` into ``grads_in_partition``), or streamed to the host under
        optimizer offload (0). ZeRO-1 reduces in the hooks only at the accumulation boundary and only
        with ``overlap_comm`` (``process_gradients``, ``reduce_ready_partitions_and_remove_grads``) and
        with ``contiguous_gradients`` (which offload forces on) points the other ranks' gradients into
        the reduce buckets: then as ZeRO-2; otherwise — micro-batches before the boundary under gradient
        accumulation, or ``overlap_comm`` off — every gradient stays whole on the GPU, T·e, with or
        without offload. ZeRO-3: the flat partition buffer, ⌈T/N⌉·e (0 under offload)."""
        if self.stage == 0:
            return self.T * self.e
        if self.stage == 1:
            k = self.knobs
            reduced_in_hooks = k.overlap_comm and self.cfg.train.grad_accum_steps == 1
            if not reduced_in_hooks or not (k.contiguous_gradients or self.offload_opt):
                return self.T * self.e
        if self.offload_opt:
            return 0
        return self._part(self.T) * self.e

    def offload_gradient_buffer(self) -> int:
        """ZeRO 1-2 with optimizer offload: the GPU buffer through which each gradient goes to the host,
        ``temp_grad_buffer_for_gpu_offload``, as large as the largest trainable parameter (e bytes
        each), allocated with the optimizer and held for the whole run."""
        return self._largest_trainable() * self.e if self.offload_opt and self.stage in (1, 2) else 0

    def deepspeed_buffers(self) -> int:
        """Reduction and staging buffers at the optimizer step. ZeRO-0, N > 1: the flattened bucket
        of the gradient all-reduce, min(T, 5e8)·e; in bf16/fp16 the fp32 gradient copies the step
        reads, 4·T. ZeRO 1-2: reduce buckets (two with overlap_comm) of reduce_bucket_size·e and the
        fp32 gradient partition of the step, 4·⌈T/N⌉. ZeRO-3: one reduce bucket and the fp32
        gradient partition, which the step makes from a flattened 16-bit copy of the gradients
        (``_prepare_fp32_grad_for_sub_group``: e·⌈T/N⌉ more while both exist; in fp32 the copy is the
        partition itself). Offload: the buckets only (the gradient staging buffer is held all along:
        :meth:`offload_gradient_buffer`)."""
        e, k = self.e, self.knobs
        if self.stage == 0:
            allreduce = min(self.T, 500_000_000) * e if self.n > 1 else 0
            return allreduce + (4 * self.T if e != 4 else 0)
        buckets = (2 if k.overlap_comm and self.stage < 3 else 1) * min(k.reduce_bucket_size, max(self.T, 1)) * e
        if self.offload_opt:
            return buckets
        flattened = e * self._part(self.T) if self.stage == 3 and e != 4 else 0
        return buckets + 4 * self._part(self.T) + flattened

    def activation_bytes_per_layer(self) -> int:
        """Bytes one decoder layer saves for backward, per token, without checkpointing.

        Each term is a tensor autograd keeps (checked against ``saved_tensors_hooks``):
        RMSNorm ×2: its fp32 input copy and rsqrt, 4h + 4, plus the normalised input when the norm
        weight trains (e·h). Attention: RoPE'd q (e·q_dim); k and v as SDPA gets them — repeated to
        q_dim when a mask is passed (padded or packed batches), else kv_dim; SDPA's output (e·q_dim,
        shared with o_proj's input) and fp32 log-sum-exp (4·heads); the mask SDPA converts per
        layer (e·S) — or, for eager attention, the fp32 probabilities and their cast to e
        ((4 + e)·heads·S) and a copy of the output for o_proj. MLP: gate output, SiLU
        output, up output (3·e·I). Inputs of trained base projections (full fine-tuning: the
        normed input once for q/k/v, once for gate/up, down's input e·I). Adapters per wrapped
        projection (in, out), in the model's dtype like the adapters themselves: with dropout its
        output and mask (e·in + mask·in; the mask is a byte on GPU, e bytes on CPU), without
        dropout the input itself (shared), lora_A's output e·r, DoRA's base and LoRA results
        (2·e·out), and AdaLoRA's scaled product before its division by the rank (e·out; measured
        with a census probe, ``git show 4aa9d6f:bench/activation_census.py``). With Liger's kernels (``zerolab.kernels``) each RMSNorm keeps its
        input in e and the fp32 rsqrt (e·h + 4, also when its weight trains) and SwiGLU keeps the
        gate and up outputs only (2·e·I). Under ZeRO-3 with DeepSpeed's ``memory_efficient_linear``
        (its default) every projection keeps its input, frozen or not: e·h for q/k/v and for
        gate/up, e·I for down, where nothing else keeps them.
        """
        s, e = self.shape, self.e
        h, inter, s_len = s.hidden_size, s.intermediate_size, self.seq_len
        full = not self.peft
        attn = self.attn
        targets, _ = target_projections(self.cfg.adapter)
        targets = [t for t in targets if t != "lm_head"]
        dropout = self.peft and self.cfg.adapter.dropout > 0
        mask_bytes = 1 if self.gpu else e
        # Flash kernels (flash_attention_2, varlen) take fewer K/V heads; so does SDPA without a mask
        # (varlen's unpacked batches), but transformers repeats K/V for SDPA with one.
        gqa_repeat = attn not in ("flash_attention_2", "varlen") and s.num_kv_heads != s.num_heads

        def input_kept(group: Sequence[str]) -> bool:
            if full or self.knobs.memory_efficient_linear:
                return True
            return not dropout and any(t in targets for t in group)

        total = 2 * self._norm_bytes(trains=full)
        kv = s.q_dim if gqa_repeat else s.kv_dim
        total += e * (s.q_dim + 2 * kv)
        if attn == "eager":
            # fp32 softmax probabilities and their cast to e; o_proj's input is a transposed copy.
            total += (4 + (e if e != 4 else 0)) * s.num_heads * s_len + e * s.q_dim * input_kept(("o_proj",))
        else:
            total += e * s.q_dim + 4 * s.num_heads  # the kernel's output (o_proj's input) and log-sum-exp
            total += e * s_len if attn == "sdpa" else 0
        total += (2 if self.liger else 3) * e * inter
        total += e * h * input_kept(("q_proj", "k_proj", "v_proj")) + e * h * input_kept(("gate_proj", "up_proj"))
        total += e * inter * input_kept(("down_proj",))
        rank = self.cfg.adapter.adalora_init_r if self.cfg.adapter.method == "adalora" else self.cfg.adapter.r
        for name in targets:
            fan_in, fan_out = s.linear_shapes()[name]
            if dropout:
                total += (e + mask_bytes) * fan_in
            total += e * rank
            if self.cfg.adapter.method == "dora":
                total += 2 * e * fan_out
            elif self.cfg.adapter.method == "adalora":
                total += e * fan_out  # its product ÷ the rank, a (1,) tensor: the division keeps the dividend
        return total

    def activations(self) -> int:
        """Activations saved for the backward pass of one micro-batch of B·S tokens. Without
        checkpointing: L × the per-layer bytes (less what the first layer of an adapter run skips).
        With checkpointing (non-reentrant, per decoder
        layer) each layer keeps only its input, L·e·h. Both add the final norm (as a layer's norm,
        when the head or the norm trains), RoPE cos/sin (2·e·head_dim), the attention mask (S bytes)
        and the ids and labels (16 bytes)."""
        s, e = self.shape, self.e
        head_trains = not self.peft or "lm_head" in target_projections(self.cfg.adapter)[0]
        other = self._norm_bytes(trains=head_trains) + 2 * e * s.head_dim
        other += self.seq_len + 16
        if self.cfg.model.gradient_checkpointing:
            layers = s.num_layers * e * s.hidden_size
        else:
            layers = s.num_layers * self.activation_bytes_per_layer() - self._first_layer_saving()
        return self.tokens * (layers + other)

    def _first_layer_saving(self) -> int:
        """With an adapter and no checkpointing, the first layer's input (the frozen embeddings)
        needs no gradient: its first norm saves nothing and its q/k/v adapters keep no dropout masks."""
        if not self.peft or self.cfg.model.gradient_checkpointing:
            return 0
        h = self.shape.hidden_size
        targets = target_projections(self.cfg.adapter)[0]
        masks = sum(t in targets for t in ("q_proj", "k_proj", "v_proj")) if self.cfg.adapter.dropout > 0 else 0
        return self._norm_bytes(trains=False) + masks * h * (1 if self.gpu else self.e)

    def _norm_bytes(self, *, trains: bool) -> int:
        """What one RMSNorm keeps per token: Hugging Face's keeps its fp32 input copy and rsqrt (4h + 4),
        plus the normalised input when the norm or what follows it trains (e·h); Liger's its input
        in e and the rsqrt (e·h + 4)."""
        h = self.shape.hidden_size
        if self.liger:
            return self.e * h + 4
        return 4 * h + 4 + (self.e * h if trains else 0)

    def recomputed_layer(self) -> int:
        """Under checkpointing the backward pass re-runs one layer's forward at a time: its full
        activations, B·S × the per-layer bytes, live on top of the saved inputs (0 otherwise)."""
        return self.tokens * self.activation_bytes_per_layer() if self.cfg.model.gradient_checkpointing else 0

    def logits_and_loss(self) -> int:
        """The loss region at the start of the backward pass, per micro-batch of B·S tokens: logits
        (e·V), their fp32 log-softmax saved by cross-entropy (4·V; the fp32 upcast of the logits is
        freed once it is computed), then in the backward the gradient of the log-probabilities and
        of the fp32 logits (4·V each): (e + 12)·V per token. When the head trains the backward then
        holds logits, their gradient and the head's weight gradient: 2·e·V per token + V·h·e.

        With Liger's fused linear + cross-entropy (``zerolab.kernels``) no logits are kept: the
        forward computes the gradient of the hidden states (e·h per token, kept for the backward)
        and the fp32 per-token loss (4), going through the tokens in chunks of
        2^⌈log2(B·S / ⌈V/h⌉)⌉ rows whose logits (e·V each) are computed in place, plus the matrix
        product's output of the chunk's input gradient."""
        v = self.shape.vocab_size
        if self.fused_loss:
            h = self.shape.hidden_size
            chunk = min(self.tokens, _pow2(math.ceil(self.tokens / math.ceil(v / h))))
            return self.tokens * (self.e * h + 4) + chunk * (self.e * v + self.e * h)
        loss = (self.e + 12) * v * self.tokens
        if not self.peft:
            loss = max(loss, 2 * self.e * v * self.tokens + v * self.shape.hidden_size * self.e)
        return loss

    def dora_transient(self) -> int:
        """DoRA's forward computes the weight norm of each wrapped projection from
        lora_B(lora_A(eye(in))): an in×in identity, the in×out LoRA weight and W + scale·ΔW, freed
        after the module but as large as (in² + 2·in·out)·e for the largest projection."""
        if self.cfg.adapter.method != "dora":
            return 0
        targets = [t for t in target_projections(self.cfg.adapter)[0] if t != "lm_head"]
        shapes = self.shape.linear_shapes()
        return max((self.e * (i * i + 2 * i * o) for i, o in (shapes[t] for t in targets)), default=0)

    def framework(self) -> int:
        return self.cal.framework_device_bytes if self.gpu else 0

    def device(self) -> tuple[dict[str, int], dict[str, int]]:
        """Components and phases. Persistent = weights + master + optimizer states + the offload
        gradient buffer + framework.
        Forward/backward = persistent + gathered + saved activations + max(loss region, recomputed
        layer + logits, DoRA transient) (+ gradients held across accumulation steps, and ZeRO-3's
        gradient partition buffer, allocated at init). Optimizer
        step = persistent + gradients + DeepSpeed buffers + the last logits (``out`` still holds
        them). ZeRO-0's gradient all-reduce = persistent + gradients + their flat bucket, min(T, 5e8)·e
        (any world size) + the last logits. Init (ZeRO 1-2 flatten the trainable parameters into a new buffer) = persistent
        without optimizer states + T·e. ZeRO-3 forward start = persistent + held gradients + the
        parameters gathered then (``gathered_at_start``) + the embeddings' output and the first
        layer's activations, B·S·(e·h + the per-layer bytes)."""
        # ``out.logits`` lives until the next forward (the fused loss returns none).
        logits = 0 if self.fused_loss else self.e * self.shape.vocab_size * self.tokens
        saved, recompute = self.activations(), self.recomputed_layer()
        c = {
            "weights": self.weights() + self.fp8_weights(),
            # The most gathered at once: at the start of the backward pass or of the forward pass.
            "gathered parameters": max(self.gathered(), self.gathered_at_start()),
            "gradients": self.gradients(),
            "master weights": self.master_weights(),
            "optimizer states": self.optimizer_states(),
            "activations": saved + recompute,
            "logits and loss": max(self.logits_and_loss(), self.dora_transient()),
            "deepspeed buffers": self.deepspeed_buffers(),
            "offload gradient buffer": self.offload_gradient_buffer(),
            "framework": self.framework(),
        }
        persistent = c["weights"] + c["master weights"] + c["optimizer states"] + c["offload gradient buffer"] + c["framework"]
        held_grads = c["gradients"] if self.stage == 3 or self.cfg.train.grad_accum_steps > 1 else 0
        # The loss region comes at the end of the forward pass; a recomputed layer (checkpointing) and
        # DoRA's weight-norm temporaries come while every saved activation is alive, but not with it.
        peak_activity = max(self.logits_and_loss(), recompute + logits + self.fp8_transient(), self.dora_transient())
        phases = {
            "init": persistent - c["optimizer states"] + (self.T * self.e if self.stage in (1, 2) else 0),
            "forward/backward": persistent + held_grads + self.gathered() + saved + peak_activity,
            "optimizer step": persistent + c["gradients"] + c["deepspeed buffers"] + logits,
        }
        if self.stage == 0:
            # After the backward DeepSpeed flattens the gradients into all-reduce buckets of up to
            # 5e8 elements, on one GPU as well (engine.allreduce_bucket); the step's buffers come later.
            phases["gradient all-reduce"] = persistent + c["gradients"] + min(self.T, 500_000_000) * self.e + logits
        if self._gathers():
            first_layer = self.tokens * (self.e * self.shape.hidden_size + self.activation_bytes_per_layer())
            phases["forward start"] = persistent + held_grads + self.gathered_at_start() + first_layer
        return c, phases

    # -- host components
    def _cpu_imports(self) -> int:
        """What a CPU worker's imports hold (:attr:`Calibration.host_imports_cpu_bytes`)."""
        if self.cal.host_imports_cpu_bytes is not None:
            return self.cal.host_imports_cpu_bytes
        return worker_imports_rss() or DEFAULT_IMPORTS_CPU_BYTES

    def host(self, device_peak: int) -> tuple[dict[str, int], dict[str, int], dict[str, int], dict[str, int]]:
        """Per worker: process baseline (on CPU: what its imports hold, measured here, plus the rest of
        the process, fitted); dataset shard (⌈rows/N⌉ × (16·S + row overhead)); model
        load (ZeRO 0-2 every rank reads the whole checkpoint, ZeRO-3 rank 0 alone: P × the file's
        bytes per element, plus P·e when converting dtype, × host_load_factor; on GPU with ZeRO 0-2,
        where tensors go to the GPU as they are read, P × the file's bytes × host_load_factor_gpu,
        or × host_load_factor when converting dtype; ZeRO-3 with parameter offload: + the pinned partitions, filled while
        the checkpoint is held); offloaded optimizer (ZeRO 1-2: fp32 master, fp32 gradient and
        bit16 parameter partitions pinned, 10·⌈T/N⌉, AdamW states 8·⌈T/N⌉ unpinned, a staging
        buffer of the largest parameter; ZeRO-3: fp32 master pinned, gradient partition e pinned,
        states, and the fp32 gradient of the step: 18·⌈T/N⌉); offloaded parameters (every
        partition pinned separately, plus the trainable flat buffer); pinned-memory rounding (torch
        rounds each pinned allocation up to a power of two); on CPU runs the device peak ×
        host_cpu_tensor_factor (host_cpu_tensor_factor_checkpointing with gradient checkpointing); the
        final save on rank 0 (full fine-tuning gathers the whole state dict: P·e)."""
        cal, e, n = self.cal, self.e, self.n
        dataset = 16 * self.batch.shard_tokens + self.batch.shard_rows * cal.host_row_bytes
        base = cal.host_process_gpu_bytes if self.gpu else cal.host_process_cpu_bytes + self._cpu_imports()
        # Loaded in the training precision; peft's adapters are created in fp32 before DeepSpeed casts them.
        weights_bytes = sum(p.total * (4 if p.adapter else e) for p in self.inv)
        base_params = sum(p.total for p in self.inv if not p.adapter)
        file_bytes = self.shape.weights_bytes_per_param or e
        # The checkpoint's pages as they are read, plus a converted private copy when dtypes differ.
        # Under ZeRO 0-2 on GPU (zerolab.models.load_model) tensors go to the GPU as they are read
        # and peft wraps the model there: no converted copy stays on the host (its files' pages all
        # do, until the load ends), and DoRA's weight-norm set-up reads no checkpoint pages there.
        if self.gpu and self.stage < 3:
            load = int(base_params * file_bytes * (cal.host_load_factor_gpu if file_bytes == e else cal.host_load_factor))
        else:
            load = int(base_params * (file_bytes + (e if file_bytes != e else 0)) * cal.host_load_factor)

        groups = [g for g in (sum(p.total for p in self.inv if p.trainable and (p.ndim >= 2) == big) for big in (True, False)) if g]
        opt_pinned: list[int] = []
        opt_unpinned = 0
        if self.offload_opt and self.stage < 3:
            for g in groups:
                part = self._part(g)
                opt_pinned += [4 * part, 4 * part, e * part]  # fp32 master, fp32 gradient, bit16 staging
                opt_unpinned += 8 * part  # DeepSpeedCPUAdam's exp_avg, exp_avg_sq
            opt_pinned.append(self._largest_trainable() * e)  # gradient staging buffer
            if self.cfg.train.grad_accum_steps > 1:  # per-parameter gradient accumulators
                opt_pinned += [p.numel * e for p in self.inv if p.trainable for _ in range(math.ceil(p.count / n))]
        elif self.offload_opt:
            for g in groups:
                opt_pinned.append(4 * self._part(g))  # fp32 master partition
                opt_unpinned += 12 * self._part(g)  # states and the fp32 gradient of the step
            opt_pinned.append(self.e * self._part(self.T))  # flat gradient partition buffer
        param_pinned: list[int] = []
        if self.offload_param:
            param_pinned = [self._part(p.numel) * self.e for p in self.inv if not self._persistent(p) for _ in range(p.count)]
            param_pinned += [self.e * self._part(g) for g in groups]
        pin = self.gpu and self.knobs.pin_memory
        rounding = sum(_pow2(x) - x for x in opt_pinned + param_pinned) if pin else 0
        retained = cal.host_cpu_tensor_factor_checkpointing if self.cfg.model.gradient_checkpointing else cal.host_cpu_tensor_factor
        cpu_tensors = 0 if self.gpu else int(device_peak * retained)
        save = weights_bytes if not self.peft else 4 * self.T
        worker = {
            "worker process": base,
            "dataset shard": dataset,
            "model loading": load,
            "offloaded optimizer": sum(opt_pinned) + opt_unpinned,
            "offloaded parameters": sum(param_pinned),
            "pinned-memory rounding": rounding,
            "tensors (CPU training)": cpu_tensors,
            "checkpoint save (rank 0)": save,
        }
        resident = worker["offloaded optimizer"] + worker["offloaded parameters"] + rounding + cpu_tensors
        # ZeRO-3 with parameter offload fills the pinned partitions while rank 0 still holds the
        # checkpoint it reads (measured: rank 0's peak is the sum of both).
        partitions = sum(param_pinned) + (sum(_pow2(x) - x for x in param_pinned) if pin else 0)
        # A GPU process that holds the whole checkpoint (ZeRO-3's rank 0, a dtype conversion) reads it
        # before its first steps bring in the rest of its baseline; with parameter offload it fills
        # pinned partitions while it reads, and its load peaks on the whole baseline (measured).
        whole = self.gpu and not self.offload_param and (self.stage == 3 or file_bytes != e)
        load_base = base - (cal.host_gpu_first_steps_bytes if whole else 0)
        rank0 = {
            "model load": load_base + dataset + load + partitions,
            "training": base + dataset + resident,
            "checkpoint save": base + dataset + resident + save,
        }
        # ZeRO-3: rank 0 alone reads the checkpoint into the partitions; ZeRO 0-2: every rank loads the model.
        other = {"model load": (load_base + load if self.stage < 3 else base) + dataset, "training": rank0["training"]}
        node = {"Ray services and driver": cal.host_ray_node_bytes} if cal.host_ray_node_bytes else {}
        return worker, rank0, other, node

    def run(self) -> Estimate:
        device, phases = self.device()
        outside = {}
        if self.gpu:
            outside["CUDA context"] = self.cal.cuda_context_bytes
            if self.n > 1:
                outside["NCCL"] = self.cal.nccl_bytes
        host_worker, host_phases, host_other, host_node = self.host(max(phases.values()))
        if self.stage == 3 and self.n == 1 and not self.offload_param:
            self.notes.append("ZeRO-3 on one GPU partitions nothing: it holds what ZeRO-0 holds and adds gathering overhead")
        return Estimate(
            option=self.option, shape=self.shape, world_size=self.n, use_gpu=self.gpu, precision=self.cfg.precision(),
            micro_batch_size=self.batch.micro_batch.rows, seq_len=self.seq_len,
            gradient_checkpointing=self.cfg.model.gradient_checkpointing, total_params=self.P - sum(
                p.total for p in self.inv if p.adapter and not p.trainable), trainable_params=self.T,
            device=device, device_phases=phases, device_outside_allocator=outside, host_worker=host_worker,
            host_worker_phases=host_phases, host_other_worker_phases=host_other, host_node=host_node, calibration=self.cal, notes=tuple(self.notes),
            batch=self.batch,
        )


def _max_positions(model_config: Any) -> int | None:
    get = model_config.get if isinstance(model_config, dict) else lambda k, d=None: getattr(model_config, k, d)
    value = get("max_position_embeddings", None)
    return value if isinstance(value, int) and value > 0 else None


def _dtype_bytes(dtype: Any) -> int | None:
    name = str(dtype).removeprefix("torch.") if dtype is not None else ""
    return {"bfloat16": 2, "float16": 2, "float32": 4}.get(name)


def _pow2(x: int) -> int:
    return 1 << (x - 1).bit_length() if x > 0 else 0


# --- planning ----------------------------------------------------------------------------------


def plan_options(cfg: SFTConfig, model_config: Any, limits: Limits | None = None, *,
                 options: Iterable[Option] = ALL_OPTIONS, calibration: Calibration = DEFAULT_CALIBRATION,
                 data: ShardLengths | None = None) -> list[PlanRow]:
    """Estimate ``cfg`` under each option (stage × offload), on ``data``'s shards when given (see
    :func:`estimate`); options the config's own validation rejects (e.g. AdaLoRA beyond ZeRO-0)
    come back with ``invalid`` set and no estimate."""
    limits = limits or Limits()
    base_problems = set(validate(cfg))
    options = list(options)
    if Option.of(cfg) not in options and options == list(ALL_OPTIONS):
        options.append(Option.of(cfg))  # the job's own option, e.g. ZeRO-3 offloading the optimizer alone
    rows = []
    for option in options:
        variant = option.apply(cfg)
        problems = [p for p in validate(variant) if p not in base_problems]
        if not problems:
            try:
                est = estimate(variant, model_config, calibration=calibration, data=data)
            except ConfigError as exc:  # e.g. no shipped DeepSpeed JSON offloads the optimizer alone under ZeRO-3
                problems = exc.problems
        if problems:
            rows.append(PlanRow(option, None, None, invalid=problems[0].split(";", 1)[0]))
            continue
        rows.append(PlanRow(option, est, est.fits(limits)))
    return rows


def recommend(cfg: SFTConfig, model_config: Any, limits: Limits | None = None, *,
              rows: list[PlanRow] | None = None, calibration: Calibration = DEFAULT_CALIBRATION,
              data: ShardLengths | None = None) -> Recommendation | None:
    """The fastest option that fits ``limits`` (ZeRO-2 when it fits; ZeRO-3 and offload only to
    fit), with the reason. When none fits, tries one worker per available GPU (if the job asks
    for more workers than there are GPUs), gradient checkpointing, then halving the micro-batch;
    returns None if even micro-batch 1 with checkpointing does not fit. ``data`` as in
    :func:`estimate` (a variant with fewer workers has other shards: it gets the worst case by config)."""
    limits = limits or Limits()
    rows = rows if rows is not None else plan_options(cfg, model_config, limits, calibration=calibration, data=data)
    best = _fastest_fitting(rows)
    if best is not None:
        return Recommendation(best.option, best.estimate, _reason(best, rows))  # type: ignore[arg-type]
    base, extra = cfg, ()
    gpus = (limits.gpus_per_node or 0) * limits.num_nodes
    if cfg.scaling.use_gpu and limits.gpus_per_node is not None and 0 < gpus < cfg.world_size():
        base = cfg.replace(scaling=dataclasses.replace(cfg.scaling, num_workers=gpus))
        extra = (f"scaling.num_workers={gpus}",)
    attempts: list[tuple[SFTConfig, tuple[str, ...]]] = [(base, extra)] if extra else []
    ckpt = base.replace(model=dataclasses.replace(base.model, gradient_checkpointing=True))
    if not cfg.model.gradient_checkpointing:
        attempts.append((ckpt, (*extra, "model.gradient_checkpointing=true")))
        extra = (*extra, "model.gradient_checkpointing=true")
    batch = cfg.train.micro_batch_size // 2
    while batch >= 1:
        attempts.append((ckpt.replace(train=dataclasses.replace(cfg.train, micro_batch_size=batch)),
                         (*extra, f"train.micro_batch_size={batch}")))
        batch //= 2
    for variant, changes in attempts:
        found = _fastest_fitting(plan_options(variant, model_config, limits, options=[r.option for r in rows],
                                              calibration=calibration, data=data))
        if found is not None:
            what = " and ".join(changes)
            reason = f"no option fits as configured; with {what} {found.option.label} fits ({_fit_figures(found)})"
            return Recommendation(found.option, found.estimate, reason, changes)  # type: ignore[arg-type]
    return None


def largest_micro_batch(cfg: SFTConfig, model_config: Any, limits: Limits, option: Option, *, limit: int = 512,
                        calibration: Calibration = DEFAULT_CALIBRATION, data: ShardLengths | None = None) -> int | None:
    """The largest ``train.micro_batch_size`` (at most ``limit``) with which ``cfg`` under ``option``
    fits ``limits`` outside the estimator's 10% margin (not :attr:`Fit.tight`); None if not even 1
    does. Most tokens per micro-batch is what ZeRO-3 needs most: its gathers cost per micro-batch,
    not per token. Memory grows with the micro-batch, so a doubling search, then bisection, finds it
    in O(log limit) estimates; on ``data`` each size plans the shards' micro-batches again."""
    def fits(batch: int) -> bool:
        variant = option.apply(cfg.replace(train=dataclasses.replace(cfg.train, micro_batch_size=batch)))
        fit = estimate(variant, model_config, calibration=calibration, data=data).fits(limits)
        return fit.fits and not fit.tight

    if not fits(1):
        return None
    good, bad = 1, None
    while bad is None and good < limit:
        trial = min(2 * good, limit)
        if fits(trial):
            good = trial
        else:
            bad = trial
    while bad is not None and bad - good > 1:
        middle = (good + bad) // 2
        good, bad = (middle, bad) if fits(middle) else (good, middle)
    return good


def _fastest_fitting(rows: list[PlanRow]) -> PlanRow | None:
    fitting = [r for r in rows if r.fit is not None and r.fit.fits]
    if not fitting:
        return None
    return min(fitting, key=lambda r: (RELATIVE_STEP_TIME[(r.option.stage, r.option.offload)], r.estimate.device_total if r.estimate else 0))


def _fit_figures(row: PlanRow) -> str:
    est = row.estimate
    assert est is not None and row.fit is not None
    parts = [r for r in row.fit.reasons if "not checked" not in r]
    return "; ".join(parts) if parts else est.summary()


def _reason(best: PlanRow, rows: list[PlanRow]) -> str:
    faster = [r for r in rows if r.estimate is not None and RELATIVE_STEP_TIME[(r.option.stage, r.option.offload)]
              < RELATIVE_STEP_TIME[(best.option.stage, best.option.offload)]]
    if best.option == Option(2):
        why = ("the fastest option: no parameter gathering, no offload traffic, and a shorter step than ZeRO-0's "
               "(measured on one H100, docs/benchmark.md)")
    elif not faster:
        why = "the fastest option allowed for this config"
    else:
        blocked = ", ".join(f"{r.option.label} ({'not allowed' if r.fit is None else _over(r)})" for r in faster)
        why = f"the fastest option that fits; faster ones do not: {blocked}"
        if best.option.offload != "none":
            why += "; offload makes steps about 2-3× slower"
    return f"{best.option.label} fits ({_fit_figures(best)}) and is {why}"


def _over(row: PlanRow) -> str:
    assert row.fit is not None
    over = [r for r in row.fit.reasons if "too much" in r or r.startswith("GPUs:")]
    return "; ".join(r.replace(" — too much", "") for r in over) or row.fit.verdict


# --- preflight ---------------------------------------------------------------------------------


def preflight(cfg: SFTConfig, model_config: Any, limits: Limits | None = None, *,
              calibration: Calibration = DEFAULT_CALIBRATION, data: ShardLengths | None = None) -> Estimate:
    """Estimate ``cfg`` and check it against ``limits`` (default: this machine, :meth:`Limits.detect`).
    With ``data`` (the job's shards) the check uses the data-aware estimate, so a job that fits by
    its real micro-batches is not refused by the worst case the config allows. Returns the
    estimate when it fits (or when a limit is unknown); raises :class:`MemoryPreflightError` naming
    the estimate (and the worst case by config next to it), the limit and the options that would fit."""
    limits = limits if limits is not None else Limits.detect()
    est = estimate(cfg, model_config, calibration=calibration, data=data)
    fit = est.fits(limits)
    if fit.fits:
        return est
    rows = plan_options(cfg, model_config, limits, calibration=calibration, data=data)
    fitting = sorted((r for r in rows if r.fit is not None and r.fit.fits),
                     key=lambda r: RELATIVE_STEP_TIME[(r.option.stage, r.option.offload)])
    problems = "; ".join(r.replace(" — too much", "") for r in fit.reasons if "too much" in r or r.startswith("GPUs:"))
    lines = [
        f"memory preflight: {est.option.label} on {limits.describe()} does not fit: {problems}.",
        f"  estimate: {est.summary(limits)}; {est.shape.describe()}; {_count(est.trainable_params)} trainable "
        f"({est.precision}), {est.batch.describe() if est.batch else ''}, world size {est.world_size}"
        f"{', gradient checkpointing' if est.gradient_checkpointing else ''}.",
    ]
    by_config = worst_case_by_config(cfg, model_config, est, limits, calibration=calibration)
    if by_config:
        lines.append(f"  {by_config}.")
    if fitting:
        lines.append("  options that fit (fastest first): " + "; ".join(
            f"{' '.join(r.option.overrides())} → {r.estimate.summary(limits)}" for r in fitting if r.estimate))
    else:
        rec = recommend(cfg, model_config, limits, rows=rows, calibration=calibration, data=data)
        if rec is not None:
            lines.append(f"  no stage or offload option fits as configured; this would: {' '.join(rec.overrides)} "
                         f"{' '.join(rec.option.overrides())} ({rec.reason})")
        else:
            lines.append("  nothing fits this machine, not even micro-batch 1 with gradient checkpointing: use more or larger GPUs, "
                         "shorten data.max_seq_length, or train an adapter instead of the full model.")
    lines.append("  The table of every option: jobs/estimate.py with the same config.")
    raise MemoryPreflightError("\n".join(lines), estimate=est, limits=limits, fit=fit, fitting=fitting)


def worst_case_by_config(cfg: SFTConfig, model_config: Any, est: Estimate, limits: Limits | None = None, *,
                         calibration: Calibration = DEFAULT_CALIBRATION) -> str | None:
    """For a data-aware ``est``: the worst case the config allows, as one line, when its figures
    differ (None otherwise, and for ``data.max_seq_length: auto``, which only the data decides)."""
    if not est.data_aware or cfg.data.max_seq_length == "auto":
        return None
    worst = estimate(cfg, model_config, calibration=calibration)
    if worst.summary(limits) == est.summary(limits):
        return None
    assert worst.batch is not None
    return f"worst case by config ({worst.batch.describe().removesuffix(' (the worst case by config)')}): {worst.summary(limits)}"


# --- formatting --------------------------------------------------------------------------------


def _gib(n: int | float | None) -> str:
    return "?" if n is None else f"{n / GIB:.1f} GiB" if n >= 0.1 * GIB else f"{n / MIB:.0f} MiB"


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def format_table(rows: list[PlanRow], limits: Limits) -> str:
    """The component × option table (GiB) with totals and verdicts, as plain text."""
    shown = [r for r in rows if r.estimate is not None]
    if not shown:
        return "no option is allowed for this config"
    first = shown[0].estimate
    assert first is not None
    device_rows = list(first.device) + ["peak allocated", "peak reserved", *first.device_outside_allocator, "GPU total"]
    host_rows = [k for k in first.host_worker] + ["workers on the node", *first.host_node, "host total per node"]
    header = ["", *[r.option.label.replace(" + offload ", " +off ") for r in shown]]
    lines: list[list[str]] = []

    def value(est: Estimate, key: str, section: str) -> str:
        n = est.workers_per_node(limits)
        if section == "device":
            table = {**est.device, **est.device_outside_allocator, "peak allocated": est.device_peak,
                     "peak reserved": est.device_reserved, "GPU total": est.device_total}
        else:
            table = {**est.host_worker, **est.host_node, "workers on the node": est.host_workers(n), "host total per node": est.host_total(n)}
        return f"{table.get(key, 0) / GIB:.2f}"

    label = "per GPU (GiB)" if first.use_gpu else "per CPU worker, in host RAM (GiB)"
    lines.append([label, *[""] * len(shown)])
    for key in device_rows:
        if not first.use_gpu and key in ("peak reserved", "GPU total"):
            continue
        lines.append([f"  {key}", *[value(r.estimate, key, "device") for r in shown if r.estimate]])
    lines.append(["peak phase", *[r.estimate.device_peak_phase for r in shown if r.estimate]])
    lines.append(["per worker process / node (GiB)", *[""] * len(shown)])
    for key in host_rows:
        lines.append([f"  {key}", *[value(r.estimate, key, "host") for r in shown if r.estimate]])
    lines.append(["verdict", *[r.fit.verdict if r.fit else "" for r in shown]])
    widths = [max(len(row[i]) for row in [header, *lines]) for i in range(len(header))]
    out = ["  ".join(cell.ljust(widths[i]) if i == 0 else cell.rjust(widths[i]) for i, cell in enumerate(row)) for row in [header, *lines]]
    invalid = [f"{r.option.label}: not allowed ({r.invalid})" for r in rows if r.estimate is None]
    return "\n".join(out + invalid)


__all__ = [
    "ALL_OPTIONS", "BatchShape", "Calibration", "DEFAULT_CALIBRATION", "Estimate", "Fit", "Limits", "MemoryEstimateError",
    "MemoryPreflightError", "MicroBatch", "ModelShape", "Option", "ParamSpec", "PlanRow", "Recommendation", "ShardLengths",
    "estimate", "format_table", "largest_micro_batch", "load_model_config", "parameter_inventory", "parse_size", "plan_options", "preflight",
    "recommend", "trainable_params", "worst_case_by_config", "worst_micro_batch",
]

