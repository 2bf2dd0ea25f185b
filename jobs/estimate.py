"""Estimate a job's memory per GPU and per node for every ZeRO stage × offload option, before launching.

    python jobs/estimate.py --config jobs/configs/math_qwen2.5_7b_lora.yaml
    python jobs/estimate.py --config jobs/configs/math_qwen2.5_7b_lora.yaml --gpus 1 --gpu-mem 24GiB --host-mem 64GiB
    python jobs/estimate.py --config jobs/configs/math_qwen2.5_7b_lora.yaml --stages 0,3 --offload none,all --set adapter.r=16
    python jobs/estimate.py --config jobs/configs/math_qwen2.5_7b_lora.yaml --data
    python jobs/estimate.py --config jobs/configs/math_qwen2.5_7b_lora.yaml --gpus 1 --gpu-mem 80GiB --longest-row

Reads the model's config only (no weights; a hub id needs the config in the local cache or the
network) and starts nothing. Without --gpus/--gpu-mem/--host-mem it checks against this machine.
By default every micro-batch is taken at its worst case by config (micro_batch_size ×
data.max_seq_length tokens); --data tokenizes the job's data here (its files, or the task's
generated rows; no Ray) and estimates the largest micro-batch the workers' shards will make, as
the preflight of `jobs/sft.py` does, showing the worst case by config next to it. A config with
data.max_seq_length: auto takes its length from the data, so the data is tokenized for it in any
case (the worst case by config is then micro_batch_size × the resolved length). With the
recommended option it also names the largest micro-batch that fits (most tokens per forward pass:
what ZeRO-3 needs most, its gathers cost per micro-batch, not per token), and the longest row that
fits (data.max_seq_length at micro-batch 1, packed); --longest-row adds the settings that make a
longer one fit and how long each allows.
Exit codes: 0 a config fits (the job's own option or another one), 1 nothing fits, 2 bad
configuration or model.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bootstrap  # noqa: E402,F401  (makes zerolab importable from a checkout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="job YAML (default: the embedded default job)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. --set adapter.r=16")
    parser.add_argument("--gpus", type=int, help="GPUs per node of the planned machine")
    parser.add_argument("--gpu-mem", help="memory of each GPU of the planned machine, e.g. 24GiB or 80GB")
    parser.add_argument("--host-mem", help="host RAM per node of the planned machine, e.g. 64GiB")
    parser.add_argument("--nodes", type=int, default=1, help="nodes of the planned machine (default 1)")
    parser.add_argument("--stages", help="comma-separated ZeRO stages to show (default: all)")
    parser.add_argument("--offload", help="comma-separated offload modes to show: none, optimizer, all (default: all)")
    parser.add_argument("--data", action="store_true", help="estimate on the job's data (tokenizes it here) instead of the worst case by config")
    parser.add_argument("--longest-row", action="store_true", help="also name the settings that make a longer row fit, with how long each allows")
    args = parser.parse_args(argv)

    from zerolab.cli import USER_ERROR
    from zerolab.config import ConfigError, load_config
    from zerolab.data import DataError, resolve_max_seq_length
    from zerolab.memory import (
        MemoryEstimateError,
        Option,
        format_longest_row,
        format_table,
        largest_micro_batch,
        longer_row_settings,
        longest_row,
        plan_options,
        recommend,
        worst_case_by_config,
    )
    from zerolab.memory.shapes import max_position_embeddings, rope_scaling_fix
    from zerolab.models import ModelLoadError, load_model_config

    try:
        cfg = load_config(args.config, args.set)
        limits = _limits(args)
        options = _options(args.stages, args.offload)
        model_config = load_model_config(cfg.model)
        data = splits = None
        auto = cfg.data.max_seq_length == "auto"
        if args.data or auto:
            from zerolab.cluster import connect_ray
            from zerolab.data import needs_ray_data
            from zerolab.models import resolve_model_path
            from zerolab.plan import prepare_data, shard_lengths

            if needs_ray_data(cfg):
                connect_ray(cfg)
            splits = prepare_data(cfg, resolve_model_path(cfg.model.name_or_path))
            cfg = resolve_max_seq_length(cfg, splits)
            data = shard_lengths(splits, cfg.data_parallel_size()) if args.data else None
        rows = plan_options(cfg, model_config, limits, options=options, data=data)
        rec = recommend(cfg, model_config, limits, rows=rows, data=data)
    except (ConfigError, ModelLoadError, MemoryEstimateError, DataError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return USER_ERROR

    own = Option.of(cfg)
    shown = next((r for r in rows if r.estimate is not None), None)
    if shown is None:
        print("error: none of the selected options is allowed for this config:", file=sys.stderr)
        for row in rows:
            print(f"  {row.option.label}: {row.invalid}", file=sys.stderr)
        return USER_ERROR
    est = shown.estimate
    print(f"model      {cfg.model.name_or_path}: {est.shape.describe()}")
    print(f"training   {cfg.adapter.method} ({est.trainable_params:,} trainable), {est.precision}, {est.batch.describe()}, "
          f"{'gradient checkpointing, ' if est.gradient_checkpointing else ''}{est.world_size} {'GPU' if est.use_gpu else 'CPU'} worker(s)")
    if auto:
        print(f"length     data.max_seq_length: auto -> {cfg.data.max_seq_length} (the data's longest row, rounded up)")
    print(f"machine    {limits.describe()}")
    print()
    print(format_table(rows, limits))
    for note in sorted({n for r in rows if r.estimate for n in r.estimate.notes}):
        print(f"note: {note}")
    print()
    own_row = next((r for r in rows if r.option == own), None)
    if own_row is not None and own_row.fit is not None:
        print(f"this config ({own.label}): {own_row.fit.verdict} — {'; '.join(own_row.fit.reasons)}")
        by_config = worst_case_by_config(cfg, model_config, own_row.estimate, limits) if own_row.estimate else None
        if by_config:
            print(f"  {by_config}")
    option = rec.option if rec is not None else own
    row_cfg = load_config(args.config, [*args.set, *(rec.overrides if rec is not None else ())])
    if not (limits.gpu_mem_bytes if cfg.scaling.use_gpu else limits.host_mem_bytes):
        print("longest row: not searched (the memory it must fit is unknown: give --gpu-mem, or --host-mem for CPU workers)")
    else:
        tokens = longest_row(row_cfg, model_config, limits, option, multiple=ROW_MULTIPLE)
        longer = longer_row_settings(row_cfg, model_config, limits, option, multiple=ROW_MULTIPLE) if args.longest_row else None
        print(format_longest_row(tokens, option, multiple=ROW_MULTIPLE, max_positions=max_position_embeddings(model_config, cfg.model),
                                 longer=longer, rope_fix=rope_scaling_fix(tokens, model_config, cfg.model) if tokens else (),
                                 split=cfg.scaling.sequence_parallel_size))
    if rec is None:
        print("recommendation: nothing fits, not even micro-batch 1 with gradient checkpointing; use more or larger GPUs, "
              "shorten data.max_seq_length, or train an adapter instead of the full model")
        return 1
    overrides = [*rec.overrides, *rec.option.overrides()]
    print(f"recommendation: {rec.reason}")
    print(f"  run it with: --set {' --set '.join(overrides)}")
    chosen = load_config(args.config, [*args.set, *rec.overrides])
    if splits is not None:
        chosen = resolve_max_seq_length(chosen, splits)
    batch = largest_micro_batch(chosen, model_config, limits, rec.option, data=data)
    if batch is not None:
        print(f"most tokens per micro-batch with {rec.option.label}: --set train.micro_batch_size={batch} "
              f"(the largest that fits outside the estimate's 10% margin; the global batch grows with it)")
    return 0


ROW_MULTIPLE = 1024
"""The longest row is searched in multiples of this many tokens."""


def _limits(args: argparse.Namespace):  # -> zerolab.memory.Limits
    from zerolab.config import ConfigError
    from zerolab.memory import Limits, parse_size

    planned = args.gpus is not None or args.gpu_mem is not None or args.host_mem is not None
    if not planned:
        return Limits.detect()
    problems, sizes = [], {}
    for flag, text in (("--gpu-mem", args.gpu_mem), ("--host-mem", args.host_mem)):
        if text is not None:
            try:
                sizes[flag] = parse_size(text)
            except ValueError as exc:
                problems.append(f"{flag}: {exc}")
    if args.gpus is not None and args.gpus < 0:
        problems.append(f"--gpus: {args.gpus} is not allowed; give the number of GPUs per node (0 or more)")
    if args.nodes < 1:
        problems.append(f"--nodes: {args.nodes} is not allowed; give 1 or more")
    if problems:
        raise ConfigError(problems)
    return Limits(gpu_mem_bytes=sizes.get("--gpu-mem"), gpus_per_node=args.gpus, host_mem_bytes=sizes.get("--host-mem"),
                  num_nodes=args.nodes, source="planned")


def _options(stages: str | None, offload: str | None):  # -> list[zerolab.memory.Option]
    from zerolab.config import ConfigError
    from zerolab.memory import ALL_OPTIONS

    problems = []
    wanted_stages = wanted_offload = None
    if stages:
        try:
            wanted_stages = {int(s) for s in stages.split(",")}
        except ValueError:
            wanted_stages = set()
        if not wanted_stages or not wanted_stages <= {0, 1, 2, 3}:
            problems.append(f"--stages: {stages!r} is not a list of ZeRO stages; use e.g. 0,2,3")
    if offload:
        wanted_offload = set(offload.split(","))
        if not wanted_offload <= {"none", "optimizer", "all"}:
            problems.append(f"--offload: {offload!r} is not a list of none, optimizer, all; use e.g. none,all")
    if problems:
        raise ConfigError(problems)
    return [o for o in ALL_OPTIONS if (wanted_stages is None or o.stage in wanted_stages)
            and (wanted_offload is None or o.offload in wanted_offload)]


if __name__ == "__main__":
    sys.exit(main())
