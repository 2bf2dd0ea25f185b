"""Heavy imports of a training worker, started when its process starts.

Ray Train starts a worker process, sets up its process group and only then runs the train
function, whose first act is to import DeepSpeed, transformers and peft (about 20 s on a cold GPU
host, measured in docs/benchmark.md). ``start`` is the job's ``worker_process_setup_hook`` (Ray
runs it in every worker process of the job); in the training workers, which Ray Train starts with
``ZEROLAB_PRELOAD`` set, it runs those imports in a background thread while Ray Train is still forming the worker group, so
the train function finds them loaded. ``zerolab.train`` waits for the thread before its own
imports (transformers' lazily loaded attributes are not safe to import from two threads at
once), and a failure here changes nothing: the train function then imports what is missing.
"""

from __future__ import annotations

import importlib
import os
import threading

HOOK = "zerolab.preload.start"
ENV_VAR = "ZEROLAB_PRELOAD"
MODULES = ("torch", "transformers", "transformers.models.auto.modeling_auto", "peft", "deepspeed")
_thread: threading.Thread | None = None


def _load() -> None:
    for name in MODULES:
        try:
            importlib.import_module(name)
        except BaseException:  # noqa: BLE001 (the train function's own import reports any real problem)
            return


def start() -> None:
    global _thread
    if os.environ.get(ENV_VAR) != "1":
        return
    _thread = threading.Thread(target=_load, name="zerolab-preload", daemon=True)
    _thread.start()


def wait() -> None:
    """Until the preloading thread (if this process started one) is done."""
    if _thread is not None and _thread is not threading.current_thread():
        _thread.join()
