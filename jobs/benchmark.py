"""Benchmark zerolab against the seeds' recipe, a plain PyTorch + peft loop and TRL's SFTTrainer on this machine's GPUs.

    python jobs/benchmark.py --suite single-0.5b --suite single-7b --out results/h100
    python jobs/benchmark.py --suite scaling-7b --out results/h200x2 --max-minutes 9
    python jobs/benchmark.py --suite long-rows-7b --only rows32k --out results/h100  # long rows (docs/memory.md#long-rows)
    python jobs/benchmark.py --run zerolab-qwen2.5-7b-1gpu-z0-mb2 --out results/h100  # one run, by name
    python jobs/benchmark.py --suite trl-7b --out results/h100            # zerolab against TRL (pip install -e .[bench])
    python jobs/benchmark.py --suite cpu-smoke --out /tmp/bench           # the harness itself, on CPU
    python jobs/benchmark.py --report results/*/benchmark.csv --out docs  # one table from several machines

In one invocation, on the same GPUs, data, model shape, adapter, precision and step count, it runs
zerolab's SFT job (Ray Train + DeepSpeed), zerolab's training step under bare torchrun, the seeds'
Hugging Face Trainer recipe (torchrun, samples padded to the maximum length), a plain PyTorch +
peft loop and TRL's SFTTrainer set up for speed, then prints and writes ``benchmark.csv`` /
``benchmark.md`` (tokens/s per GPU, step time, MFU, peak GPU and host memory, time to first step,
the rows trained on, ratios to the baselines and to TRL) with ``environment.json``
(machine and versions), ``checks.json`` (the kernels' correctness on this GPU) and
``bench_calibration.csv`` (the memory estimate next to each zerolab run's measured peaks). Not a Ray
job: it starts every system itself, each in a fresh process (bench/harness.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))

CHECKS_SHAPE = "qwen2.5-0.5b"


def main(argv: list[str] | None = None) -> int:
    from bench import harness
    from bench.calibrate_memory import COLUMNS as CALIBRATION_COLUMNS
    from bench.memory_trace import write_up

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", action="append", choices=sorted(harness.SUITES), default=[], help="runs to make (repeatable)")
    parser.add_argument("--only", action="append", default=[], help="only runs whose name contains this (repeatable)")
    parser.add_argument("--run", action="append", default=[], metavar="NAME",
                        help="a run of any suite by its exact name (repeatable; in the order given, after --suite's runs)")
    parser.add_argument("--out", type=Path, required=True, help="folder for the results")
    parser.add_argument("--work", type=Path, default=Path("/tmp/zerolab-bench"), help="models, data and run folders")
    parser.add_argument("--max-minutes", type=float, help="start no run after this many minutes")
    parser.add_argument("--skip-checks", action="store_true", help="do not run bench/gpu_checks.py first")
    parser.add_argument("--memory-trace", action="store_true",
                        help="zerolab runs: record the CUDA allocator's history (train.memory_snapshot_dir) and write what "
                             "holds the memory at the peak and why reserved exceeds allocated to <out>/<run>.memory.txt")
    parser.add_argument("--report", type=Path, nargs="+", metavar="CSV", help="no runs: merge these result files into <out>/benchmark.md")
    args = parser.parse_args(argv)

    args.out.mkdir(parents=True, exist_ok=True)
    if args.report:
        (args.out / "benchmark.md").write_text(harness.markdown_table(harness.read_csv(args.report)) + "\n")
        return 0
    start = time.monotonic()
    runs = [r for s in args.suite for r in harness.SUITES[s] if not args.only or any(o in r.name for o in args.only)]
    by_name: dict[str, harness.Run] = {}
    for suite in harness.SUITES.values():  # a name in several suites: the first one's settings
        for r in suite:
            by_name.setdefault(r.name, r)
    unknown = [n for n in args.run if n not in by_name]
    if unknown:
        parser.error(f"--run: no run named {', '.join(unknown)}; the runs: {', '.join(sorted(by_name))}")
    runs += [by_name[n] for n in args.run]
    if args.memory_trace:
        runs = [dataclasses.replace(r, traces=(*r.traces, "memory")) if r.system == "zerolab" else r for r in runs]
    ws = harness.Workspace(args.work)
    # The kernel checks train one batch with every weight trainable: the 0.5B shape whatever the runs'
    # (the 7B shape's full gradients and padded activations did not fit an 80 GB GPU).
    checks = any(r.shape != "tiny" for r in runs) and not args.skip_checks
    ws.prepare({r.shape for r in runs} | ({CHECKS_SHAPE} if checks else set()), {(r.row_tokens, r.long_rows) for r in runs})
    (args.out / "environment.json").write_text(json.dumps(harness.environment(), indent=1))
    log = open(args.out / "runs.log", "a")  # noqa: SIM115 (every run appends to it)
    if checks:
        subprocess.run([sys.executable, str(harness.REPO / "bench" / "gpu_checks.py"), "--model", ws.models[CHECKS_SHAPE],
                        "--data", str(ws.data), "--out", str(args.out / "checks.json")], stdout=log, stderr=subprocess.STDOUT)
    rows = []
    for run in runs:
        if args.max_minutes and time.monotonic() - start > 60 * args.max_minutes:
            print(f"--max-minutes {args.max_minutes:g} reached; not started: {run.name}", flush=True)
            continue
        log.flush()
        since = (args.out / "runs.log").stat().st_size
        row, calibration = harness.execute(run, ws, log)
        if "memory" in run.traces and run.system == "zerolab":
            write_up(harness.memory_snapshot_dir(run, ws), args.out / f"{run.name}.memory.txt")
        rows.append(row)
        if row["status"] != "ok":  # why, where the summary is read (a GPU host's files may not come back)
            log.flush()
            with open(args.out / "runs.log", "rb") as f:
                f.seek(since)
                print("\n".join(f.read().decode(errors="replace").splitlines()[-25:]), flush=True)
        harness.write_csv(args.out / "benchmark.csv", [row], harness.COLUMNS)
        if calibration:
            harness.write_csv(args.out / "bench_calibration.csv", [calibration], CALIBRATION_COLUMNS)
        print(f"{run.name}: {row['status']} {row.get('tokens_per_s_per_gpu', '')} tok/s/GPU, first step "
              f"{row.get('time_to_first_step_s', '')} s, GPU {row.get('gpu_peak_allocated_gib', '')} GiB, {row['wall_s']} s", flush=True)
    table = harness.markdown_table(rows)
    (args.out / "benchmark.md").write_text(table + "\n")
    print(table)
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
