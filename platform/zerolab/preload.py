"""Heavy imports of a training worker, started when its process starts.

Ray Train starts a worker process, sets up its process group and only then runs the train
function, whose first act is to import DeepSpeed, transformers and peft (about 20 s on a cold GPU
host, measured in docs/benchmark.md). ``start`` is the job's ``worker_process_setup_hook`` (Ray
runs it in every worker process of the job); in the training workers, which Ray Train starts with
``ZEROLAB_PRELOAD`` set, it runs those imports in a background thread while Ray Train is still forming the worker group, so
the train function finds them loaded. A failure here changes nothing: the train function imports
the same modules itself (Python's per-module import locks make the two safe to overlap).
"""

from __future__ import annotations

import importlib
import os
import threading

HOOK = "zerolab.preload.start"
ENV_VAR = "ZEROLAB_PRELOAD"
MODULES = ("torch", "transformers", "transformers.models.auto.modeling_auto", "peft", "deepspeed", "zerolab.train")


def _load() -> None:
    for name in MODULES:
        try:
            importlib.import_module(name)
        except BaseException:  # noqa: BLE001 (the train function's own import reports any real problem)
            return


def start() -> None:
    if os.environ.get(ENV_VAR) != "1":
        return
    threading.Thread(target=_load, name="zerolab-preload", daemon=True).start()
