"""Logging on a training worker: rank 0's lines (:func:`log_rank0`) and the worker's logging set-up.

Every room of the training phase (``zerolab.train``, ``zerolab.engine``, ``zerolab.snapshot``, ...) logs
through the one logger here, named ``zerolab.train`` as the loop's lines have always been."""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any

import torch.distributed as dist

from zerolab.cluster import quiet_ray_data_logging

logger = logging.getLogger("zerolab.train")


def log_rank0(msg: str, *args: Any) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        logger.info(msg, *args)


def setup_worker_logging(*, own_handler: bool) -> None:
    """zerolab's lines at INFO, the libraries' at WARNING, no progress bars."""
    # Its own handler on a Ray worker: Ray has configured the worker's root logger already
    # (basicConfig would do nothing). The job's own process keeps the job's logging.
    ours = logging.getLogger("zerolab")
    if own_handler and not ours.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", datefmt="%H:%M:%S"))
        ours.addHandler(handler)
        ours.propagate = False
    ours.setLevel(logging.INFO)
    for noisy in ("DeepSpeed", "deepspeed", "torch.distributed", "transformers", "peft"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    quiet_ray_data_logging()
    # bitsandbytes' LLM.int8() product warns at every call that it casts bf16 inputs to fp16: some
    # 6,000 identical lines in a dozen steps of a 7B int8 run. Once says it.
    int8 = logging.getLogger("bitsandbytes.autograd._functions")
    if not any(isinstance(f, OncePerMessage) for f in int8.filters):
        int8.addFilter(OncePerMessage())
    # bitsandbytes, which peft imports wherever it is installed, warns at its import on a CPU with
    # AVX-512 BF16 that it could not fetch a faster 4-bit CPU kernel from the Hugging Face Hub ("pip
    # install kernels"): on every worker of every CPU job, quantized or not. zerolab downloads no code;
    # its errors still come through.
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # DeepSpeed still calls torch.distributed's deprecated collectives on every step.
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_warning()


class OncePerMessage(logging.Filter):
    """Lets each distinct message through once."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message in self.seen:
            return False
        self.seen.add(message)
        return True
