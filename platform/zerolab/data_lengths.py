"""Token lengths of a job's rows and shards without Ray, for ``jobs/estimate.py --data``.

The rows are parsed, rendered and tokenized by the same functions the Ray Data pipeline runs
(:mod:`zerolab.data`), in file order; rows that pipeline drops (malformed, too long, no target)
are dropped here too. The shards follow Ray's ``Dataset.split``: ``train`` is split with
``equal=True``, which (without locality hints) cuts the rows in order into N ranges of
⌊rows / N⌋ and drops the rest; ``eval`` is split with ``equal=False``, which deals out whole
blocks, so here its rows are cut into N ranges as even as possible (the blocks are not known
without Ray).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from zerolab.config import SFTConfig
from zerolab.data import IGNORE_INDEX, DataError, RowError, list_data_files, parse_file, row_to_messages, tokenize_messages


def token_lengths(path: str, cfg: SFTConfig, tokenizer: Any, system_prompt: str) -> list[int]:
    """The token count of every usable row of the file or folder ``path``, in file order."""
    lengths = []
    for file in list_data_files(path):
        if "://" in file:
            raise DataError(f"{file}: --data reads local files only; copy the data here, or run the job: its preflight is data-aware")
        for row in parse_file({"path": file, "bytes": Path(file).read_bytes()}):
            if row["error"] is not None:
                continue
            try:
                ids, labels = tokenize_messages(tokenizer, row_to_messages(json.loads(row["record"]), system_prompt))
            except RowError:
                continue
            if len(ids) <= cfg.data.max_seq_length and any(label != IGNORE_INDEX for label in labels):
                lengths.append(len(ids))
    return lengths


def split_lengths(lengths: list[int], world_size: int, *, equal: bool) -> list[list[int]]:
    """Each rank's share of ``lengths`` as ``Dataset.split(world_size, equal=equal)`` deals rows (see
    the module's docstring for ``equal=False``)."""
    if equal:
        k = len(lengths) // world_size
        return [lengths[r * k : (r + 1) * k] for r in range(world_size)]
    q, extra = divmod(len(lengths), world_size)
    bounds = [r * q + min(r, extra) for r in range(world_size + 1)]
    return [lengths[bounds[r] : bounds[r + 1]] for r in range(world_size)]


def job_shard_lengths(cfg: SFTConfig) -> Any:
    """The job's shards (a ``zerolab.memory.ShardLengths``): its train and eval files, or the task's
    generated ones, tokenized with the model's tokenizer."""
    from zerolab.memory import ShardLengths
    from zerolab.models import load_tokenizer
    from zerolab.run import dataset_paths
    from zerolab.tasks import get_task

    tokenizer = load_tokenizer(cfg.model)
    system_prompt = cfg.data.system_prompt if cfg.data.system_prompt is not None else get_task(cfg.data.task).system_prompt
    paths = dataset_paths(cfg)
    n = cfg.world_size()
    train = split_lengths(token_lengths(paths["train"], cfg, tokenizer, system_prompt), n, equal=True)
    evals = split_lengths(token_lengths(paths["eval"], cfg, tokenizer, system_prompt), n, equal=False) if "eval" in paths else []
    return ShardLengths(train, evals)
