"""Stopping a job on request: SIGINT/SIGTERM, ``run.max_wall_time_s`` and a warm trainer's stop flag.

Outside the fit, the first signal interrupts the job at once (:func:`signals_interrupt`), except
while it writes its record (:func:`shielded`: an MLflow store write, the run folder's record), which
it lets finish first: a SQLite commit cut short keeps the store locked. During the fit a
:class:`StopSignal` asks the workers to checkpoint and stop at the next logging step instead.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from typing import Any

logger = logging.getLogger("zerolab")


class _MainThread(threading.local):
    writing = 0
    """How many shielded writes the thread is inside."""
    pending: int | None = None
    """A signal that arrived during one."""


_state = _MainThread()


@contextlib.contextmanager
def signals_interrupt() -> Iterator[None]:
    """SIGINT and SIGTERM raise KeyboardInterrupt in the main thread (deferred to the end of a
    :func:`shielded` write), so a job stops within seconds at any moment and its ``finally``
    blocks run. A no-op off the main thread (signals reach only the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handle(signum: int, frame: Any) -> None:
        if _state.writing:
            _state.pending = signum
            return
        raise KeyboardInterrupt

    previous = {s: signal.signal(s, handle) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def shielded() -> Iterator[None]:
    """A write that a signal must not cut short; the signal's KeyboardInterrupt comes after it."""
    _state.writing += 1
    try:
        yield
    finally:
        _state.writing -= 1
        if not _state.writing and _state.pending is not None:
            _state.pending = None
            raise KeyboardInterrupt


class Interrupted(RuntimeError):
    """The run stopped on request after saving a checkpoint."""

    def __init__(self, message: str, *, run_name: str | None = None) -> None:
        super().__init__(message)
        self.run_name = run_name

    def __reduce__(self) -> tuple:  # raised in a warm trainer (zerolab.warm) and re-raised by its job
        return _rebuild_interrupted, (type(self), str(self), self.run_name)


def _rebuild_interrupted(cls: type[Interrupted], message: str, run_name: str | None) -> Interrupted:
    return cls(message, run_name=run_name)


class NoFinalCheckpoint(RuntimeError):
    """Training ended but no final checkpoint came back to the driver; the message says where the
    run resumes from."""


class DeadlineReached(Interrupted):
    """The run stopped at ``run.max_wall_time_s`` after saving a checkpoint."""


class StopSignal:
    """A flag set by the first SIGINT/SIGTERM the driver gets, read by the workers at logging steps.

    Rank 0 reads it at each logging step, where the loop synchronises anyway, and shares it through
    that step's all-reduce, so every rank stops after the same step and joins the final
    checkpoint's collectives; reading it every step would cost a device sync per step. A job that
    trains in its own process (``launch`` ``driver``) reads a ``threading.Event``; a worker group
    an actor on the driver's node. Signals reach only the main thread: a run started on another
    thread (a Tune trial) gets no handler, so its worker group gets no flag either (the actor would
    be a process of its own, started for every trial and never set).
    """

    def __init__(self, log_every_n_steps: int, launch: str, flag: Any = None) -> None:
        self.log_every_n_steps = log_every_n_steps
        self._requested = False
        self.fitting = False
        """Whether the fit has begun (a signal before it stops the job at once)."""
        on_main = threading.current_thread() is threading.main_thread()
        self.flag: Any = (flag if flag is not None else threading.Event() if launch == "driver"
                          else stop_flag_actor() if on_main else None)

    def _handle(self, signum: int, frame: Any) -> None:
        if self._requested:
            raise KeyboardInterrupt
        self._requested = True
        if isinstance(self.flag, threading.Event):
            self.flag.set()
        else:
            self.flag.set.remote()
        log_stop_requested(signal.Signals(signum).name, self.log_every_n_steps)

    @staticmethod
    def fit(trainer: Any) -> Any:
        """``trainer.fit()``, on a helper thread when called from the main thread: Ray Train replaces
        the main thread's SIGINT handler with one that kills the workers at once, and signals reach
        only the main thread, which here just waits."""
        if threading.current_thread() is not threading.main_thread():
            return trainer.fit()
        outcome: dict[str, Any] = {}

        def target() -> None:
            try:
                outcome["result"] = trainer.fit()
            except BaseException as exc:  # re-raised on the main thread
                outcome["error"] = exc

        thread = threading.Thread(target=target, name="zerolab-fit", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(timeout=0.5)
        if "error" in outcome:
            raise outcome["error"]
        return outcome["result"]

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        self.fitting = True
        if threading.current_thread() is not threading.main_thread():
            yield  # signal handlers can only be set from the main thread
            return
        previous = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


class StopFlag:
    """The stop flag as a Ray actor (:func:`stop_flag_actor`), for a run that trains in other processes."""

    def __init__(self) -> None:
        self.value = False

    def set(self) -> None:
        self.value = True

    def get(self) -> bool:
        return self.value


def stop_flag_actor() -> Any:
    """A :class:`StopFlag` actor on this process's node, like Ray Train's controller: on a worker
    node it would die with that node, and the retry from the last checkpoint would fail on the lost flag."""
    import ray

    return ray.remote(num_cpus=0)(StopFlag).options(label_selector={"ray.io/node-id": ray.get_runtime_context().get_node_id()}).remote()


def log_stop_requested(signal_name: str, log_every_n_steps: int) -> None:
    logger.warning("%s received: the workers will save a checkpoint and stop at the next logging step (within "
                   "train.log_every_n_steps=%d steps); send it again to abort without a checkpoint",
                   signal_name, log_every_n_steps)
