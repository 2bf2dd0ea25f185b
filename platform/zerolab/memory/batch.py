"""The data: the largest micro-batch the workers will see and the largest shard they hold."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from zerolab.batches import epoch_order, plan_micro_batches
from zerolab.config import SFTConfig
from zerolab.memory.errors import MemoryEstimateError


@dataclass(frozen=True)
class MicroBatch:
    """The size of one micro-batch as the model gets it: ``rows`` sequences padded to ``seq_len``."""

    rows: int
    seq_len: int
    tokens: int
    """Tokens of the padded tensors, rows × seq_len (padding included: every layer runs on it)."""


def worst_micro_batch(lengths_by_rank: Sequence[Sequence[int]], *, micro_batch_size: int, max_seq_length: int,
                      packing: bool, seed: int = 0, num_micro_batches: int | None = None,
                      shuffled: bool = True) -> MicroBatch | None:
    """The largest micro-batch any rank will run, from the token length of every row of each
    rank's shard (None when every shard is empty). Micro-batches are planned by
    :func:`zerolab.batches.plan_micro_batches`, exactly as the workers plan them, and padded to their
    longest sequence (``MicroBatches.collate``).

    ``tokens`` is the most tokens (rows × padded width) of any micro-batch and ``seq_len`` the
    widest micro-batch; they can come from different micro-batches, so the pair bounds both the
    per-token and the per-token × length terms of the estimate.

    - ``shuffled`` (training) with ``num_micro_batches``: each rank's epochs are planned from
      ``seed`` (``zerolab.batches.epoch_order``) for the ``num_micro_batches`` micro-batches the run
      takes, the stream its workers will run. A short run need not meet the longest row at all (3 steps
      of one row each over a shard where one row in ten is long: most such runs see none).
    - ``shuffled`` without packing and without ``num_micro_batches``: a run of unknown length, bounded
      by min(micro_batch_size, rows) × the longest row (whatever the order, no padded micro-batch
      is larger, and over enough epochs one reaches it).
    - ``shuffled`` with packing and without ``num_micro_batches``: one epoch planned.
    - not ``shuffled`` (evaluation: one pass in file order): the micro-batches of that pass.
    """
    best: MicroBatch | None = None
    widest = 0
    for lengths in lengths_by_rank:
        lengths = [int(n) for n in lengths]
        if not lengths:
            continue
        bound = MicroBatch(min(micro_batch_size, len(lengths)), max(lengths), 0)
        if shuffled and not packing and num_micro_batches is None:
            candidates = [bound]
        else:
            candidates = []
            epoch, planned = 0, 0
            while True:
                order = epoch_order(len(lengths), seed, epoch) if shuffled else list(range(len(lengths)))
                plan = plan_micro_batches(lengths, order, micro_batch_size=micro_batch_size, max_seq_length=max_seq_length,
                                          packing=packing)
                if shuffled and num_micro_batches is not None:
                    plan = plan[: num_micro_batches - planned]
                batches = [MicroBatch(len(b), max(sum(lengths[i] for i in seq) for seq in b), 0) for b in plan]
                candidates += batches
                planned += len(plan)
                epoch += 1
                # Padded, no micro-batch exceeds the bound: once one reaches it, later epochs add nothing.
                reached = not packing and bound in batches
                if not shuffled or num_micro_batches is None or planned >= num_micro_batches or not plan or reached:
                    break
        for c in candidates:
            widest = max(widest, c.seq_len)
            if best is None or c.rows * c.seq_len > best.tokens:
                best = MicroBatch(c.rows, c.seq_len, c.rows * c.seq_len)
    return None if best is None else MicroBatch(best.rows, widest, best.tokens)


@dataclass(frozen=True)
class BatchShape:
    """What the estimate takes from the data: the largest micro-batch (training or evaluation) and
    the largest shard a worker holds in host memory."""

    micro_batch: MicroBatch
    shard_rows: int
    """Rows of one worker's train and eval shards together (the largest over ranks)."""
    shard_tokens: int
    """Their tokens (unpadded: a worker keeps its rows as they are)."""
    from_data: bool
    """True when measured on the job's shards, False for the worst case by config."""

    @classmethod
    def from_config(cls, cfg: SFTConfig) -> BatchShape:
        """The worst case the config allows: every micro-batch ``micro_batch_size`` × ``max_seq_length``,
        every row ``max_seq_length`` tokens, ⌈rows / D⌉ rows of each split per worker (D data-parallel
        groups: the ranks of a sequence-parallel group read one shard; a train file without an eval
        file has no eval split: ``DataSpec.has_eval_split``). Raises MemoryEstimateError for
        ``max_seq_length: auto``, which only the data decides."""
        d, n = cfg.data, cfg.data_parallel_size()
        s = d.max_seq_length
        if s == "auto":
            raise MemoryEstimateError("data.max_seq_length: auto is the length of the data's longest row, so the estimate needs "
                                      "the data; estimate on it (jobs/estimate.py tokenizes it) or set a number of tokens")
        eval_rows = d.num_eval_rows if d.has_eval_split() else 0
        rows = math.ceil(d.num_train_rows / n) + math.ceil(eval_rows / n)
        return cls(MicroBatch(cfg.train.micro_batch_size, s, cfg.train.micro_batch_size * s), rows, rows * s, False)

    def describe(self) -> str:
        b = self.micro_batch
        if not self.from_data:
            return f"micro-batch {b.rows} × {b.seq_len} tokens (the worst case by config)"
        return f"largest micro-batch of the data {b.tokens:,} tokens ({b.rows} rows, padded to ≤ {b.seq_len})"


class ShardLengths:
    """The token length of every row of each rank's shards, as the workers get them: ``train[r]``
    (``zerolab.data.shard_rows``, equal shards) and ``eval[r]`` (empty without an eval split). Valid for the
    world size it was split for; :meth:`batch_shape` is cached per batching setting."""

    def __init__(self, train: Sequence[Sequence[int]], eval: Sequence[Sequence[int]] = ()) -> None:
        self.train = [list(map(int, r)) for r in train]
        self.eval = [list(map(int, r)) for r in eval]
        self._cache: dict[tuple[Any, ...], BatchShape] = {}

    @property
    def world_size(self) -> int:
        return len(self.train)

    @property
    def longest_row(self) -> int:
        """Tokens of the longest row of any shard."""
        return max((n for shards in (self.train, self.eval) for shard in shards for n in shard), default=0)

    def batch_shape(self, cfg: SFTConfig) -> BatchShape:
        """The largest micro-batch of ``cfg``'s training run over these shards (its epochs are
        planned for the micro-batches the run takes, as ``zerolab.train`` counts its steps) and of
        its evaluation pass, and the largest shard."""
        t, d = cfg.train, cfg.data
        key = (t.micro_batch_size, d.max_seq_length, d.packing, t.seed, t.max_steps, t.num_epochs, t.grad_accum_steps)
        if key not in self._cache:
            # zerolab.train._total_steps: max_steps, or epochs × the smallest rank's steps per epoch.
            if t.max_steps:
                steps = t.max_steps
            else:
                per_epoch = min(len(_epoch0_plan(r, t.micro_batch_size, d.max_seq_length, t.seed)) if d.packing
                                else math.ceil(len(r) / t.micro_batch_size) for r in self.train)
                steps = max(1, t.num_epochs * (per_epoch // t.grad_accum_steps))
            consumed = steps * t.grad_accum_steps
            train = worst_micro_batch(self.train, micro_batch_size=t.micro_batch_size, max_seq_length=d.max_seq_length,
                                      packing=d.packing, seed=t.seed, num_micro_batches=consumed)
            evals = worst_micro_batch(self.eval, micro_batch_size=t.micro_batch_size, max_seq_length=d.max_seq_length,
                                      packing=False, shuffled=False)
            assert train is not None, "the train shards hold no rows"
            # Evaluation runs without gradients, so its micro-batch counts as a training one (an upper bound).
            largest = train if evals is None or train.tokens >= evals.tokens else evals
            micro = MicroBatch(largest.rows, max(train.seq_len, evals.seq_len if evals else 0), largest.tokens)
            ranks = range(self.world_size)
            shard_rows = max(len(self.train[r]) + (len(self.eval[r]) if r < len(self.eval) else 0) for r in ranks)
            shard_tokens = max(sum(self.train[r]) + (sum(self.eval[r]) if r < len(self.eval) else 0) for r in ranks)
            self._cache[key] = BatchShape(micro, shard_rows, shard_tokens, True)
        return self._cache[key]


def _epoch0_plan(lengths: Sequence[int], micro_batch_size: int, max_seq_length: int, seed: int) -> list[Any]:
    """Epoch 0's packed micro-batches of one shard (how ``MicroBatches.batches_per_epoch`` counts them)."""
    return plan_micro_batches(lengths, epoch_order(len(lengths), seed, 0), micro_batch_size=micro_batch_size,
                              max_seq_length=max_seq_length, packing=True)
