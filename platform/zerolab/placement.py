"""Where a training worker runs, and what follows from it: its rank, device, process group, data
shard, the checkpoint it resumes and where its reports go.

A :class:`RayWorker` is a process of Ray Train's worker group; :class:`InDriver` is the job's own
process (``scaling.launch=driver``). The loop (``zerolab.train``) asks its place and never which
one it is."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from zerolab.checkpoints import RunFolder, record_checkpoint
from zerolab.data import PreparedSplit, load_shard, shard_rows
from zerolab.ds_runtime import forget_deepspeed_groups, init_distributed


class RayWorker:
    """A process of Ray Train's worker group: its rank, data shard and checkpoints come through
    Ray Train (which persists each checkpoint to the run folder and hands the newest back on a
    retry or a relaunch); ``fit()`` returns the last report."""

    def context(self) -> Any:
        import ray.train

        return ray.train.get_context()

    def device(self, use_gpu: bool) -> torch.device:
        import ray.train.torch

        return ray.train.torch.get_device() if use_gpu else torch.device("cpu")

    @contextlib.contextmanager
    def process_group(self, backend: str) -> Iterator[None]:
        init_distributed(backend)  # Ray Train set the rendezvous variables
        yield

    def rows(self, split: str) -> list[tuple[np.ndarray, np.ndarray]] | None:
        import ray.train

        try:
            return load_shard(ray.train.get_dataset_shard(split))
        except KeyError:
            return None

    def checkpoint(self) -> Any:
        import ray.train

        return ray.train.get_checkpoint()

    def report(self, metrics: dict[str, Any], folder: Path | None = None, name: str | None = None) -> None:
        import ray.train
        from ray.train import Checkpoint

        checkpoint = Checkpoint.from_directory(str(folder)) if folder is not None else None
        ray.train.report(metrics, checkpoint=checkpoint, checkpoint_dir_name=name)


class OneRank:
    """The training context of a one-process world (what ``ray.train.get_context()`` says of a
    worker group's only rank; Ray Train's own is not available inside a Tune trial)."""

    def get_world_rank(self) -> int:
        return 0

    def get_world_size(self) -> int:
        return 1

    def get_local_rank(self) -> int:
        return 0

    def get_node_rank(self) -> int:
        return 0


@dataclass
class InDriver:
    """The job's own process as its one worker (``scaling.launch=driver``: Ray Train's local mode,
    which starts no worker group, persists no checkpoint and hands none back): the driver's
    prepared splits are the shard, checkpoints are written into the run folder as Ray Train
    writes them (:func:`zerolab.checkpoints.record_checkpoint`), a Tune trial gets each report,
    and the last report is ``last`` (``fit()``'s result holds none)."""

    splits: dict[str, PreparedSplit]
    folder: RunFolder
    resume_from: str | None
    """The run folder's checkpoint to resume (chosen by the driver), if any."""
    keep: int
    in_tune: bool
    last: tuple[dict[str, Any], Any] = ({}, None)
    """The last report's metrics and checkpoint (a ``ray.train.Checkpoint`` in the run folder)."""

    def __post_init__(self) -> None:
        # A relaunch whose checkpoint is the final step's trains and reports nothing: the run ends there.
        if self.resume_from:
            self.last = (self.folder.checkpoint_metrics(self.resume_from), self.checkpoint())

    def context(self) -> OneRank:
        return OneRank()

    def device(self, use_gpu: bool) -> torch.device:
        # Ray reserved this process's GPU (a Tune trial, `--entrypoint-num-gpus`) through
        # CUDA_VISIBLE_DEVICES, or the job owns the node's Ray instance.
        return torch.device("cuda", 0) if use_gpu else torch.device("cpu")

    @contextlib.contextmanager
    def process_group(self, backend: str) -> Iterator[None]:
        """A one-rank process group (DeepSpeed needs one) on an in-process store, so no port is
        taken, and the rank variables set only while it lives: the process goes on after the run
        (a Tune trial's actor trains the next trial)."""
        env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
            init_distributed(backend, auto_mpi_discovery=False)  # DeepSpeed's communication on that group
            yield
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
            forget_deepspeed_groups()
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def rows(self, split: str) -> list[tuple[np.ndarray, np.ndarray]] | None:
        prepared = self.splits.get(split)
        if prepared is None:
            return None
        (indices,) = shard_rows(prepared.num_rows, 1, equal=split == "train")
        return prepared.rows(indices)

    def checkpoint(self) -> Any:
        from ray.train import Checkpoint

        return Checkpoint(f"{self.folder.path}/{self.resume_from}", filesystem=self.folder.fs) if self.resume_from else None

    def report(self, metrics: dict[str, Any], folder: Path | None = None, name: str | None = None) -> None:
        from ray.train import Checkpoint

        checkpoint = None
        if folder is not None:
            assert name is not None
            checkpoint = Checkpoint(record_checkpoint(self.folder, folder, name, metrics, self.keep), filesystem=self.folder.fs)
        self.last = (metrics, checkpoint)
        if self.in_tune:
            import ray.tune

            ray.tune.report({**metrics, **({"checkpoint_path": checkpoint.path} if checkpoint else {})})



Place = RayWorker | InDriver
"""Where a worker runs."""
