"""Supervised fine-tuning of a causal LM as a Ray Train job with DeepSpeed workers.

    ray job submit --working-dir . -- python jobs/sft.py --config jobs/configs/math_tiny.yaml --set adapter.r=16
    python jobs/sft.py        # embedded default: tiny Qwen2 on math_sum, 2 CPU workers, ZeRO-2, ~2 minutes

Each launch is a new run unless run.name names one: an unfinished run resumes from its last good checkpoint,
a finished one is left as it is (say so with a new name, --restart, or more train.max_steps). Ctrl-C
checkpoints and stops, and prints the command that resumes. Before launching, the memory estimator checks the
job fits the nodes' GPUs and RAM (--force skips the refusal).
Exit codes: 0 done, 1 training failed, 2 bad configuration, data, run folder, environment or memory (nothing
ran), 3 stopped at run.max_wall_time_s (resumable), 130 stopped by Ctrl-C/SIGTERM (resumable).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bootstrap  # noqa: E402,F401  (makes zerolab importable from a checkout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="job YAML (default: the embedded default job)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. --set adapter.r=16")
    parser.add_argument("--restart", action="store_true", help="discard an existing run of this name (and its checkpoints) and start over")
    parser.add_argument("--force", action="store_true", help="launch even when the memory preflight says the job cannot fit")
    parser.add_argument("--accept-changed-data", action="store_true",
                        help="resume a run whose data files changed since it began (refused otherwise)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")

    from zerolab.cli import REMEDIES, run_job
    from zerolab.clock import process_start_time
    from zerolab.cluster import shutdown_ray
    from zerolab.config import load_config
    from zerolab.run import run_sft
    from zerolab.warm import run_sft_warm, wanted

    def job() -> object:
        cfg = load_config(args.config, args.set)
        launched = process_start_time() if argv is None else None
        return (run_sft_warm if wanted(cfg) else run_sft)(cfg, config_file=args.config, restart=args.restart, force=args.force,
                                                           launched=launched, accept_changed_data=args.accept_changed_data)

    try:
        code, message = run_job(job, command=sys.argv if argv is None else ["jobs/sft.py", *argv], remedies=REMEDIES)
    finally:
        shutdown_ray()
    print(message, file=sys.stdout if code == 0 else sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
