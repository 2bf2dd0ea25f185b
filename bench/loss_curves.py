"""Two runs' training-loss curves side by side, from the MLflow store the benchmark writes, with the
relative difference at every logged step and over the last quarter of the run.

    python bench/loss_curves.py --mlruns /tmp/zerolab-bench/mlruns \\
        --run bench-zerolab-qwen2_5-0_5b-1gpu-z0-bf16-curve --run bench-zerolab-qwen2_5-0_5b-1gpu-z0-fp8-curve --out curves.md

The first run is the reference: differences are (other − reference) / reference.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path


def curves(tracking_uri: str, names: list[str], metric: str = "train/loss") -> dict[str, dict[int, float]]:
    """{run name: {step: value}} for the latest run of each name in any experiment of the store."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    experiments = [e.experiment_id for e in client.search_experiments()]
    out = {}
    for name in names:
        runs = client.search_runs(experiments, f"attributes.run_name = '{name}'", order_by=["attributes.start_time DESC"], max_results=1)
        if not runs:
            raise SystemExit(f"no run named {name} in {tracking_uri}")
        out[name] = {m.step: m.value for m in client.get_metric_history(runs[0].info.run_id, metric)}
    return out


def compare(reference: dict[int, float], other: dict[int, float]) -> tuple[list[tuple[int, float, float, float]], float, int]:
    """Per common step (step, reference, other, relative difference), the relative difference of
    the two curves' means over their last quarter of common steps, and how many steps that is."""
    steps = sorted(reference.keys() & other.keys())
    rows = [(s, reference[s], other[s], (other[s] - reference[s]) / reference[s]) for s in steps]
    tail = steps[-max(1, len(steps) // 4):]
    ref_tail, other_tail = statistics.fmean(reference[s] for s in tail), statistics.fmean(other[s] for s in tail)
    return rows, (other_tail - ref_tail) / ref_tail, len(tail)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mlruns", type=Path, required=True, help="the MLflow file store (the benchmark's <work>/mlruns)")
    parser.add_argument("--run", action="append", required=True, help="run name; twice, the reference first")
    parser.add_argument("--metric", default="train/loss")
    parser.add_argument("--out", type=Path, help="also write the table here (Markdown)")
    args = parser.parse_args(argv)
    if len(args.run) != 2:
        parser.error("give --run twice: the reference, then the run to compare")
    found = curves(f"file://{args.mlruns.resolve()}", args.run, args.metric)
    rows, tail, n_tail = compare(found[args.run[0]], found[args.run[1]])
    lines = [f"| step | {args.run[0]} | {args.run[1]} | difference |", "|---|---|---|---|"]
    lines += [f"| {s} | {a:.4f} | {b:.4f} | {d:+.2%} |" for s, a, b, d in rows]
    lines.append(f"\nLast quarter of the run ({n_tail} logged points), mean {args.metric}: {tail:+.2%}")
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
