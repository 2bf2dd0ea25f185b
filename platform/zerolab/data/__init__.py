"""Data: read, validate, render and tokenize once on the driver (cached); batch on the workers.

The package's modules, each importing only those above it in this list:

- :mod:`~zerolab.data.formats`: files. Which files a path names, their fingerprint, each file
  (JSON array, JSONL or Parquet) parsed into rows with their file and line.
- :mod:`~zerolab.data.tokens`: rows -> messages -> tokens. Each row as chat messages
  (instruction/input/output, NER text/label with the label serialised to JSON, or ``messages``),
  rendered with the tokenizer's chat template, tokenized in batches, prompt tokens masked with -100.
- :mod:`~zerolab.data.prepared`: the prepared split (:class:`PreparedSplit`, every row's tokens end
  to end with per-row ``lengths``) and its report, the format the driver makes and the shards read.
- :mod:`~zerolab.data.prepare`: the driver's preparation of one split end to end
  (:func:`prepare_split`): the tokenized-data cache, in this process or with Ray Data
  (:func:`needs_ray_data`), the bad-row report, ``data.max_seq_length: auto``.
- :mod:`~zerolab.data.shards`: the workers' side. :func:`shard_rows` assigns rows to ranks
  deterministically and :func:`worker_datasets` hands each rank its rows through Ray's object store
  (workers never open the data files); :class:`zerolab.batches.MicroBatches` shuffles the shard per
  epoch from the seed and yields micro-batches padded to their own longest row (or packed).

Importing the package imports neither torch nor transformers nor Ray; they are imported where used.
"""

from zerolab.data.formats import SUPPORTED_SUFFIXES, DataError, fingerprint, list_data_files, parse_file, scan_data_files
from zerolab.data.prepare import (
    cache_key,
    data_identity,
    dataset_paths,
    max_positions,
    needs_ray_data,
    prepare_split,
    resolve_max_seq_length,
)
from zerolab.data.prepared import PreparedSplit, SplitReport
from zerolab.data.shards import load_shard, shard_rows, worker_datasets
from zerolab.data.tokens import (
    RowError,
    chat_spans,
    join_spans,
    prompt_and_target,
    row_to_messages,
    tokenize_batch,
    tokenize_messages,
    tokenize_rows,
    tokenizer_fingerprint,
)

__all__ = [
    "SUPPORTED_SUFFIXES",
    "DataError",
    "PreparedSplit",
    "RowError",
    "SplitReport",
    "cache_key",
    "chat_spans",
    "data_identity",
    "dataset_paths",
    "fingerprint",
    "join_spans",
    "list_data_files",
    "load_shard",
    "max_positions",
    "needs_ray_data",
    "parse_file",
    "prepare_split",
    "prompt_and_target",
    "resolve_max_seq_length",
    "row_to_messages",
    "scan_data_files",
    "shard_rows",
    "tokenize_batch",
    "tokenize_messages",
    "tokenize_rows",
    "tokenizer_fingerprint",
    "worker_datasets",
]
