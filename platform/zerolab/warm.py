"""A trainer process that outlives its job (``scaling.keep_warm_s``), so the next job starts in seconds.

A job joins a running cluster as a new process (``ray job submit`` starts one), and a new process
imports the training stack again: torch, transformers, peft and DeepSpeed took 16-22 s on the H100
hosts, most of a job's time to its first step. With ``scaling.keep_warm_s`` a one-worker job on a
cluster (``RAY_ADDRESS`` set) runs in a detached actor on its own node instead, the *warm
trainer*, which imported the stack once and stays up for ``keep_warm_s`` after each job; the next
job (same zerolab code, same kind of worker) finds it by name and hands it the config. The job's
own process imports none of the stack: it logs the trainer's log records as its own, stops the run through a
stop flag of its own (SIGINT/SIGTERM: checkpoint at the next logging step; a second one aborts and
ends the trainer) and returns the result. Everything else is the ordinary one-worker job (``run_sft`` in the
trainer: plan, preflight, MLflow run, Ray Train's local mode, evaluation), run in the job's
working directory and environment.

One job at a time per trainer: a second job waits for the first. The trainer holds its GPU (or
CPUs) while it waits for the next job; it exits after ``keep_warm_s`` idle, after a job that failed
in a way that may leave the process unusable (anything but a user error or a stop), and when a job
with other code or another kind of worker needs the node's trainer slot.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import queue
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import zerolab
from zerolab.cluster import adopt_worker_env, connect_ray, import_now, job_imports, may_train_in_driver, reserved_resources, worker_env
from zerolab.config import SFTConfig
from zerolab.errors import EnvironmentProblem, UserError
from zerolab.run import run_sft
from zerolab.stop import Interrupted, log_stop_requested, stop_flag_actor

logger = logging.getLogger(__name__)

NAMESPACE = "zerolab"
PREFIX = "zerolab-warm-trainer-"

START_TIMEOUT_S = 300.0
"""How long a job waits for a new warm trainer to be placed and to import the training stack."""

_NOT_PASSED = ("CUDA_VISIBLE_DEVICES", "PWD", "OLDPWD", "SHLVL", "_")
"""Variables of the job's environment the trainer keeps its own of (Ray sets the devices)."""


def wanted(cfg: SFTConfig) -> bool:
    """Whether this job runs in a warm trainer: ``scaling.keep_warm_s`` set, one worker that may
    train in a process of its own, a cluster to keep the trainer in (``RAY_ADDRESS``, not Ray
    Client's ``ray://``), and this process not itself a Ray worker (a Tune trial, the trainer)."""
    address = os.environ.get("RAY_ADDRESS", "")
    if not (cfg.scaling.keep_warm_s > 0 and may_train_in_driver(cfg) and address and not address.startswith("ray://")):
        return False
    import ray

    return not (ray.is_initialized() and ray.get_runtime_context().worker.mode == ray.WORKER_MODE)


def trainer_key(cfg: SFTConfig) -> str:
    """What a warm trainer must share with a job to run it: zerolab's code (the trainer imported
    its own copy), the worker environment and resources, the interpreter."""
    digest = hashlib.sha256()
    root = Path(zerolab.__file__).parent
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    env = worker_env(cfg)
    env.pop("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", None)
    digest.update(repr((sorted(env.items()), cfg.scaling.use_gpu, cfg.scaling.cpus_per_worker, sys.executable)).encode())
    return digest.hexdigest()[:16]


def run_sft_warm(cfg: SFTConfig, **run_sft_kwargs: Any) -> Any:
    """``run_sft(cfg, **run_sft_kwargs)`` in this node's warm trainer, started if there is none."""
    import ray

    # Joins RAY_ADDRESS and imports nothing of the training stack; the trainer's output comes
    # through its `run` stream (Ray's forwarding would show a detached actor's to its first job).
    connect_ray(cfg, log_to_driver=False)
    if reserved_resources().get("GPU" if cfg.scaling.use_gpu else "CPU"):
        # The trainer would wait for what this process holds (`ray job submit --entrypoint-num-gpus`).
        logger.info("the job holds its worker's resources (entrypoint resources): it trains in its own process, "
                    "not in a warm trainer; submit it without them to use scaling.keep_warm_s")
        from zerolab.run import run_sft

        return run_sft(cfg, **run_sft_kwargs)
    trainer, reused = _trainer(cfg)
    try:
        status = ray.get(trainer.status.remote(), timeout=START_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        ray.kill(trainer)
        raise EnvironmentProblem(
            f"the warm trainer did not start within {START_TIMEOUT_S:g} s: this node has no free "
            f"{'GPU' if cfg.scaling.use_gpu else f'{cfg.scaling.cpus_per_worker:g} CPU(s)'} for it (`ray status` shows what holds "
            "them), or its imports hang; free them, or set scaling.keep_warm_s=0") from None
    logger.info("%s warm trainer (pid %d on this node; it stays up %g s after each job, scaling.keep_warm_s)",
                "reusing the" if reused else "starting a", status["pid"], cfg.scaling.keep_warm_s)
    if status["busy"]:
        logger.info("the warm trainer is running another job; this one starts when that one ends")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_") and k not in _NOT_PASSED}
    stop_flag = stop_flag_actor()
    stream = trainer.run.remote(cfg, {**run_sft_kwargs, "stop_flag": stop_flag}, os.getcwd(), env)
    stops = 0

    def on_signal(signum: int, frame: Any) -> None:
        nonlocal stops
        stops += 1
        if stops > 1:
            ray.kill(trainer)  # it may be anywhere in a step: the process goes, with what it held
            raise KeyboardInterrupt
        stop_flag.set.remote()
        log_stop_requested(signal.Signals(signum).name, cfg.train.log_every_n_steps)

    handlers = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)} \
        if threading.current_thread() is threading.main_thread() else {}
    try:
        for ref in stream:
            kind, payload = ray.get(ref)
            if kind == "log":  # the trainer's record, through this process's logging configuration
                record = logging.makeLogRecord(payload)
                logging.getLogger(record.name).handle(record)
            elif kind == "error":
                raise payload
            else:
                return payload
        raise RuntimeError("the warm trainer ended without a result")
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)


def _trainer(cfg: SFTConfig) -> tuple[Any, bool]:
    """This node's warm trainer for ``cfg`` (created when missing) and whether it existed. A
    trainer of another key on this node is asked to leave once idle, which frees its resources."""
    import ray

    node = ray.get_runtime_context().get_node_id()
    name = f"{PREFIX}{node[:12]}-{trainer_key(cfg)}"
    for other in ray.util.list_named_actors(all_namespaces=True):
        if other["namespace"] == NAMESPACE and other["name"].startswith(f"{PREFIX}{node[:12]}-") and other["name"] != name:
            try:
                ray.get(ray.get_actor(other["name"], namespace=NAMESPACE).retire.remote(), timeout=30)
            except (ValueError, ray.exceptions.RayError, TimeoutError):
                pass  # gone already, or busy with another job until it is done
    try:
        return ray.get_actor(name, namespace=NAMESPACE), True
    except ValueError:
        pass
    resources = {"num_gpus": 1, "num_cpus": cfg.scaling.cpus_per_worker} if cfg.scaling.use_gpu else {"num_cpus": cfg.scaling.cpus_per_worker}
    actor = ray.remote(concurrency_groups={"run": 1, "control": 1})(WarmTrainer).options(
        name=name, namespace=NAMESPACE, lifetime="detached", get_if_exists=True, max_restarts=0,
        label_selector={"ray.io/node-id": node}, **resources,
    ).remote(cfg, cfg.scaling.keep_warm_s)
    return actor, False


class WarmTrainer:
    """The detached actor (:func:`run_sft_warm`): imports the training stack at its start, then
    runs one job at a time (its ``run`` calls queue) and ends itself after ``keep_warm_s`` idle."""

    def __init__(self, cfg: SFTConfig, keep_warm_s: float) -> None:
        adopt_worker_env(cfg)
        # zerolab's records go to the job that runs (a Ray worker's own handler would send them to
        # the log of the job that started this actor only).
        self.relay = _RelayHandler()
        ours = logging.getLogger("zerolab")
        ours.addHandler(self.relay)
        ours.propagate = False
        import_now(job_imports(cfg))
        self.keep_warm_s = keep_warm_s
        self.busy = False
        self.leave = False
        self.idle_since = time.monotonic()
        self.jobs = 0
        threading.Thread(target=self._watch, name="zerolab-warm-idle", daemon=True).start()

    def _watch(self) -> None:
        import ray

        while True:
            time.sleep(0.5)
            if not self.busy and (self.leave or time.monotonic() - self.idle_since > self.keep_warm_s):
                # Killed through Ray, which then counts the exit as intended (an exit of its own
                # would be reported to every connected driver as a worker's unexpected death).
                ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
                return

    def status(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "busy": self.busy, "jobs": self.jobs}

    def retire(self) -> None:
        """Leave once idle (another job's code or worker kind needs this node's slot)."""
        self.leave = True

    def run(self, cfg: SFTConfig, kwargs: dict[str, Any], cwd: str, env: dict[str, str]) -> Iterator[tuple[str, Any]]:
        """``run_sft`` on a thread, in the job's working directory and environment; yields
        ("log", record attributes) as the job's log records come, then ("result", RunResult) or ("error", exc)."""

        self.busy, self.keep_warm_s = True, cfg.scaling.keep_warm_s
        self.jobs += 1
        records: queue.Queue[dict[str, Any]] = queue.Queue()
        self.relay.records = records
        root = logging.getLogger()
        level = root.level
        root.addHandler(self.relay)  # the libraries' records as well, as the job's own process would show them
        root.setLevel(logging.INFO)
        saved_env, saved_cwd = dict(os.environ), os.getcwd()
        os.environ.update(env)
        os.chdir(cwd)
        outcome: dict[str, Any] = {}

        def target() -> None:
            try:
                outcome["result"] = run_sft(cfg, **kwargs)
            except BaseException as exc:  # handed to the job, which reports it as its own
                outcome["error"] = exc

        thread = threading.Thread(target=target, name="zerolab-warm-job")
        try:
            thread.start()
            while thread.is_alive() or not records.empty():
                try:
                    yield "log", records.get(timeout=0.2)
                except queue.Empty:
                    pass
            if "error" in outcome:
                exc = outcome["error"]
                # A user error or a stop leaves the process as it was; anything else may not have.
                self.leave = not isinstance(exc, (UserError, Interrupted))
                yield "error", _portable(exc)
            else:
                yield "result", outcome["result"]
        finally:
            root.removeHandler(self.relay)
            root.setLevel(level)
            self.relay.records = None
            os.chdir(saved_cwd)
            os.environ.clear()
            os.environ.update(saved_env)
            _release_memory()
            self.busy, self.idle_since = False, time.monotonic()


class _RelayHandler(logging.Handler):
    """Puts records, made picklable (message formatted, traceback as text), into the running job's
    queue; drops them between jobs."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: queue.Queue[dict[str, Any]] | None = None

    def emit(self, record: logging.LogRecord) -> None:
        records = self.records
        if records is None:
            return
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        records.put({**record.__dict__, "msg": record.getMessage(), "args": None, "exc_info": None})


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling whole, else one that says the same in a class the job's
    error handling knows (a user error, or a RuntimeError naming the original class)."""
    try:
        copy = pickle.loads(pickle.dumps(exc))
        if type(copy) is type(exc) and str(copy) == str(exc) and vars(copy) == vars(exc):
            return exc
    except Exception:  # noqa: BLE001 (any failure to round-trip means: send a plain copy)
        pass
    message = str(exc)
    return UserError(message) if isinstance(exc, UserError) else RuntimeError(f"{type(exc).__name__}: {message}")


def _release_memory() -> None:
    """Give back what the job left cached: the GPU's blocks (other processes may need them before
    the next job) and Python's garbage."""
    import gc

    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


__all__ = ["NAMESPACE", "WarmTrainer", "run_sft_warm", "trainer_key", "wanted"]
