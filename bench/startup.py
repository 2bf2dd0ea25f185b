"""Start-up figures on a GPU machine: how long from a command to the first optimizer step.

    python bench/startup.py --out results/h100-5/startup            # every case below, in this order
    python bench/startup.py --out /tmp/st --cases cold,torchrun     # some of them

Cases (0.5B shape on one GPU, 4 packed rows of ≤ 4,096 tokens per step, 20 steps; bench/harness.py's
model and data):

- ``cold-nocache``: ``run_sft`` in a fresh process with an empty tokenized-data cache (the data goes
  through Ray Data, which starts Ray);
- ``cold``: the same with the data cache warm (twice); one worker, so it trains in the job's own
  process (``scaling.launch=auto``) and starts no Ray;
- ``cold-workers``: ``cold`` with ``scaling.launch=workers`` (Ray Train's worker group), for comparison;
- ``torchrun``: zerolab's own training step under bare torchrun (no Ray, no MLflow) on the same
  config: the floor the others are compared with;
- ``warm-submit``: ``ray job submit --entrypoint-num-gpus 1`` to a ``ray start --head`` cluster that is
  already running (the job then trains in its own process), timed from the submit command's launch (twice: the
  cluster's first job, then another);
- ``warm-driver``: the job's driver joining that cluster directly (``RAY_ADDRESS=auto``), ``scaling.launch=driver``;
- ``warm-trainer``: three such drivers with ``scaling.keep_warm_s`` (``zerolab.warm``): the first
  starts the node's warm trainer, the next two train in it;
- ``sweep``: ``jobs/tune.py`` with 6 trials on one GPU (grid of ``adapter.r`` × ``train.lr``): each
  trial's start-up (its launch to its first step) and training time from the sweep's results.

Writes ``startup.csv`` (one row per run: time to first step, the job's own start-up line), the
sweep's ``results.csv`` and ``runs.log`` (every run's output) to ``--out``.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))

from bench import harness  # noqa: E402

CASES = ("cold-nocache", "cold", "cold-workers", "torchrun", "warm-submit", "warm-driver", "warm-trainer", "sweep")
RUN = harness.Run("zerolab", "qwen2.5-0.5b", micro_batch=4, steps=20, window=10, timeout_s=300)
CPU_RUN = harness.Run("zerolab", "tiny", micro_batch=2, steps=4, window=2, attn="sdpa", kernels="none", timeout_s=600)
STARTUP_LINE = re.compile(r"start-up: first optimizer step ([\d.]+) s after launch \((.*)\)")


def _startup_line(log_path: Path, since: int) -> str:
    text = log_path.read_text(errors="replace")[since:]
    found = STARTUP_LINE.findall(text)
    return found[-1][1] if found else ""


def _zerolab_cmd(run: harness.Run, ws: harness.Workspace, result: Path, name: str) -> list[str]:
    overrides = [o if not o.startswith("run.name=") else f"run.name=startup-{name}" for o in harness.zerolab_overrides(run, ws)]
    return [sys.executable, str(harness.REPO / "bench" / "zerolab_run.py"), "--out", str(result), *[a for o in overrides for a in ("--set", o)]]


def _timed(cmd: list[str], log_path: Path, env: dict[str, str], timeout: int) -> tuple[float, int | str]:
    with open(log_path, "a") as log:
        log.write(f"\n===== $ {' '.join(cmd)}\n")
        log.flush()
        launch = time.time()
        try:
            code: int | str = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=harness.REPO, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    return launch, code


def zerolab_case(run: harness.Run, name: str, ws: harness.Workspace, out: Path, env: dict[str, str],
                 prefix: list[str] | None = None) -> dict:
    log_path = out / "runs.log"
    result = ws.root / "results" / f"startup-{name}.json"
    result.parent.mkdir(parents=True, exist_ok=True)
    result.unlink(missing_ok=True)
    since = log_path.stat().st_size if log_path.exists() else 0
    launch, code = _timed([*(prefix or []), *_zerolab_cmd(run, ws, result, name)], log_path, env, run.timeout_s)
    wall = time.time() - launch
    row = {"case": name, "status": "ok" if code == 0 else f"failed ({code})", "wall_s": round(wall, 1)}
    if code == 0 and result.exists():
        m = json.loads(result.read_text())["metrics"]
        row.update(first_step_s=round(m["perf/first_step_unix"] - launch, 1), training_s=round(m.get("perf/wall_s", 0.0), 1), phases=_startup_line(log_path, since))
    return row


def torchrun_case(run: harness.Run, ws: harness.Workspace, out: Path) -> dict:
    with open(out / "runs.log", "a") as log:
        row, _ = harness.execute(replace(run, system="zerolab-torchrun"), ws, log)
    return {"case": "torchrun", "status": row["status"], "wall_s": row["wall_s"], "first_step_s": row.get("time_to_first_step_s", "")}


def with_overrides(run: harness.Run, *overrides: str) -> harness.Run:
    return replace(run, overrides=(*run.overrides, *overrides))


def warm_cases(run: harness.Run, ws: harness.Workspace, out: Path, env: dict[str, str], cases: set[str]) -> list[dict]:
    ray = shutil.which("ray") or "ray"
    rows = []
    # Submitted with its GPU reserved (--entrypoint-num-gpus), the job trains in its own process by
    # itself; a driver that joins the cluster directly has nothing reserved, so it is told to.
    gpus = ["--entrypoint-num-gpus", "1"] if "scaling.use_gpu=true" in harness.zerolab_overrides(run, ws) else []
    # `ray job submit` needs the dashboard's job server (ray[default]); where it cannot start, the
    # warm cluster is measured with the driver joining it directly.
    dashboard = "--include-dashboard=true" if "warm-submit" in cases and _has_dashboard() else "--include-dashboard=false"
    start = subprocess.run([ray, "start", "--head", "--disable-usage-stats", dashboard], env=env, capture_output=True, text=True)
    if "Token authentication is enabled" in start.stdout + start.stderr:
        env = {**env, "RAY_AUTH_MODE": "token"}  # `ray start` made the cluster's token (~/.ray/auth_token): drivers present it
    (out / "runs.log").open("a").write(f"\n===== ray start --head\n{start.stdout}\n{start.stderr}\n")
    if start.returncode != 0:
        return [{"case": "warm-*", "status": f"ray start failed ({start.returncode})"}]
    try:
        if "warm-submit" in cases and dashboard.endswith("true"):
            for i in (1, 2):
                rows.append(zerolab_case(run, f"warm-submit-{i}", ws, out, env,
                                         prefix=[ray, "job", "submit", "--address", "http://127.0.0.1:8265", *gpus, "--"]))
        if "warm-driver" in cases:
            rows.append(zerolab_case(with_overrides(run, "scaling.launch=driver"), "warm-driver", ws, out, {**env, "RAY_ADDRESS": "auto"}))
        if "warm-trainer" in cases:
            for i in (1, 2, 3):
                rows.append(zerolab_case(with_overrides(run, "scaling.keep_warm_s=120"), f"warm-trainer-{i}", ws, out,
                                         {**env, "RAY_ADDRESS": "auto"}))
    finally:
        subprocess.run([ray, "stop", "--force"], env=env, capture_output=True)
    return rows


def _has_dashboard() -> bool:
    import importlib.util

    return all(importlib.util.find_spec(m) for m in ("aiohttp", "aiohttp_cors"))


def sweep_case(run: harness.Run, ws: harness.Workspace, out: Path, env: dict[str, str]) -> list[dict]:
    space = ws.root / "startup_space.yaml"
    space.write_text("name: startup-sweep\nsearch: grid\nspace:\n  adapter.r: {grid: [8, 16, 32]}\n  train.lr: {grid: [1.0e-4, 2.0e-4]}\n")
    shutil.rmtree(ws.root / "runs" / "startup-sweep", ignore_errors=True)
    overrides = [o for o in harness.zerolab_overrides(run, ws) if not o.startswith(("run.name=", "adapter.r="))]
    cmd = [sys.executable, str(harness.REPO / "jobs" / "tune.py"), "--space", str(space), "--out", str(out / "sweep"),
           *[a for o in overrides for a in ("--set", o)]]
    launch, code = _timed(cmd, out / "runs.log", env, 540)
    wall = time.time() - launch
    rows = [{"case": "sweep", "status": "ok" if code == 0 else f"failed ({code})", "wall_s": round(wall, 1)}]
    results = out / "sweep" / "results.csv"
    if results.exists():
        for r in csv.DictReader(results.open()):
            rows.append({"case": f"sweep-trial {r.get('trial', r.get('trial_id', ''))}", "status": r.get("status", ""),
                         "first_step_s": r.get("startup_s", ""), "training_s": r.get("training_s", ""), "wall_s": r.get("wall_s", "")})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path("/tmp/zerolab-bench"))
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)}")
    parser.add_argument("--cpu", action="store_true", help="the script itself on CPU: the tiny model, 4 steps")
    args = parser.parse_args(argv)
    run = CPU_RUN if args.cpu else RUN
    cases = set(args.cases.split(","))
    args.out.mkdir(parents=True, exist_ok=True)
    ws = harness.Workspace(args.work)
    ws.prepare({run.shape})
    env = harness.subprocess_env()
    rows: list[dict] = []

    def record(new: list[dict]) -> None:
        rows.extend(new)
        for r in new:
            print(json.dumps(r), flush=True)

    if "cold-nocache" in cases:
        from zerolab import cache_dir

        shutil.rmtree(cache_dir() / "tokenized", ignore_errors=True)
        record([zerolab_case(run, "cold-nocache", ws, args.out, env)])
    if "cold" in cases:
        record([zerolab_case(run, f"cold-{i}", ws, args.out, env) for i in (1, 2)])
    if "cold-workers" in cases:
        record([zerolab_case(with_overrides(run, "scaling.launch=workers"), "cold-workers", ws, args.out, env)])
    if "torchrun" in cases:
        record([torchrun_case(run, ws, args.out)])
    if cases & {"warm-submit", "warm-driver", "warm-trainer"}:
        record(warm_cases(run, ws, args.out, env, cases))
    if "sweep" in cases:
        record(sweep_case(run, ws, args.out, env))
    columns = ["case", "status", "first_step_s", "training_s", "wall_s", "phases"]
    with open(args.out / "startup.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    return 0 if all(r["status"] in ("ok", "FINISHED", "TERMINATED") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
