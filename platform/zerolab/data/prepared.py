"""The prepared split, the format the driver's preparation makes and the shards read: every good
row's tokens end to end (:class:`PreparedSplit`) with its report (:class:`SplitReport`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa


@dataclass
class SplitReport:
    """What one split's files held: counts, bad rows by reason with file:line examples, token stats,
    and where the tokens came from (``from_cache``, ``cache_key``)."""

    split: str
    files: list[str]
    fingerprint: str
    rows_read: int = 0
    rows_used: int = 0
    rows_bad: int = 0
    bad_by_reason: dict[str, int] = field(default_factory=dict)
    bad_examples: list[str] = field(default_factory=list)
    tokens: int = 0
    target_tokens: int = 0
    max_tokens: int = 0
    length_limit: int | None = None
    """The longest row accepted: ``data.max_seq_length``, or with ``auto`` the model's
    ``max_position_embeddings`` (None: the model's config has none)."""
    empty_files: list[str] = field(default_factory=list)
    """Files without a single row."""
    skipped_files: list[str] = field(default_factory=list)
    """Files of a data folder whose type is not supported (not read)."""
    cache_key: str = ""
    """Fingerprint of everything that decides the tokens (:func:`cache_key`)."""
    from_cache: bool = False
    """The tokens were read from the cache, not prepared again."""
    prepared_with: str = ""
    """``driver`` or ``ray data``: where the split was tokenized when it was prepared."""
    from_sweep: bool = False
    """A sweep trial took the tokens its sweep prepared once for all its trials (it read no file)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def source(self) -> str:
        """Where this job's tokens came from: ``sweep``, ``cache``, ``driver`` or ``ray data``."""
        return "sweep" if self.from_sweep else "cache" if self.from_cache else self.prepared_with

    def summary(self) -> str:
        line = f"{self.split}: {self.rows_used}/{self.rows_read} rows used, {self.tokens} tokens ({self.target_tokens} target)"
        if self.rows_bad:
            reasons = ", ".join(f"{k}: {v}" for k, v in sorted(self.bad_by_reason.items()))
            line += f"; {self.rows_bad} bad rows ({reasons})"
        where = {"driver": "tokenized in the driver", "ray data": "tokenized with Ray Data"}.get(self.prepared_with, "")
        if self.from_sweep:
            return line + " (prepared once for the sweep)"
        return line + (" (from the cache)" if self.from_cache else f" ({where})" if where else "")


@dataclass
class PreparedSplit:
    """One split's good rows, tokenized, held by the driver: every row's tokens end to end.

    Row ``i`` is ``input_ids[offsets[i]:offsets[i + 1]]`` (``labels`` alike, -100 where masked),
    in file order. ``lengths`` (tokens per row) is what batch shapes and memory depend on.
    """

    input_ids: np.ndarray
    """int32, all rows' tokens end to end."""
    labels: np.ndarray
    """int32, aligned with ``input_ids``."""
    offsets: np.ndarray
    """int64, ``num_rows + 1`` row boundaries into ``input_ids``."""
    report: SplitReport

    @property
    def num_rows(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        """Tokens of each row (int64, ``num_rows``)."""
        return np.diff(self.offsets)

    @property
    def from_cache(self) -> bool:
        return self.report.from_cache

    def rows(self, indices: np.ndarray | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
        """(input_ids, labels) as int64 arrays for the given rows (all by default), the batcher's input."""
        picked = range(self.num_rows) if indices is None else indices
        o = self.offsets
        return [(self.input_ids[o[i]:o[i + 1]].astype(np.int64), self.labels[o[i]:o[i + 1]].astype(np.int64)) for i in picked]

    def to_arrow(self, indices: np.ndarray | None = None) -> pa.Table:
        """The rows (all, or ``indices`` in that order) as a table of ``input_ids``/``labels`` lists."""
        # 32-bit list offsets hold up to 2**31 - 1 tokens per table.
        lists = pa.ListArray if self.offsets[-1] < 2**31 else pa.LargeListArray
        offsets = pa.array(self.offsets.astype(np.int32 if lists is pa.ListArray else np.int64))

        def column(flat: np.ndarray) -> pa.Array:
            return lists.from_arrays(offsets, pa.array(flat))

        table = pa.table({"input_ids": column(self.input_ids), "labels": column(self.labels)})
        return table if indices is None else table.take(pa.array(indices, type=pa.int64()))

