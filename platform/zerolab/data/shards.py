"""The workers' rows: :func:`shard_rows` assigns rows to ranks deterministically and
:func:`worker_datasets` hands each rank its rows through Ray's object store (workers never open the
data files), so every rank gets the same rows on every attempt; :func:`load_shard` reads them on the
worker. :class:`zerolab.batches.MicroBatches` then shuffles the shard per epoch from the seed.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from zerolab.data.prepared import PreparedSplit


def shard_rows(num_rows: int, world_size: int, *, equal: bool) -> list[np.ndarray]:
    """Row indices of each rank's shard: rank ``r`` gets rows ``r, r + world_size, ...``.

    Pure and deterministic, so every attempt of a run gives a rank the same rows. Striding, not
    contiguous blocks, spreads files (and any order by length in them) evenly over the ranks.
    ``equal`` drops the last ``num_rows % world_size`` rows so that every rank has as many rows
    (and runs as many steps) as the others; otherwise every row is kept and shards differ by one.
    """
    assert world_size >= 1, world_size
    end = num_rows - num_rows % world_size if equal else num_rows
    return [np.arange(rank, end, world_size, dtype=np.int64) for rank in range(world_size)]


def worker_datasets(prepared: dict[str, PreparedSplit], world_size: int, sequence_parallel_size: int = 1) -> tuple[dict[str, Any], Any]:
    """(Ray datasets, Ray Train DataConfig) that give rank r the rows ``shard_rows`` assigns it, or
    with sequence parallelism shard ``r // sequence_parallel_size`` of ``world_size /
    sequence_parallel_size`` (the ranks of a sequence-parallel group split the same rows' tokens).

    The driver puts each rank's rows into Ray's object store (one block per rank); a worker reads
    its block through Ray, from whichever node holds it, never from a file: the data files and the
    cache exist on the driver only. ``train`` shards are equal, so every rank runs the same number
    of steps; ``eval`` keeps every row. Ray's default ``streaming_split`` would hand blocks to
    whichever rank asks first, so a resumed run would not continue on the same rows.

    Each block's metadata (rows, bytes, schema) is read here from the table in hand
    (``ray.data.from_blocks``); ``from_arrow_refs`` would run a Ray task per block to read it back,
    whose worker processes a 2-core machine starts anew for every run of a sweep. A split's dataset
    is the union of its shards, which nothing executes: the workers read their shards.
    """
    import ray.data
    from ray.train import DataConfig

    sp = sequence_parallel_size
    shards = {name: [ray.data.from_blocks([split.to_arrow(indices)])
                     for indices in shard_rows(split.num_rows, world_size // sp, equal=(name == "train"))]
              for name, split in prepared.items()}
    datasets = {name: parts[0].union(*parts[1:]) if len(parts) > 1 else parts[0] for name, parts in shards.items()}

    class ShardedDataConfig(DataConfig):
        def configure(self, datasets, world_size, worker_handles, worker_node_ids, **kwargs):  # type: ignore[override]
            return [{name: shards[name][rank // sp].iterator() for name in datasets} for rank in range(world_size)]

    return datasets, ShardedDataConfig(datasets_to_split=[])


def load_shard(iterator: Any) -> list[tuple[np.ndarray, np.ndarray]]:
    """All (input_ids, labels) rows of this rank's shard, in order."""
    rows = []
    for batch in iterator.iter_batches(batch_format="numpy", batch_size=None):
        rows.extend(zip(batch["input_ids"], batch["labels"]))
    return [(np.asarray(ids, dtype=np.int64), np.asarray(lab, dtype=np.int64)) for ids, lab in rows]
