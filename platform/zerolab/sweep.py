"""A sweep's definition, before anything runs: the search space and its options read from a sweep
file (or the default), checked key by key, every sampled trial's config built and validated, and
the definition kept in the sweep's folder for a resume. :mod:`zerolab.tune` runs it."""

from __future__ import annotations

import difflib
import itertools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import yaml

from zerolab import ds_config
from zerolab.config import ConfigError, SFTConfig
from zerolab.errors import UserError
from zerolab.zero import ZERO_KEYS, Option

KINDS = ("grid", "choice", "uniform", "loguniform", "randint")



VIRTUAL_KEYS = {"deepspeed.zero": "ZeRO stage and offload together: " + ", ".join(ZERO_KEYS)}



class SweepError(UserError, ValueError):
    """A sweep file or search space that cannot run; lists every problem."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"invalid sweep ({len(problems)} problem(s)):\n{lines}")

    def __reduce__(self) -> tuple:
        return type(self), (self.problems,)



@dataclass(frozen=True)
class Dimension:
    key: str
    kind: Literal["grid", "choice", "uniform", "loguniform", "randint"]
    values: tuple[Any, ...]

    def tune_domain(self) -> Any:
        from ray import tune

        if self.kind == "grid":
            return tune.grid_search(list(self.values))
        if self.kind == "choice":
            return tune.choice(list(self.values))
        low, high = self.values
        return {"uniform": tune.uniform, "loguniform": tune.loguniform, "randint": tune.randint}[self.kind](low, high)



@dataclass(frozen=True)
class Sweep:
    name: str
    space: tuple[Dimension, ...]
    metric: str = "train/loss"
    mode: Literal["min", "max"] = "min"
    search: Literal["grid", "random", "optuna"] = "grid"
    num_samples: int = 1
    scheduler: Literal["none", "asha"] = "none"
    grace_period: int = 10
    reduction_factor: int = 2
    max_concurrent_trials: int | None = None
    batch: Literal["keep_accum", "keep_global"] = "keep_accum"
    overrides: dict[str, Any] = field(default_factory=dict)
    seed: int = 0

    def grid_points(self) -> list[dict[str, Any]]:
        """Every combination of the grid dimensions (the first value of the others)."""
        axes = [[(d.key, v) for v in d.values] for d in self.space if d.kind == "grid"]
        return [dict(combo) for combo in itertools.product(*axes)] if axes else [{}]

    def samples(self, n: int = 32) -> list[dict[str, Any]]:
        """The points to check before a sweep starts: the full grid, or ``n`` draws from the same
        Tune domains the search samples (so the check sees Tune's own distributions, bounds and
        rounding), with every value of a grid or choice dimension in at least one of them."""
        if self.search == "grid" and all(d.kind == "grid" for d in self.space):
            return self.grid_points()
        rng = np.random.default_rng(self.seed)
        domains = {d.key: d.tune_domain() for d in self.space}
        draws = {key: list(domain["grid_search"]) if isinstance(domain, dict) else list(np.atleast_1d(domain.sample(size=n, random_state=rng)))
                 for key, domain in domains.items()}
        points = [{k: v[i % len(v)] for k, v in draws.items()} for i in range(n)]
        for d in self.space:  # each categorical value at least once, whatever n
            if d.kind in ("grid", "choice"):
                points += [{**points[0], d.key: v} for v in d.values if all(p[d.key] != v for p in points)]
        return [{k: v.item() if isinstance(v, np.generic) else v for k, v in p.items()} for p in points]



DEFAULT_SWEEP: dict[str, Any] = {
    "name": "default-sweep",
    "metric": "train/loss",
    "mode": "min",
    "search": "grid",
    "set": {"train.max_steps": 20, "train.log_every_n_steps": 5, "data.num_train_rows": 320, "data.num_eval_rows": 0},
    "space": {"deepspeed.zero": {"grid": ["0", "2"]}, "adapter.r": {"grid": [4, 16]}},
}
"""``python jobs/tune.py`` with no --space: ZeRO stage × adapter rank on the embedded default job (4 trials)."""



SAVED = "zerolab_sweep.yaml"
"""The sweep definition and base job, kept in the sweep folder so ``--resume NAME`` needs nothing else."""



SWEEP_KEYS = {"name", "space", "metric", "mode", "search", "num_samples", "scheduler", "grace_period", "reduction_factor",
              "max_concurrent_trials", "batch", "set", "seed"}



def load_sweep(path: str | Path, config_keys: set[str]) -> Sweep:
    """Read and check a sweep file; every problem is reported at once with the fix."""
    path = Path(path)
    if not path.is_file():
        raise SweepError([f"sweep file: no such file '{path}'; give a sweep YAML such as jobs/configs/stage_sweep.yaml"])
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        raise SweepError([f"sweep file: '{path}' is not valid YAML ({exc})"]) from None
    return parse_sweep(raw, config_keys, default_name=path.stem.replace("_", "-"))



def parse_sweep(raw: Any, config_keys: set[str], default_name: str = "sweep") -> Sweep:
    problems: list[str] = []
    if not isinstance(raw, dict):
        raise SweepError([f"a sweep file holds a mapping (name:, space:, ...), got {type(raw).__name__}"])
    for key in sorted(set(raw) - SWEEP_KEYS):
        problems.append(f"{key}: unknown sweep key; valid keys are {', '.join(sorted(SWEEP_KEYS))}")
    name = str(raw.get("name", default_name))
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", name):
        problems.append(f"name: {name!r} must be 1-64 letters, digits, '.', '_' or '-' (it names folders and runs)")

    def choice(key: str, default: str, options: tuple[str, ...]) -> str:
        value = str(raw.get(key, default))
        if value not in options:
            problems.append(f"{key}: {value!r} is not one of {', '.join(options)}")
            return default
        return value

    def integer(key: str, default: int | None, low: int = 1) -> int | None:
        value = raw.get(key, default)
        if value is None:
            return None
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            problems.append(f"{key}: {value!r} must be an integer >= {low}")
            return default
        return value

    space: list[Dimension] = []
    raw_space = raw.get("space")
    if not isinstance(raw_space, dict) or not raw_space:
        problems.append("space: give at least one key to vary, e.g. space: {adapter.r: {grid: [8, 16]}}")
        raw_space = {}
    for key, spec in raw_space.items():
        if key not in config_keys and key not in VIRTUAL_KEYS:
            close = difflib.get_close_matches(str(key), sorted(config_keys | set(VIRTUAL_KEYS)), n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]}?" if close else "; use a dotted job config key such as adapter.r"
            problems.append(f"space.{key}: not a job config key{hint}")
            continue
        if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in KINDS:
            problems.append(f"space.{key}: write one of {{grid: [...]}}, {{choice: [...]}}, {{uniform: [low, high]}}, "
                            "{loguniform: [low, high]}, {randint: [low, high]}")
            continue
        kind, values = next(iter(spec.items()))
        if not isinstance(values, list) or not values:
            problems.append(f"space.{key}.{kind}: needs a non-empty list")
            continue
        if kind in ("uniform", "loguniform", "randint"):
            ok = len(values) == 2 and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values) and values[0] < values[1]
            if not ok or (kind == "loguniform" and values[0] <= 0) or (kind == "randint" and not all(isinstance(v, int) for v in values)):
                problems.append(f"space.{key}.{kind}: needs [low, high] with low < high"
                                + (" and low > 0" if kind == "loguniform" else "") + (", integers" if kind == "randint" else ""))
                continue
        if key == "deepspeed.zero":
            values = [str(v) for v in values]
            bad = [v for v in values if str(v) not in ZERO_KEYS]
            if bad:
                problems.append(f"space.deepspeed.zero: {bad} are not options; choose from {', '.join(ZERO_KEYS)}")
                continue
        space.append(Dimension(str(key), kind, tuple(values)))
    keys = [d.key for d in space]
    if "deepspeed.zero" in keys and {"deepspeed.stage", "deepspeed.offload_optimizer", "deepspeed.offload_param"} & set(keys):
        problems.append("space: deepspeed.zero already sets deepspeed.stage and offload; vary one or the other")
    search = choice("search", "grid", ("grid", "random", "optuna"))
    if search == "optuna" and any(d.kind == "grid" for d in space):
        problems.append("search: optuna samples its own points; write the grid dimensions as {choice: [...]}")
    if search == "random" and all(d.kind == "grid" for d in space) and space:
        problems.append("search: random with only grid dimensions is a grid; use search: grid, or {choice: [...]}")
    overrides = raw.get("set") or {}
    if not isinstance(overrides, dict):
        problems.append("set: a mapping of job config keys to values, e.g. set: {train.max_steps: 40}")
        overrides = {}
    for key in overrides:
        if key not in config_keys:
            problems.append(f"set.{key}: not a job config key")
    sweep = Sweep(
        name=name, space=tuple(space), metric=str(raw.get("metric", "train/loss")), mode=choice("mode", "min", ("min", "max")),
        search=search, num_samples=integer("num_samples", 1) or 1, scheduler=choice("scheduler", "none", ("none", "asha")),
        grace_period=integer("grace_period", 10) or 10, reduction_factor=integer("reduction_factor", 2, low=2) or 2,
        max_concurrent_trials=integer("max_concurrent_trials", None), batch=choice("batch", "keep_accum", ("keep_accum", "keep_global")),
        overrides=dict(overrides), seed=integer("seed", 0, low=0) or 0,
    )
    if problems:
        raise SweepError(problems)
    return sweep



def trial_config(base: SFTConfig, sweep: Sweep, params: dict[str, Any], run_name: str) -> SFTConfig:
    """The job config of one trial: ``base`` (the base job with the sweep's ``set``, from
    :func:`base_config`) with the trial's params, its own run name and a run folder inside the
    sweep's. Raises ConfigError."""
    values = dict(params)
    zero = values.pop("deepspeed.zero", None)
    if zero is not None:
        values.update(Option.parse(zero).values())
    if "train.micro_batch_size" in params and sweep.batch == "keep_global":
        per_step = base.train.micro_batch_size * base.train.grad_accum_steps
        micro = int(params["train.micro_batch_size"])
        if per_step % micro:
            raise ConfigError([f"train.micro_batch_size={micro}: batch: keep_global needs it to divide micro_batch_size × "
                               f"grad_accum_steps = {per_step} of the base job"])
        values["train.grad_accum_steps"] = per_step // micro
    values["run.name"] = run_name
    values["run.storage_path"] = f"{sweep_path(base, sweep)}/trial_runs"
    return base.with_values(values)



def base_config(base: SFTConfig, sweep: Sweep) -> SFTConfig:
    """The base job with the sweep's ``set`` applied: what every trial's config starts from."""
    return base.with_values(sweep.overrides)


def sweep_path(cfg: SFTConfig, sweep_name: Sweep | str) -> str:
    """The sweep's folder: Tune's experiment (trials, state for --resume) and the trials' run folders."""
    name = sweep_name.name if isinstance(sweep_name, Sweep) else sweep_name
    storage = cfg.run.storage_path if "://" in cfg.run.storage_path else str(Path(cfg.run.storage_path).expanduser().resolve())
    return f"{storage.rstrip('/')}/{name}"



def validate_space(base: SFTConfig, sweep: Sweep) -> list[dict[str, Any]]:
    """Build the config of every grid point (or of sampled points) from the base job (from
    :func:`base_config`), so a bad space fails before any trial starts. Returns the points
    checked; raises SweepError listing each bad one."""

    points = sweep.samples()
    problems = []
    for point in points:
        try:
            # The DeepSpeed JSON too (its bucket sizes need the model's width, not its validity).
            ds_config.resolve(trial_config(base, sweep, point, f"{sweep.name}-check"), {"hidden_size": 1024})
        except ConfigError as exc:
            label = ", ".join(f"{k}={v}" for k, v in point.items())
            problems.extend(f"trial {{{label}}}: {p}" for p in exc.problems)
    if problems:
        raise SweepError(sorted(set(problems)))
    return points



def save_definition(path: str, base: SFTConfig, sweep: Sweep) -> None:
    from pyarrow import fs

    filesystem, root = fs.FileSystem.from_uri(path if "://" in path else str(Path(path).resolve()))
    filesystem.create_dir(root, recursive=True)
    with filesystem.open_output_stream(f"{root}/{SAVED}") as f:
        f.write(yaml.safe_dump({"base": base.to_dict(), "sweep": sweep_dict(sweep)}, sort_keys=False, allow_unicode=True).encode())



def load_definition(path: str) -> tuple[SFTConfig, Sweep]:
    """The base job and sweep saved in the sweep folder ``path``; raises SweepError when there is none."""
    from pyarrow import fs

    filesystem, root = fs.FileSystem.from_uri(path if "://" in path else str(Path(path).resolve()))
    try:
        with filesystem.open_input_stream(f"{root}/{SAVED}") as f:
            saved = yaml.safe_load(f.read().decode())
    except (FileNotFoundError, OSError):
        raise SweepError([f"resume: no sweep at {path} (no {SAVED}); check the sweep's name and run.storage_path, "
                          "or start the sweep anew"]) from None
    base = SFTConfig.from_dict(saved["base"])
    return base, parse_sweep(saved["sweep"], set(base.flat()))



def sweep_dict(sweep: Sweep) -> dict[str, Any]:
    return {"name": sweep.name, "metric": sweep.metric, "mode": sweep.mode, "search": sweep.search, "num_samples": sweep.num_samples,
            "scheduler": sweep.scheduler, "grace_period": sweep.grace_period, "reduction_factor": sweep.reduction_factor,
            "batch": sweep.batch, "set": sweep.overrides, "space": {d.key: {d.kind: list(d.values)} for d in sweep.space},
            "seed": sweep.seed, **({"max_concurrent_trials": sweep.max_concurrent_trials} if sweep.max_concurrent_trials else {})}
