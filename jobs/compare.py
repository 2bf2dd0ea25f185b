"""Compare MLflow runs side by side without the UI: each run named by the values that differ between
them (e.g. ``ZeRO-3 + offload, r=16``), key params next to tokens/s, peak GPU and host memory,
GPU/CPU utilisation, wall time with start-up and training apart, final loss and eval metrics; a PNG
chart of the same (loss curves, throughput, memory, wall time, utilisation) and the table as CSV
and Markdown.

    python jobs/compare.py --experiment zerolab
    python jobs/compare.py --experiment zerolab --parent stage-sweep     # the child runs of a Tune sweep
    python jobs/compare.py --experiment zerolab --out reports/today --tracking-uri http://127.0.0.1:5000

Reads the same store the jobs write (``--tracking-uri``, else $MLFLOW_TRACKING_URI, else
~/zerolab_runs/mlflow.db). Exit code 2 when the experiment or parent run does not exist.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bootstrap  # noqa: E402,F401  (makes zerolab importable from a checkout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experiment", default="zerolab", help="MLflow experiment (default: zerolab)")
    parser.add_argument("--parent", help="only the child runs of this parent run (name or id), e.g. a Tune sweep")
    parser.add_argument("--tracking-uri", help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else ~/zerolab_runs/mlflow.db, beside the runs)")
    parser.add_argument("--out", help="folder for runs.csv, runs.md and runs.png (default: compare/<experiment>[/<parent>])")
    args = parser.parse_args(argv)

    from zerolab import compare, tracking
    from zerolab.cli import USER_ERROR

    uri = tracking.tracking_uri(args.tracking_uri)
    try:
        rows = compare.collect(uri, args.experiment, args.parent)
    except compare.CompareError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return USER_ERROR
    out = Path(args.out) if args.out else Path("compare") / args.experiment / (args.parent or "")
    paths = compare.write(rows, out)
    print(compare.text_table(*compare.table(rows)))
    print(f"\n{len(rows)} runs; written {paths['csv']}, {paths['md']}, {paths['png']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
