"""zerolab: supervised fine-tuning of causal LMs as Ray Train jobs with DeepSpeed workers."""

import os
from pathlib import Path

__version__ = "0.1.0"


def cache_dir() -> Path:
    """Where zerolab keeps what it builds or measures once per machine (the built-in tiny model,
    generated and tokenized data, the CPU workers' import baseline): ``$ZEROLAB_CACHE``, by
    default ``~/.cache/zerolab``."""
    return Path(os.environ.get("ZEROLAB_CACHE", Path.home() / ".cache" / "zerolab")).expanduser()
