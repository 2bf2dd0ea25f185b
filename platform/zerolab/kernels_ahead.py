"""The first optimizer step's Triton kernels compiled ahead, in a process beside the job's start-up.

A job's first step on a machine whose Triton cache lacks its kernels (a fresh container or node, a
new version of a kernel) compiles them: Liger's norm, RoPE and fused-loss kernels and zerolab's
SwiGLU kernels, about 6 s of a 7B job's first step on an H100 host, 2.6 s of it waiting for
``ptxas`` (docs/benchmark.md, "What a first launch spends"). Triton keeps what it compiles in its
cache directory, keyed by the kernel's source and the specialisation of its arguments (dtypes,
which integers are 1 or multiples of 16, the constants), and any process launching the same kernel
with arguments of the same specialisation loads it from there instead of compiling it.

Where the job's own process trains on a GPU (one worker, Ray Train's local mode), :func:`start`
starts a second Python process as the job starts, which imports the training stack beside the
job's own imports and then waits. The job tells it how much GPU memory it may take beside the
job once the memory estimate is made (:func:`allow`: the GPU's memory less the estimate's reserved
peak and a margin), and the worker hands it its first micro-batch once it has planned them
(:func:`feed`). The process then builds the job's model with the job's own code
(:func:`zerolab.engine.build_model`) cut to one decoder layer (same widths, kernels and adapter;
fresh weights, none read), runs the micro-batch forward and backward, and exits. Before its first
step the worker waits for it (:func:`wait`); one still importing by then is stopped, and the step
compiles what it needs itself, as without it.

Nothing the job computes changes: its kernels come from the same sources, and the cache serves
only exact matches. The process's failures are logged and cost nothing else.
"""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from zerolab.batches import MicroBatches
    from zerolab.config import SFTConfig
    from zerolab.plan import MemoryCheck

logger = logging.getLogger(__name__)

MARGIN_BYTES = 2 * 2**30
"""GPU memory left free between the job's estimated reserved peak and what the process may take."""

WAIT_S = 120.0
"""The longest a worker waits for a process that is compiling before it compiles the rest itself."""

_STAGES = ("imported", "building", "done", "skipped")
"""What the process says, a line each, in order ("skipped" with the reason after it)."""


def wanted(cfg: SFTConfig, *, in_tune: bool) -> bool:
    """Whether a job compiles its first step's kernels ahead: it trains in its own process on a GPU
    (one worker; not a Tune trial, whose trials share one node's cache), its first step launches
    Triton kernels (``model.kernels`` on with Liger installed, or ``model.fp8``), and the model is
    built as this module builds it (ZeRO 0-2, not quantized, layers not compiled, no sequence
    parallelism)."""
    import importlib.util

    from zerolab.cluster import may_train_in_driver

    m = cfg.model
    triton_kernels = (m.kernels != "none" and importlib.util.find_spec("liger_kernel") is not None) or m.fp8
    return (not in_tune and may_train_in_driver(cfg) and cfg.scaling.use_gpu and triton_kernels and cfg.deepspeed.stage < 3
            and m.quantization == "none" and not m.compile and cfg.scaling.sequence_parallel_size == 1
            and importlib.util.find_spec("triton") is not None)


class _Compiler:
    """The compiling process and what it said (one stage per line of its standard output)."""

    def __init__(self, cfg: SFTConfig) -> None:
        self.started = time.perf_counter()
        self.folder = Path(tempfile.mkdtemp(prefix="zerolab-kernels-"))
        (self.folder / "config.pkl").write_bytes(pickle.dumps(cfg))
        self.errors = (self.folder / "stderr.txt").open("wb")
        # This zerolab, wherever this process found it.
        path = os.pathsep.join(p for p in (str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen([sys.executable, "-m", "zerolab.kernels_ahead", str(self.folder)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.errors, env={**os.environ, "PYTHONPATH": path})
        self.stage, self.said = "started", ""
        self.budget: int | None = None
        self.fed = False
        self.changed = threading.Condition()
        self.listener = threading.Thread(target=self._listen, name="zerolab-kernels-ahead", daemon=True)
        self.listener.start()

    def _listen(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            stage, _, said = raw.decode(errors="replace").strip().partition(" ")
            if stage not in _STAGES:
                continue
            with self.changed:
                self.stage, self.said = stage, said
                self.changed.notify_all()
        with self.changed:
            if self.stage not in ("done", "skipped"):
                self.stage = "failed"
            self.changed.notify_all()

    def send(self, line: str) -> None:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(line.encode() + b"\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass

    def reason(self) -> str:
        if self.said:
            return self.said
        self.errors.flush()
        lines = (self.folder / "stderr.txt").read_text(errors="replace").strip().splitlines()
        return lines[-1][:300] if lines else f"exit status {self.proc.poll()}"

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.listener.join(timeout=10)
        for stream in (self.proc.stdin, self.proc.stdout, self.errors):
            if stream is not None:
                stream.close()
        for path in self.folder.iterdir():
            path.unlink()
        self.folder.rmdir()


_compiler: _Compiler | None = None
"""This process's compiling process, from :func:`start` until :func:`stop`."""
_started_once = False


def start(cfg: SFTConfig, *, in_tune: bool = False) -> None:
    """Start the compiling process where :func:`wanted`; once per process (a process that trains
    again finds its kernels compiled in memory)."""
    global _compiler, _started_once
    if _started_once or not wanted(cfg, in_tune=in_tune):
        return
    _started_once = True
    try:
        _compiler = _Compiler(cfg)
    except OSError as exc:
        logger.info("the first step's kernels are not compiled ahead: %s", exc)


def allow(memory: MemoryCheck) -> None:
    """The GPU memory the process may take beside the job: the GPU's less the estimate's reserved
    peak and :data:`MARGIN_BYTES`; none without an estimate."""
    est, limits = memory.estimate, memory.limits
    if _compiler is not None and est is not None and limits is not None and limits.gpu_mem_bytes:
        _compiler.budget = max(0, int(limits.gpu_mem_bytes - est.device_reserved - MARGIN_BYTES))


def feed(batches: MicroBatches, total_steps: int) -> None:
    """Hand the process the worker's first micro-batch of its first epoch (and the run's step count,
    which AdaLoRA's schedule takes); it stops where :func:`allow` gave it no memory."""
    c = _compiler
    if c is None or c.fed:
        return
    c.fed = True
    if not c.budget:
        c.send("")
        return
    import torch

    first = batches.collate(batches.epoch_plan(0)[0])
    path = c.folder / "batch.pt"
    torch.save({"inputs": first.inputs, "num_targets": first.num_targets, "total_steps": total_steps}, path)
    c.send(f"{c.budget} {path}")


def wait() -> None:
    """Before the worker's first step: wait for a process that is compiling (at most
    :data:`WAIT_S`), and stop it either way."""
    c = _compiler
    if c is None or not c.fed:
        return
    began = time.perf_counter()
    with c.changed:
        if c.stage in ("imported", "building"):  # fed: building now, or about to
            c.changed.wait_for(lambda: c.stage in ("done", "skipped", "failed"), timeout=WAIT_S)
        stage = c.stage
    waited = time.perf_counter() - began
    if stage == "done":
        logger.info("the first step's kernels compiled ahead in a process of their own (done %.1f s after the job started; "
                    "waited %.1f s for it)", time.perf_counter() - c.started, waited)
    elif stage in ("started", "imported", "building"):
        logger.info("the first step's kernels: the process compiling them ahead was %s; the first step compiles them",
                    "still importing" if stage == "started" else f"not done after {waited:.0f} s")
    else:
        logger.info("the first step's kernels were not compiled ahead (%s); the first step compiles them", c.reason())
    stop()


def stop() -> None:
    """End the compiling process, if any (the job's end, or :func:`wait`)."""
    global _compiler
    c, _compiler = _compiler, None
    if c is not None:
        c.close()


def _compile(folder: Path) -> None:
    """The compiling process: import, wait for :func:`feed`'s line, build, run, say so."""

    channel = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever the libraries print goes with the errors; the channel carries only the stages

    def say(line: str) -> None:
        print(line, file=channel, flush=True)

    cfg: SFTConfig = pickle.loads((folder / "config.pkl").read_bytes())
    import torch

    from zerolab.engine import Zero3Loading, build_model
    from zerolab.placement import InDriver

    say("imported")
    budget, _, batch_path = sys.stdin.readline().strip().partition(" ")
    if not batch_path:
        return say("skipped no GPU memory beside the job by its estimate")
    say("building")
    device = InDriver.device(cfg.scaling.use_gpu)  # the job's own
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, int(budget) / total), device)
    batch = torch.load(batch_path)
    try:
        model = build_model(cfg, {}, batch["total_steps"], zero3=Zero3Loading(), device=device, layers=1)
        model.train()
        inputs = {k: v.to(device) for k, v in batch["inputs"].items()}
        out = model(**inputs, num_items_in_batch=torch.tensor(float(max(batch["num_targets"], 1)), device=device))
        out.loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except torch.OutOfMemoryError:
        return say(f"skipped more GPU memory than the {int(budget) / 2**30:.1f} GiB beside the job")
    say("done")


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    _compile(Path(sys.argv[1]))
