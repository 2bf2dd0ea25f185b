"""The batch format that the batcher produces and the model consumes: :class:`Batch`, the
micro-batch stream :class:`MicroBatches` over one shard's tokenized rows, and the packed-sample
boundaries under :data:`CU_SEQLENS_KEY` that the varlen attention kernel reads. Data preparation
(:mod:`zerolab.data`) and the kernels (:mod:`zerolab.kernels`) both import it; it imports neither,
and imports torch only where it makes tensors (the driver plans batches without it).
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

IGNORE_INDEX = -100
"""Label of a token that does not contribute to the loss (prompt and padding)."""

CU_SEQLENS_KEY = "packed_cu_seqlens"
"""Model input (int32, B·S + 1 at most) with the start of every packed sample in the flattened
micro-batch and its end: the batcher adds it to packed micro-batches where a row holds more than
one sample (rows of one sample, right-padded, need only causal attention: long rows take a faster
kernel there, ``zerolab.kernels.varlen_attention_forward``); attention other than ``varlen``
ignores it."""


def packed_cu_seqlens(row_lengths: list[list[int]], width: int) -> torch.Tensor:
    """Boundaries of every sample of a packed micro-batch in its flattened B×``width`` tokens: each
    row's samples, then its padding as one more (ignored) sequence."""
    import torch

    bounds = [0]
    for row in row_lengths:
        start = bounds[-1]
        for n in row:
            bounds.append(bounds[-1] + n)
        if bounds[-1] < start + width:
            bounds.append(start + width)
    return torch.tensor(bounds, dtype=torch.int32)


@dataclass
class Batch:
    """One micro-batch: model inputs plus the counts that normalise loss and throughput."""

    inputs: dict[str, torch.Tensor]
    num_tokens: int
    """Non-padding tokens."""
    num_targets: int
    """Tokens that contribute to the loss (labels are shifted by one inside the model)."""


def epoch_order(num_rows: int, seed: int, epoch: int) -> list[int]:
    """The order in which epoch ``epoch`` of a shard of ``num_rows`` rows visits them."""
    return np.random.default_rng([seed, epoch]).permutation(num_rows).tolist()


AUTO_LENGTH_MULTIPLE = 64
"""``data.max_seq_length: auto`` rounds the data's longest row up to a multiple of this."""


def auto_max_seq_length(longest_row: int, max_positions: int | None) -> int:
    """What ``data.max_seq_length: auto`` resolves to for data whose longest row (over every split)
    has ``longest_row`` tokens: that, rounded up to a multiple of :data:`AUTO_LENGTH_MULTIPLE`, at
    most the model's ``max_position_embeddings`` (``max_positions``; None: no limit).

    Padded micro-batches are as wide as their own longest row, so there the length is only the
    bound of the worst case by config. Packed sequences hold up to this many tokens: the longest
    row always fits one (a row longer than the length would be a sequence of its own, wider than
    the estimate's bound), and the rounding leaves room for short rows beside it. Rounding also
    keeps the length when an edit of the data moves the longest row by a few tokens, so runs on
    versions of one data set train at one length."""
    assert longest_row > 0, longest_row
    rounded = -(-longest_row // AUTO_LENGTH_MULTIPLE) * AUTO_LENGTH_MULTIPLE
    return rounded if max_positions is None else min(rounded, max_positions)


PACKER = "best-fit"
"""How :func:`pack_rows` plans sequences, recorded in checkpoints: a run resumed from a checkpoint
whose packer planned them otherwise groups the rest of that epoch's rows anew."""


def plan_micro_batches(lengths: Sequence[int], order: Sequence[int], *, micro_batch_size: int, max_seq_length: int,
                       packing: bool) -> list[list[list[int]]]:
    """Micro-batches of sequences of row indices, visiting rows (of ``lengths[i]`` tokens) in
    ``order``. Without packing every row is its own sequence; with packing see :func:`pack_rows`.
    A micro-batch is ``micro_batch_size`` consecutive sequences (the last one of a pass may hold
    fewer); :meth:`MicroBatches.collate` pads it to its longest sequence."""
    sequences = pack_rows(lengths, order, max_seq_length) if packing else [[i] for i in order]
    k = micro_batch_size
    return [sequences[j : j + k] for j in range(0, len(sequences), k)]


def pack_rows(lengths: Sequence[int], order: Sequence[int], max_seq_length: int) -> list[list[int]]:
    """Sequences of at most ``max_seq_length`` tokens, best fit: each row, in ``order``, joins the
    sequence with the least room that still holds it (the earliest such one on a tie), or starts a
    new one; sequences come out in the order they were started.

    Laying rows end to end until one does not fit (next fit) leaves a sequence's tail empty
    whenever a long row follows: on the benchmark's mix (median 106 tokens, long documents up to
    3,856) sequences of 4,096 tokens were 81% full, and a micro-batch of two padded the shorter to
    the longer; best fit fills them to 99%. Rows stay in the epoch's random order as far as the
    grouping allows; a late short row may join an early sequence.
    """
    sequences: list[list[int]] = []
    rooms: list[int] = []  # the distinct amounts of room that open sequences have, ascending
    with_room: dict[int, list[int]] = {}  # room -> heap of the sequences that have it
    for i in order:
        n = lengths[i]
        k = bisect.bisect_left(rooms, n)
        if k < len(rooms):
            room = rooms[k]
            s = heapq.heappop(with_room[room])
            if not with_room[room]:
                del with_room[room], rooms[k]
            sequences[s].append(i)
        else:
            room, s = max_seq_length, len(sequences)
            sequences.append([i])
        room -= n
        if room > 0:
            if room not in with_room:
                with_room[room] = []
                bisect.insort(rooms, room)
            heapq.heappush(with_room[room], s)
    return sequences


class MicroBatches:
    """An endless, reproducible stream of micro-batches over one shard.

    Epoch ``e`` visits the rows in the order of ``default_rng([seed, e]).permutation``. Without
    packing a micro-batch holds ``micro_batch_size`` rows padded to the longest of them; with
    packing, rows are packed best fit (:func:`pack_rows`) into sequences of at most
    ``max_seq_length`` tokens with per-sample ``position_ids`` (from which the model builds
    block-diagonal attention, so packed samples do not see each other) and the samples' boundaries
    in the flattened micro-batch (``packed_cu_seqlens``, for the varlen attention kernel);
    ``micro_batch_size`` such sequences form a micro-batch.

    ``width_multiple`` pads every micro-batch's width to a multiple of it (sequence parallelism
    splits each sequence into that many equal slices; the padding is one more ignored sequence).
    """

    def __init__(self, rows: list[tuple[np.ndarray, np.ndarray]], *, micro_batch_size: int, max_seq_length: int,
                 packing: bool, pad_id: int, seed: int, width_multiple: int = 1) -> None:
        self.rows = rows
        self.width_multiple = width_multiple
        self.micro_batch_size = micro_batch_size
        self.max_seq_length = max_seq_length
        self.packing = packing
        self.pad_id = pad_id
        self.seed = seed
        self._last_plan: tuple[int, list[list[list[int]]]] | None = None

    def plan(self, order: list[int]) -> list[list[list[int]]]:
        """Micro-batches of sequences of row indices, visiting rows in ``order``."""
        return plan_micro_batches([len(ids) for ids, _ in self.rows], order, micro_batch_size=self.micro_batch_size,
                                  max_seq_length=self.max_seq_length, packing=self.packing)

    def epoch_plan(self, epoch: int) -> list[list[list[int]]]:
        """Epoch ``epoch``'s plan; the last one planned is kept (a job counts epoch 0's micro-batches,
        then trains on them)."""
        if self._last_plan is None or self._last_plan[0] != epoch:
            self._last_plan = (epoch, self.plan(epoch_order(len(self.rows), self.seed, epoch)))
        return self._last_plan[1]

    def batches_per_epoch(self) -> int:
        return len(self.epoch_plan(0))

    def iterate(self, start: int = 0) -> Iterator[Batch]:
        """Micro-batches from position ``start`` (micro-batches already consumed) onwards, forever."""
        assert self.rows, "empty shard"
        epoch, skip = 0, start
        while True:
            plan = self.epoch_plan(epoch)
            if skip >= len(plan):
                skip -= len(plan)
            else:
                for batch in plan[skip:]:
                    yield self.collate(batch)
                skip = 0
            epoch += 1

    def sequential(self) -> list[Batch]:
        """One pass in file order, unshuffled (evaluation)."""
        return [self.collate(b) for b in self.plan(list(range(len(self.rows))))]

    def collate(self, batch: list[list[int]]) -> Batch:
        import torch

        seqs = [np.concatenate([self.rows[i][0] for i in seq]) for seq in batch]
        labs = [np.concatenate([self.rows[i][1] for i in seq]) for seq in batch]
        lengths = [len(s) for s in seqs]
        width = -(-max(lengths) // self.width_multiple) * self.width_multiple
        input_ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
        labels = torch.full((len(seqs), width), IGNORE_INDEX, dtype=torch.long)
        for r, (s, lab) in enumerate(zip(seqs, labs)):
            input_ids[r, : len(s)] = torch.from_numpy(s)
            labels[r, : len(lab)] = torch.from_numpy(lab)
        inputs = {"input_ids": input_ids, "labels": labels}
        if self.packing:
            positions = torch.zeros((len(seqs), width), dtype=torch.long)
            for r, seq in enumerate(batch):
                parts = [np.arange(len(self.rows[i][0])) for i in seq]
                parts.append(np.arange(width - lengths[r]))  # padding forms its own (ignored) sequence
                positions[r] = torch.from_numpy(np.concatenate(parts))
            inputs["position_ids"] = positions
            if any(len(seq) > 1 for seq in batch):  # rows of one sample each need no boundaries: causal attention keeps them
                inputs[CU_SEQLENS_KEY] = packed_cu_seqlens([[len(self.rows[i][0]) for i in seq] for seq in batch], width)
        else:
            inputs["attention_mask"] = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
        return Batch(inputs=inputs, num_tokens=sum(lengths), num_targets=count_targets(labels))


def count_targets(labels: torch.Tensor) -> int:
    """Tokens that contribute to the loss: labels are shifted by one inside the model's loss."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())
