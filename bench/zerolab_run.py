"""One zerolab SFT run as ``jobs/sft.py`` makes it (``zerolab.run.run_sft``, or in a warm trainer), its metrics written as JSON.

    python bench/zerolab_run.py --out result.json --set model.name_or_path=... --set data.packing=true ...

The benchmark starts each run in a fresh process, so that its time to the first step counts what
a user waits for: Python imports, Ray's start, data preparation with Ray Data, the workers' start,
model load and ``deepspeed.initialize``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--set", action="append", default=[])
    args = parser.parse_args(argv)
    # The driver's steps with their times, for the time to first step (the workers log their own).
    logging.basicConfig(level=logging.INFO, format="%(asctime)s.%(msecs)03d %(name)s %(message)s", datefmt="%H:%M:%S")

    from bench.measure import GcClock

    from zerolab.config import load_config
    from zerolab.run import run_sft
    from zerolab.warm import run_sft_warm, wanted

    gc_clock = GcClock()  # counts the steps' collections where they run in this process (one worker, in the driver)
    cfg = load_config(None, args.set)
    result = (run_sft_warm if wanted(cfg) else run_sft)(cfg, restart=True)  # a fresh run, never a resumed one
    gc_seen = gc_clock.summary(result.metrics.get("perf/first_step_unix") or 0.0)
    args.out.write_text(json.dumps({"metrics": result.metrics, "data": result.data, "gc": gc_seen}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
