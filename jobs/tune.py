"""A Ray Tune sweep of SFT jobs: each trial is one zerolab run (a child MLflow run under the sweep's
parent run); a ranked results table, CSV/Markdown and a chart at the end.

    python jobs/tune.py                                                  # default: ZeRO stage × adapter.r, 4 trials, tiny model
    ray job submit --working-dir . -- python jobs/tune.py --config jobs/configs/math_tiny.yaml --space jobs/configs/stage_sweep.yaml
    python jobs/tune.py --space jobs/configs/stage_sweep.yaml --set scaling.num_workers=1
    python jobs/tune.py --resume stage-sweep                             # continue an interrupted sweep

The sweep file's format is in zerolab/tune.py and docs/sweeps.md. Exit codes: 0 the sweep ran (failed
trials are reported in the table), 2 a bad sweep file or job config (nothing ran), 130 interrupted
by SIGINT or SIGTERM (the job prints the command that resumes it).
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bootstrap  # noqa: E402,F401  (makes zerolab importable from a checkout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="base job YAML (default: the embedded default job)")
    parser.add_argument("--space", help="sweep YAML (default: ZeRO stage × adapter.r on the base job)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override of the base job, e.g. --set scaling.num_workers=1")
    parser.add_argument("--resume", metavar="NAME", help="resume the sweep NAME from its folder in run.storage_path")
    parser.add_argument("--out", help="folder for results.csv/.md and runs.png (default: sweeps/<name>)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")

    from zerolab import tune
    from zerolab.cli import INTERRUPTED, USER_ERROR
    from zerolab.config import load_config
    from zerolab.errors import UserError
    from zerolab.sweep import DEFAULT_SWEEP, base_config, load_definition, load_sweep, parse_sweep, sweep_path
    from zerolab.tracking import mask_text

    command = sys.argv if argv is None else ["jobs/tune.py", *argv]
    base, sweep = None, None
    try:
        base = load_config(args.config, args.set)
        if args.resume:
            base, sweep = load_definition(sweep_path(base, args.resume))
        elif args.space:
            sweep = load_sweep(args.space, set(base.flat()))
        else:
            sweep = parse_sweep(DEFAULT_SWEEP, set(base.flat()))
        rows = tune.run_sweep(base, sweep, resume=bool(args.resume), out_dir=args.out)
    except UserError as exc:
        print(f"\nerror: {exc}", file=sys.stderr)
        return USER_ERROR
    except KeyboardInterrupt:
        resume = _resume_command(command, args, sweep.name) if sweep and tune.resumable(base, sweep) else shlex.join(_python(command))
        print(mask_text(f"\ninterrupted\nresume: {resume}"), file=sys.stderr)
        return INTERRUPTED
    from zerolab.compare import text_table

    print("\n" + text_table(*tune.results_table(rows, sweep)))
    print(f"\nwritten to {tune.results_dir(sweep, args.out)}/: results.csv, results.md and the chart runs.png")
    print(f"per-trial curves and HParams: tensorboard --logdir {mask_text(sweep_path(base_config(base, sweep), sweep))}")
    failed = [r for r in rows if r.status == "ERROR"]
    print(f"\n{len(rows)} trials: " + ", ".join(f"{n} {s.lower()}" for s in ("FINISHED", "STOPPED", tune.INTERRUPTED, "SKIPPED", "ERROR")
                                              if (n := sum(r.status == s for r in rows))))
    if failed:
        print("failed trials: " + "; ".join(f"{r.trial_id}: {r.note}" for r in failed))
    if any(r.status == tune.INTERRUPTED for r in rows):
        print(mask_text(f"\ninterrupted: the sweep stopped before its trials finished\nresume: {_resume_command(command, args, sweep.name)}"),
              file=sys.stderr)
        return INTERRUPTED
    return 0


def _python(command: list[str]) -> list[str]:
    return [sys.executable.rsplit("/", 1)[-1], *command]


def _resume_command(command: list[str], args: argparse.Namespace, name: str) -> str:
    """The job's command that continues the sweep ``name``: the same base job (its storage path
    holds the sweep), the sweep itself from its folder."""
    argv = [command[0], *(["--config", args.config] if args.config else []), *(a for s in args.set for a in ("--set", s)),
            *(["--out", args.out] if args.out else []), "--resume", name]
    return shlex.join(_python(argv))


if __name__ == "__main__":
    sys.exit(main())
