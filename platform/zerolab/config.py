"""The job configuration: one frozen dataclass per concern, loaded from YAML plus dotted overrides.

``load_config(path, overrides)`` returns a validated :class:`SFTConfig` or raises one
:class:`ConfigError` that lists every problem as ``<dotted.key>: <what is wrong>; <how to fix>``.
The driver validates it once; workers get it, frozen and typed, inside their
:class:`zerolab.worker_plan.WorkerPlan` and re-validate nothing. ``to_dict``/``from_dict`` serve
YAML: a sweep's saved definition, the config artifact in MLflow.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from zerolab.config_build import build, coerce, describe, fix_hint, to_plain, unknown_key
from zerolab.errors import UserError

BUILTIN_TINY_MODEL = "builtin:tiny-qwen2"
DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

AdapterMethod = Literal["full", "lora", "dora", "rslora", "adalora"]
TaskName = Literal["math_sum", "ner_json", "long_context", "custom"]
Precision = Literal["auto", "bf16", "fp16", "fp32"]
Quantization = Literal["none", "nf4", "fp4", "int8"]


class ConfigError(UserError, ValueError):
    """A user's configuration is invalid. ``problems`` holds one line per problem."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid configuration ({len(self.problems)} problem(s)):\n{lines}")

    def __reduce__(self) -> tuple:  # raised in Ray workers and Tune trials: unpickle from the problems
        return type(self), (self.problems,)


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    name_or_path: str = BUILTIN_TINY_MODEL
    """Hugging Face hub id, local folder, or `builtin:tiny-qwen2` (a tiny Qwen2 built from code, no download)."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) when `name_or_path` is a hub id."""
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2", "varlen"] = "sdpa"
    """Attention kernel; `varlen`: PyTorch's FlashAttention varlen kernel on packed batches, and causal SDPA (cuDNN's kernel on Hopper GPUs) where each packed row holds one sample (GPU; elsewhere `sdpa`); `flash_attention_2` needs the flash-attn package."""
    kernels: Literal["auto", "liger", "none"] = "auto"
    """Fused kernels: Liger Kernel's Triton RMSNorm, SwiGLU, RoPE and linear + cross-entropy (`auto`: on GPU where the package is installed, zerolab's `gpu` extra; `liger`: required) and LoRA's scale+add fused into one matrix product (any device, any ZeRO stage; without adapter dropout one autograd node per projection, Q/K/V and gate/up one node each with one product of their shared input and their stacked A matrices, and SwiGLU with down's LoRA one node that recomputes down's input in the backward instead of keeping it); `none`: Hugging Face's and peft's own modules."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass: less memory, about a third more compute."""
    offload_checkpoints: bool = False
    """With `gradient_checkpointing`: keep each decoder layer's checkpoint (its input hidden states, e·h bytes per token) in pinned host memory between the forward and the backward pass, copied on a side stream while the layers compute; the last layer's stays on the GPU, and one more is in flight in the backward pass. Frees (L − 2)·e·h bytes per token of GPU memory and pins (L − 1) copies on the host (7B at 256K tokens: 45 GiB freed, 54 GiB pinned in power-of-two blocks); on CPU it is a plain copy (docs/memory.md#long-rows)."""
    tiled_mlp: int | Literal["auto"] = 0
    """Compute each decoder layer's MLP over this many tiles of the micro-batch's tokens and recompute them one at a time in the backward pass, so that its tokens × intermediate tensors exist for one tile only (one more MLP forward per step); `auto`: tiles of `hidden_size` tokens (ALST's choice); 0 or 1: off. Not with `compile`."""
    rope_scaling: Literal["none", "linear", "dynamic", "yarn"] = "none"
    """RoPE scaling set on the model's config as it loads, for rows past its trained length (`max_position_embeddings`): `linear` (position interpolation), `dynamic` (NTK-aware, grows with the row), `yarn`, each by `rope_factor`; `none`: the model's own (a scaling in its config.json stays)."""
    rope_factor: float = 1.0
    """With `rope_scaling`: how many times its trained length the model's positions then reach (more than 1); rows may be up to `max_position_embeddings` × this long."""
    rope_original_max_position_embeddings: int | None = None
    """With `rope_scaling: yarn`: the length the model was trained at; empty: its `max_position_embeddings`."""

    def positions(self, max_position_embeddings: int) -> int:
        """The longest row a model whose config gives `max_position_embeddings` takes under `rope_scaling`:
        that length, or the trained length (yarn: `rope_original_max_position_embeddings` where given) × `rope_factor`."""
        if self.rope_scaling == "none":
            return max_position_embeddings
        trained = self.rope_original_max_position_embeddings if self.rope_scaling == "yarn" else None
        return int((trained or max_position_embeddings) * self.rope_factor)

    def tiles_mlp(self) -> bool:
        """Whether `tiled_mlp` tiles the MLP (`auto` or more than one tile)."""
        return self.tiled_mlp == "auto" or self.tiled_mlp > 1
    compile: bool = False
    """`torch.compile` each decoder layer (regional: the compiled graphs serve every layer; fewer, fused kernels); the first steps compile, and a graph that fails to compile runs eagerly with a warning saying why. Inductor then generates the norm, RoPE and SwiGLU kernels (Liger's fused loss stays). Meant for GPUs (0.5B on one H100: +2.4%, after ≈ 33 s of compiling; docs/benchmark.md); on CPU it is slower."""
    fp8: bool = False
    """Frozen base weights' matrix products (forward and input gradient) in FP8: e4m3 weights scaled per tensor, inputs and gradients per row, bf16 out; adapters, norms, attention and loss stay bf16. Costs two bytes per FP8 weight (the e4m3 copy and its transpose). Needs an FP8 GPU (H100 class; elsewhere the products stay bf16, with the reason logged), bf16, ZeRO 0-2 and an adapter (not `full`); not with `compile`."""
    fp8_min_features: int = 1024
    """With `fp8`: layers with fewer inputs or outputs keep bf16 products, where quantizing the input costs more than FP8 saves (one H100, 4096 rows: 3584→3584 0.148 ms bf16 against 0.103 ms FP8; 7B's 3584→512 k/v 0.027 against 0.085 ms)."""
    trust_remote_code: bool = False
    """Allow model code from the hub repository to run (only for models you trust)."""
    quantization: Quantization = "none"
    """Load the frozen base quantized by bitsandbytes (the `quantization` extra) and train an adapter on it (QLoRA): `nf4` (4-bit NormalFloat, double-quantized constants; the QLoRA default), `fp4` (4-bit float), `int8` (LLM.int8()); the embeddings, the output head and the norms stay in the training precision. ZeRO-3 shards quantized weights like any other (4-bit ones are stored in the training dtype). `none`: the base in the training precision."""


@dataclass(frozen=True, kw_only=True)
class AdapterSpec:
    method: AdapterMethod = "lora"
    """`full` fine-tuning or a peft adapter: `lora`, `dora`, `rslora`, `adalora`."""
    r: int = 8
    """Adapter rank (AdaLoRA: the average target rank after pruning)."""
    alpha: float = 16.0
    """Adapter scaling numerator: scale = alpha / r (rsLoRA: alpha / sqrt(r))."""
    dropout: float = 0.05
    """Dropout on the adapter input."""
    target_modules: tuple[str, ...] = DEFAULT_TARGET_MODULES
    """Module names (suffixes) that get adapters, or `[all-linear]`."""
    adalora_init_r: int = 12
    """AdaLoRA: rank every adapter starts with before budget pruning; must exceed `r`."""
    adalora_warmup_fraction: float = 0.1
    """AdaLoRA: fraction of the steps trained before rank pruning starts (peft's tinit)."""
    adalora_final_fraction: float = 0.2
    """AdaLoRA: fraction of the steps trained at the final rank budget (peft's tfinal)."""

    def is_peft(self) -> bool:
        return self.method != "full"


@dataclass(frozen=True, kw_only=True)
class DataSpec:
    task: TaskName = "math_sum"
    """Task that supplies the system prompt, the generator and the scorer; `custom` needs `train_path`."""
    train_path: str | None = None
    """JSON array, JSONL or Parquet file (or a folder of them); empty: generate `num_train_rows` rows."""
    eval_path: str | None = None
    """Held-out file in the same formats; empty with a generated train set: generate `num_eval_rows`."""
    num_train_rows: int = 1798
    """Rows to generate when `train_path` is empty (the seeds' math set had 1,798)."""
    num_eval_rows: int = 200
    """Rows to generate when `eval_path` is empty; 0 for no eval split."""
    system_prompt: str | None = None
    """System message; empty: the task's own."""
    max_seq_length: int | Literal["auto"] = 128
    """Longest tokenized sample (prompt + response) accepted; longer rows are reported as bad. `auto`: the data's longest row (train and eval), rounded up to a multiple of 64, at most the model's `max_position_embeddings` (only rows beyond that are bad); resolved when the data is prepared and logged as `derived.max_seq_length`. With `packing`, sequences are packed up to this length: `auto` holds the longest row, a larger number packs more rows per sequence."""
    packing: bool = False
    """Pack several samples into each sequence, best fit: each sample joins the sequence with the least room that holds it (attention stays within each sample)."""
    max_bad_fraction: float = 0.0
    """Fraction of malformed rows tolerated before the job fails (they are always reported)."""
    seed: int = 0
    """Seed of the task generator."""

    def has_eval_split(self) -> bool:
        """An eval file, or generated eval rows beside generated train rows (a train file alone has none)."""
        return bool(self.eval_path) or (not self.train_path and self.num_eval_rows > 0)


@dataclass(frozen=True, kw_only=True)
class TrainSpec:
    micro_batch_size: int = 16
    """Samples (packed rows with `data.packing`) per worker per forward pass."""
    grad_accum_steps: int = 1
    """Micro-batches accumulated per optimizer step."""
    max_steps: int | None = None
    """Optimizer steps to run; empty: `num_epochs` passes over the data."""
    num_epochs: int = 2
    """Passes over the training data when `max_steps` is empty."""
    lr: float = 3e-3
    """Peak learning rate (the default suits the tiny built-in model; real models want ~1e-4, as in jobs/configs/)."""
    lr_scheduler: Literal["cosine", "linear", "constant"] = "cosine"
    """Decay after warm-up."""
    warmup_ratio: float = 0.03
    """Fraction of the steps with linear warm-up."""
    weight_decay: float = 0.0
    """AdamW weight decay (not applied to biases and norms)."""
    max_grad_norm: float = 1.0
    """Gradient clipping by global norm; 0 disables it."""
    precision: Precision = "auto"
    """`auto`: bf16 on GPU, fp32 on CPU."""
    seed: int = 42
    """Seed of model init, adapter init, dropout and data order."""
    log_every_n_steps: int = 10
    """Report metrics every N optimizer steps (each report synchronises the device)."""
    checkpoint_every_n_steps: int | None = None
    """Save a resumable checkpoint every N steps; one is always saved at the end."""
    keep_checkpoints: int = 2
    """Checkpoints kept in storage (the newest)."""
    memory_snapshot_dir: str = ""
    """GPU only: a local folder where each worker writes its CUDA allocator's history at the end of
    training (`rank<N>.pickle`, every allocation and segment with the Python lines that made it; open it
    at pytorch.org/memory_viz or with `bench/memory_trace.py`). Slows the steps; empty: off."""


@dataclass(frozen=True, kw_only=True)
class DeepSpeedSpec:
    stage: Literal[0, 1, 2, 3] = 2
    """ZeRO stage: 0 plain data parallel, 1 optimizer states, 2 + gradients, 3 + parameters partitioned."""
    offload_optimizer: bool = False
    """Keep optimizer states in host memory (DeepSpeedCPUAdam); stages 1-3."""
    offload_param: bool = False
    """Keep parameters in host memory; stage 3 only."""
    config: str | None = None
    """DeepSpeed JSON to use; empty: the file in `ds_configs/` that matches stage and offload."""
    z3_leaf_layers: bool = True
    """ZeRO-3: gather each decoder layer's parameters in one collective, with one hook per layer instead of one per weight (DeepSpeed leaf modules); false: per module."""


@dataclass(frozen=True, kw_only=True)
class ScalingSpec:
    num_workers: int = 2
    """Ray Train workers (one per GPU when `use_gpu`)."""
    use_gpu: bool = False
    """Train on GPUs (NCCL) instead of CPUs (gloo, DeepSpeed's CPU accelerator)."""
    cpus_per_worker: float = 1.0
    """CPUs reserved for each worker."""
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """How Ray places the workers: PACK fills nodes (fast NVLink/shm), SPREAD spreads them over nodes."""
    launch: Literal["auto", "workers", "driver"] = "auto"
    """Where training runs: `workers`, Ray Train's worker group (a process per worker, placed by Ray, retried with `run.max_failures`); `driver`, the job's own process as the one worker (Ray Train's local mode: no worker group to start, 15-30 s less before the first step; needs `num_workers` 1 and `run.max_failures` 0); `auto`, `driver` where it can run and owns its resources (a machine of its own with no `RAY_ADDRESS`, where the job then starts no Ray at all; a Tune trial's reserved CPUs/GPU; a job submitted with `ray job submit --entrypoint-num-gpus 1` or, on CPUs, `--entrypoint-num-cpus`), else `workers`."""
    sequence_parallel_size: int = 1
    """Ulysses sequence parallelism (DeepSpeed's ALST): each row's tokens are split over this many workers, whose attention trades the sequence split for a head split (all-to-all); rows are shared out over `num_workers / sequence_parallel_size` data-parallel groups. Must divide `num_workers` and the model's attention heads; 1: off (docs/sequence_parallel.md)."""
    keep_warm_s: float = 0.0
    """On a running cluster (`RAY_ADDRESS`, as `ray job submit` sets), a one-worker job trains in a warm trainer on its node: a process that imported the training stack once and stays up this many seconds after each job, so the next job submitted there starts without those imports (the job's own process imports none of them). Submit without entrypoint resources (the trainer holds the GPU). 0: off."""


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    name: str | None = None
    """Run name: Ray Train run folder and MLflow run; empty: a new name for each launch (`<task>-<model>-<date>-<time>`); naming an unfinished run resumes it."""
    storage_path: str = "~/zerolab_runs"
    """Where checkpoints and outputs go: a shared local/NFS folder or s3:// / gs:// URI."""
    max_failures: int = 0
    """Worker-group failures retried from the last checkpoint before the run fails."""
    max_wall_time_s: float | None = None
    """Seconds from launch after which the workers save a checkpoint and stop (exit 3; a relaunch resumes); empty: no limit."""


@dataclass(frozen=True, kw_only=True)
class TrackingSpec:
    uri: str | None = None
    """MLflow tracking URI; empty: $MLFLOW_TRACKING_URI, else the store the run recorded, else sqlite `mlflow.db` beside the run folders (`run.storage_path`, or ~/zerolab_runs when that is remote)."""
    experiment: str = "zerolab"
    """MLflow experiment name."""
    registered_model: str | None = None
    """Model Registry name the final adapter is registered under; empty: `run.name`, or `<task>-<model>` when the run was not named."""
    model_alias: str = "candidate"
    """Alias set on the newly registered version (`models:/<name>@<alias>`); empty: none."""
    register: bool = True
    """Register the final adapter (or full model) in the MLflow Model Registry."""
    system_metrics_interval_s: float = 10.0
    """Seconds between MLflow system-metric samples (CPU, memory, GPU) on every node with workers; 0: off."""


@dataclass(frozen=True, kw_only=True)
class EvalSpec:
    enabled: bool = False
    """After training, answer the eval split's prompts (greedy) and score them with the task's scorer, logged into the training run."""
    num_examples: int = 200
    """Eval-split prompts answered and scored (the first N); 0: all of them."""
    max_new_tokens: int = 64
    """Longest answer generated per prompt (generation also stops at end-of-turn)."""
    batch_size: int = 32
    """Prompts generated together (left-padded, KV cache)."""
    compare_base: bool = True
    """Also evaluate the base model on the same prompts: `eval/base/*`, `eval/tuned/*` and `eval/delta/*`."""
    num_workers: int = 1
    """Ray Data actors that generate (one GPU each with `scaling.use_gpu`); 1 on CPU: in the driver."""


@dataclass(frozen=True, kw_only=True)
class SFTConfig:
    model: ModelSpec = field(default_factory=ModelSpec)
    adapter: AdapterSpec = field(default_factory=AdapterSpec)
    data: DataSpec = field(default_factory=DataSpec)
    train: TrainSpec = field(default_factory=TrainSpec)
    deepspeed: DeepSpeedSpec = field(default_factory=DeepSpeedSpec)
    scaling: ScalingSpec = field(default_factory=ScalingSpec)
    run: RunSpec = field(default_factory=RunSpec)
    tracking: TrackingSpec = field(default_factory=TrackingSpec)
    eval: EvalSpec = field(default_factory=EvalSpec)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> SFTConfig:
        """Build and validate; raises ConfigError listing every problem."""
        problems: list[str] = []
        cfg = build(cls, raw, "", problems)
        # Fields that failed to parse kept their defaults; report the rest of the checks too.
        bad_keys = {p.split(":", 1)[0] for p in problems}
        problems.extend(p for p in validate(cfg) if p.split(":", 1)[0] not in bad_keys)
        if problems:
            raise ConfigError(problems)
        return cfg

    def to_dict(self) -> dict[str, Any]:
        return to_plain(dataclasses.asdict(self))

    def flat(self) -> dict[str, Any]:
        """The config as dotted keys, e.g. ``{"adapter.r": 8, ...}``."""
        return {f"{section}.{key}": value for section, values in self.to_dict().items() for key, value in values.items()}

    def replace(self, **sections: Any) -> SFTConfig:
        return dataclasses.replace(self, **sections)

    def with_values(self, values: dict[str, Any]) -> SFTConfig:
        """This config with ``{"section.key": value}`` replaced (typed values, as YAML would give
        them), checked as ``from_dict`` checks a whole config: one ConfigError lists every problem."""
        problems: list[str] = []
        changed: dict[str, dict[str, Any]] = {}
        sections = [f.name for f in dataclasses.fields(self)]
        for key, value in values.items():
            section, _, name = key.partition(".")
            if section not in sections or not name:
                problems.append(f"{key}: not a section.key of the job config; the sections are {', '.join(sections)}")
                continue
            spec = getattr(self, section)
            hints = typing.get_type_hints(type(spec))
            if name not in hints:
                problems.append(unknown_key(name, f"{section}.", list(hints)))
                continue
            ok, coerced = coerce(value, hints[name])
            if not ok:
                problems.append(f"{key}: {value!r} is not {describe(hints[name])}; {fix_hint(hints[name])}")
                continue
            changed.setdefault(section, {})[name] = coerced
        cfg = dataclasses.replace(self, **{s: dataclasses.replace(getattr(self, s), **v) for s, v in changed.items()})
        problems.extend(validate(cfg))
        if problems:
            raise ConfigError(problems)
        return cfg

    def precision(self) -> Literal["bf16", "fp16", "fp32"]:
        """The precision the workers train in (`auto` resolved)."""
        if self.train.precision != "auto":
            return self.train.precision
        return "bf16" if self.scaling.use_gpu else "fp32"

    def world_size(self) -> int:
        """Worker processes (ranks)."""
        return self.scaling.num_workers

    def data_parallel_size(self) -> int:
        """Data shards: groups of `scaling.sequence_parallel_size` ranks share one and split its rows' tokens."""
        return self.scaling.num_workers // max(1, self.scaling.sequence_parallel_size)

    def global_batch_size(self) -> int:
        """Rows (packed sequences with `data.packing`) per optimizer step over all data-parallel groups."""
        return self.train.micro_batch_size * self.train.grad_accum_steps * self.data_parallel_size()


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> SFTConfig:
    """Load a YAML job config (or the embedded default when ``path`` is None), apply ``a.b=value``
    overrides, and check the local paths it names exist on this machine (the driver's): one
    ConfigError lists every problem. ``SFTConfig.from_dict`` alone (workers, sweep trials) checks
    the config itself and touches no file system."""
    raw = load_yaml(path) if path is not None else {}
    try:
        cfg = SFTConfig.from_dict(apply_overrides(raw, overrides))
    except ConfigError as exc:
        partial = build(SFTConfig, apply_overrides(raw, overrides), "", [])
        raise ConfigError([*exc.problems, *missing_paths(partial)]) from None
    if problems := missing_paths(cfg):
        raise ConfigError(problems)
    return cfg


def missing_paths(cfg: SFTConfig) -> list[str]:
    """Local files and folders the config names that do not exist here (remote URIs are not checked)."""
    d, ds = cfg.data, cfg.deepspeed
    return [f"{key}: no such file or folder '{value}'; check the path (relative paths start at the working directory)"
            for key, value in (("data.train_path", d.train_path), ("data.eval_path", d.eval_path), ("deepspeed.config", ds.config))
            if value and "://" not in value and not Path(value).expanduser().exists()]


def load_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError([f"--config: no such file '{path}'; pass the path of a job YAML such as jobs/configs/math_tiny.yaml"])
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ConfigError([f"--config: '{path}' is not valid YAML ({exc}); fix the syntax"]) from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError([f"--config: '{path}' must hold a mapping of sections (model:, adapter:, ...), got {type(raw).__name__}"])
    return raw


def apply_overrides(raw: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """Return a copy of ``raw`` with each ``section.key=value`` applied; values are parsed as YAML scalars/lists."""
    merged = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}
    problems = []
    for item in overrides:
        key, sep, text = item.partition("=")
        parts = key.strip().split(".")
        if not sep or len(parts) != 2 or not all(parts):
            problems.append(f"--set {item}: expected section.key=value, e.g. --set adapter.r=16")
            continue
        try:
            value = yaml.safe_load(text) if text.strip() else None
        except yaml.YAMLError:
            value = text
        section = merged.setdefault(parts[0], {})
        if not isinstance(section, dict):
            problems.append(f"--set {item}: '{parts[0]}' is not a section")
            continue
        section[parts[1]] = value
    if problems:
        raise ConfigError(problems)
    return merged


def validate(cfg: SFTConfig) -> list[str]:
    """Cross-field checks that types alone cannot express. Returns the problems found."""
    p: list[str] = []
    m, a, d, t, ds, s, r = cfg.model, cfg.adapter, cfg.data, cfg.train, cfg.deepspeed, cfg.scaling, cfg.run

    def positive(key: str, value: float | None, *, allow_none: bool = False, zero_ok: bool = False) -> None:
        if value is None and allow_none:
            return
        if value is None or value < 0 or (value == 0 and not zero_ok):
            need = "a number >= 0" if zero_ok else "a positive number"
            p.append(f"{key}: {value!r} is not allowed; use {need}")

    def fraction(key: str, value: float, *, upper_open: bool = True) -> None:
        if not (0.0 <= value < 1.0 if upper_open else 0.0 <= value <= 1.0):
            bound = "[0, 1)" if upper_open else "[0, 1]"
            p.append(f"{key}: {value!r} is out of range; use a value in {bound}")

    positive("adapter.r", a.r)
    positive("adapter.alpha", a.alpha)
    fraction("adapter.dropout", a.dropout)
    positive("data.num_train_rows", d.num_train_rows)
    positive("data.num_eval_rows", d.num_eval_rows, zero_ok=True)
    fraction("data.max_bad_fraction", d.max_bad_fraction, upper_open=False)
    if d.max_seq_length != "auto" and d.max_seq_length < 8:
        p.append(f"data.max_seq_length: {d.max_seq_length} is too short for a chat-formatted sample; use at least 8, or auto")
    positive("train.micro_batch_size", t.micro_batch_size)
    positive("train.grad_accum_steps", t.grad_accum_steps)
    positive("train.max_steps", t.max_steps, allow_none=True)
    positive("train.num_epochs", t.num_epochs)
    positive("train.lr", t.lr)
    fraction("train.warmup_ratio", t.warmup_ratio)
    positive("train.weight_decay", t.weight_decay, zero_ok=True)
    positive("train.max_grad_norm", t.max_grad_norm, zero_ok=True)
    positive("train.log_every_n_steps", t.log_every_n_steps)
    positive("train.checkpoint_every_n_steps", t.checkpoint_every_n_steps, allow_none=True)
    positive("train.keep_checkpoints", t.keep_checkpoints)
    positive("scaling.num_workers", s.num_workers)
    positive("scaling.cpus_per_worker", s.cpus_per_worker)
    positive("run.max_failures", r.max_failures, zero_ok=True)
    positive("scaling.keep_warm_s", s.keep_warm_s, zero_ok=True)
    if s.keep_warm_s and not (s.num_workers == 1 and s.launch != "workers" and not r.max_failures):
        p.append("scaling.keep_warm_s: a warm trainer runs one-worker jobs (scaling.num_workers=1, run.max_failures=0, scaling.launch auto or driver); set those or scaling.keep_warm_s=0")
    if s.launch == "driver":
        if s.num_workers != 1:
            p.append(f"scaling.launch: driver trains in the job's own process, one worker, but scaling.num_workers={s.num_workers}; set scaling.num_workers=1 or scaling.launch=workers")
        if r.max_failures:
            p.append(f"scaling.launch: driver has no worker group to restart, but run.max_failures={r.max_failures}; set run.max_failures=0 or scaling.launch=workers")

    if not a.target_modules:
        p.append("adapter.target_modules: empty; list module names such as [q_proj, v_proj], or [all-linear]")
    if a.method == "adalora":
        if a.adalora_init_r <= a.r:
            p.append(f"adapter.adalora_init_r: {a.adalora_init_r} must exceed adapter.r={a.r} (AdaLoRA prunes from init_r down to r); raise adapter.adalora_init_r or lower adapter.r")
        if not 0 < a.adalora_warmup_fraction + a.adalora_final_fraction < 1:
            p.append("adapter.adalora_warmup_fraction + adapter.adalora_final_fraction: must lie in (0, 1) so that a pruning phase remains; e.g. 0.1 and 0.2")
        if ds.stage != 0:
            p.append(f"adapter.method: adalora with deepspeed.stage={ds.stage} is not supported: AdaLoRA masks adapter weights in place from their gradients, which ZeRO 1-3 partition and keep in separate fp32 copies; set deepspeed.stage=0")
        if cfg.precision() != "fp32":
            p.append(f"adapter.method: adalora needs train.precision=fp32 (DeepSpeed's {cfg.precision()} optimizer keeps master weights that AdaLoRA's in-place rank masking cannot reach); set train.precision=fp32")

    positive("model.fp8_min_features", m.fp8_min_features)
    if m.fp8:
        if a.method == "full":
            p.append("model.fp8: FP8 products are for frozen base weights, and adapter.method=full trains them all; use an adapter (lora, dora, rslora, adalora) or model.fp8=false")
        if ds.stage == 3:
            p.append("model.fp8: ZeRO-3 partitions the frozen weights that the e4m3 copies are made from; use deepspeed.stage 0-2 or model.fp8=false")
        if cfg.precision() != "bf16" and s.use_gpu:
            p.append(f"model.fp8: needs train.precision=bf16 (got {cfg.precision()}); set train.precision=bf16 or model.fp8=false")
        if m.compile:
            p.append("model.fp8: not with model.compile (compiled layers take their own products); set one of them to false")
        if not s.use_gpu:
            p.append("model.fp8: needs a GPU with FP8 matrix units (H100 class); set scaling.use_gpu=true or model.fp8=false")

    p.extend(_quantization_problems(cfg))
    p.extend(_sequence_parallel_problems(cfg))
    p.extend(_long_row_problems(cfg))

    if d.task == "custom" and not d.train_path:
        p.append("data.train_path: required when data.task=custom (there is no generator); give a JSON/JSONL/Parquet file")
    if ds.offload_optimizer and ds.stage == 0:
        p.append("deepspeed.offload_optimizer: ZeRO stage 0 has no partitioned optimizer to offload; set deepspeed.stage to 1, 2 or 3, or deepspeed.offload_optimizer=false")
    if ds.offload_param and ds.stage != 3:
        p.append(f"deepspeed.offload_param: parameter offload needs ZeRO stage 3 (got stage {ds.stage}); set deepspeed.stage=3 or deepspeed.offload_param=false")

    if not s.use_gpu:
        if t.precision == "fp16":
            p.append("train.precision: fp16 needs a GPU (DeepSpeed's CPU accelerator has no fp16 loss scaling); use fp32 or auto with scaling.use_gpu=false")
        if m.attn_implementation == "flash_attention_2":
            p.append("model.attn_implementation: flash_attention_2 needs a GPU; use sdpa with scaling.use_gpu=false")
        if m.kernels == "liger":
            p.append("model.kernels: liger needs a GPU (its kernels are Triton); use auto or none with scaling.use_gpu=false")
        if t.memory_snapshot_dir:
            p.append("train.memory_snapshot_dir: records the CUDA allocator; set scaling.use_gpu=true or leave it empty")
    if "://" in t.memory_snapshot_dir:
        p.append(f"train.memory_snapshot_dir: {t.memory_snapshot_dir!r} is a URI; each worker writes its file to a local "
                 f"folder of its node: give a path")

    positive("run.max_wall_time_s", r.max_wall_time_s, allow_none=True)
    if r.name is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", r.name):
        p.append(f"run.name: {r.name!r} must be 1-128 letters, digits, '.', '_' or '-' (it names folders and the MLflow run)")
    if not cfg.tracking.experiment.strip():
        p.append("tracking.experiment: empty; give an experiment name")
    e = cfg.eval
    positive("eval.num_examples", e.num_examples, zero_ok=True)
    positive("eval.max_new_tokens", e.max_new_tokens)
    positive("eval.batch_size", e.batch_size)
    positive("eval.num_workers", e.num_workers)
    if e.enabled and not d.has_eval_split():
        p.append("eval.enabled: there is no eval split to evaluate on; set data.eval_path (or data.num_eval_rows > 0 with generated data), or eval.enabled=false")
    if cfg.tracking.model_alias and not re.fullmatch(r"[A-Za-z0-9_-]{1,255}", cfg.tracking.model_alias):
        p.append(f"tracking.model_alias: {cfg.tracking.model_alias!r} must be letters, digits, '_' or '-'")
    if cfg.tracking.model_alias.lower() == "latest" or re.fullmatch(r"[vV]\d+", cfg.tracking.model_alias):
        p.append(f"tracking.model_alias: {cfg.tracking.model_alias!r} is reserved by MLflow; choose another, e.g. candidate")
    if cfg.tracking.system_metrics_interval_s < 0:
        p.append("tracking.system_metrics_interval_s: must be >= 0 (0 turns system metrics off)")
    return p


def _quantization_problems(cfg: SFTConfig) -> list[str]:
    """What a quantized base (``model.quantization``) cannot be combined with, and what to use instead."""
    m, q = cfg.model, cfg.model.quantization
    if q == "none":
        return []
    p = []
    if cfg.adapter.method == "full":
        p.append(f"model.quantization: a {q} base is frozen (its weights are stored quantized and get no gradients), and "
                 "adapter.method=full trains every weight; use an adapter (lora, dora, rslora, adalora) or model.quantization=none")
    if m.fp8:
        p.append("model.fp8: FP8 products are made from bf16 base weights, and model.quantization stores them quantized; "
                 "set one of model.fp8=false or model.quantization=none")
    if m.compile:
        p.append(f"model.compile: not with a {q} base (compiled layers are built for plain weights, not bitsandbytes' "
                 "quantized products); set model.compile=false or model.quantization=none")
    return p


def _sequence_parallel_problems(cfg: SFTConfig) -> list[str]:
    """What Ulysses sequence parallelism (``scaling.sequence_parallel_size``) cannot be combined with.
    The model's head counts are checked where its config is known (``zerolab.plan.check_against_model``)."""
    sp, s = cfg.scaling.sequence_parallel_size, cfg.scaling
    if sp < 1:
        return [f"scaling.sequence_parallel_size: {sp} is not allowed; use a positive number (1: off)"]
    if sp == 1:
        return []
    p = []
    if s.num_workers % sp:
        p.append(f"scaling.sequence_parallel_size: {sp} does not divide scaling.num_workers={s.num_workers} (each row is "
                 f"split over a group of {sp} workers); set scaling.num_workers to a multiple of {sp}")
    if cfg.model.attn_implementation == "eager":
        p.append("model.attn_implementation: eager attention needs the 4D mask that sequence-parallel attention drops "
                 "(it would be O(rows²) at full length); use sdpa, varlen or flash_attention_2")
    if cfg.data.packing and (cfg.model.attn_implementation == "sdpa" or not s.use_gpu):
        p.append("data.packing: with scaling.sequence_parallel_size > 1 attention runs without the mask that keeps packed "
                 "samples apart, so it must read their boundaries itself: use model.attn_implementation varlen or "
                 "flash_attention_2 on GPUs (scaling.use_gpu=true), or data.packing=false")
    if cfg.adapter.method == "adalora":
        p.append("adapter.method: adalora adds its orthogonality penalty to every rank's loss, and sequence parallelism "
                 "sums the gradients of a row's slices over its group, so the penalty would count "
                 f"{sp} times; use lora (or another adapter), or scaling.sequence_parallel_size=1")
    return p


ROPE_SCALINGS_WITH_ORIGINAL_LENGTH = ("yarn",)
"""The ``model.rope_scaling`` types that take ``rope_original_max_position_embeddings``."""


def _long_row_problems(cfg: SFTConfig) -> list[str]:
    """What the long-row settings (checkpoint offload, tiled MLP, RoPE scaling) need and rule out."""
    m, p = cfg.model, []
    if m.offload_checkpoints and not m.gradient_checkpointing:
        p.append("model.offload_checkpoints: offloads the checkpoints of gradient checkpointing, which is off; set "
                 "model.gradient_checkpointing=true or model.offload_checkpoints=false")
    if m.tiled_mlp != "auto" and m.tiled_mlp < 0:
        p.append(f"model.tiled_mlp: {m.tiled_mlp} is not allowed; use a number of tiles (0 or 1: off) or auto")
    if m.tiles_mlp() and m.compile:
        p.append("model.tiled_mlp: not with model.compile (a compiled layer traces the MLP whole); set one of "
                 "model.tiled_mlp=0 or model.compile=false")
    if m.tiled_mlp == "auto" and cfg.deepspeed.stage == 3 and not cfg.deepspeed.z3_leaf_layers:
        p.append("model.tiled_mlp: auto sizes the tiles by each rank's own rows, and ZeRO-3 without leaf layers gathers "
                 "the MLP's weights once per tile, a collective every rank must make as often; give a number of tiles "
                 "or set deepspeed.z3_leaf_layers=true")
    if m.rope_scaling == "none":
        if m.rope_factor != 1.0:
            p.append(f"model.rope_factor: {m.rope_factor} is set but model.rope_scaling is none; choose a scaling "
                     "(linear, dynamic, yarn) or leave model.rope_factor at 1")
    elif not m.rope_factor > 1.0:
        p.append(f"model.rope_factor: {m.rope_factor} with model.rope_scaling={m.rope_scaling} would not reach past the "
                 "model's trained length; use a factor above 1, e.g. 4.0 for four times the trained length")
    if m.rope_original_max_position_embeddings is not None:
        if m.rope_scaling not in ROPE_SCALINGS_WITH_ORIGINAL_LENGTH:
            p.append(f"model.rope_original_max_position_embeddings: only model.rope_scaling=yarn takes it (got "
                     f"{m.rope_scaling}); set model.rope_scaling=yarn or leave it empty")
        elif m.rope_original_max_position_embeddings < 1:
            p.append(f"model.rope_original_max_position_embeddings: {m.rope_original_max_position_embeddings} is not "
                     "allowed; give the length the model was trained at, or leave it empty for its max_position_embeddings")
    return p
