"""The run folder in ``run.storage_path/run.name``: relaunch checks, checkpoint integrity, restart.

Ray Train restores a run from the checkpoint snapshot in this folder whenever a job with the same
name and storage path starts again. Before that happens the driver checks here, where a problem
is still a clear message rather than a worker failure that Ray would retry: that the relaunched
job trains the same thing, and that the checkpoint it would resume from is readable.
"""

from __future__ import annotations

import json
import re
import zipfile
from dataclasses import dataclass
from typing import Any

import pyarrow.fs as pafs

from zerolab.config import SFTConfig

JOB_CONFIG_FILE = "zerolab_job.json"
SNAPSHOT_FILE = "checkpoint_manager_snapshot.json"
"""Ray Train V2's record of reported checkpoints in the run folder."""

RESUME_SAFE_KEYS = {
    "train.log_every_n_steps", "train.checkpoint_every_n_steps", "train.keep_checkpoints",
    "run.max_failures", "run.storage_path", "tracking.uri", "tracking.experiment",
    "scaling.cpus_per_worker", "scaling.placement_strategy", "model.attn_implementation",
    "model.gradient_checkpointing", "deepspeed.config",
}
"""Keys a relaunch may change without changing what is trained (or what the checkpoint holds)."""


class CheckpointError(RuntimeError):
    """The run folder cannot be resumed as it is; the message says what to do."""


@dataclass
class RunFolder:
    fs: pafs.FileSystem
    path: str
    uri: str

    @classmethod
    def of(cls, cfg: SFTConfig, storage_path: str) -> RunFolder:
        fs, root = pafs.FileSystem.from_uri(storage_path)
        return cls(fs=fs, path=f"{root.rstrip('/')}/{cfg.run.name}", uri=f"{storage_path.rstrip('/')}/{cfg.run.name}")

    def exists(self) -> bool:
        return self.fs.get_file_info(self.path).type == pafs.FileType.Directory

    def read_json(self, name: str) -> Any | None:
        info = self.fs.get_file_info(f"{self.path}/{name}")
        if info.type != pafs.FileType.File:
            return None
        with self.fs.open_input_stream(info.path) as f:
            return json.loads(f.read().decode())

    def write_json(self, name: str, value: Any) -> None:
        self.fs.create_dir(self.path, recursive=True)
        with self.fs.open_output_stream(f"{self.path}/{name}") as f:
            f.write(json.dumps(value, indent=2, sort_keys=True).encode())

    def delete(self) -> None:
        if self.exists():
            self.fs.delete_dir(self.path)

    def latest_checkpoint(self) -> str | None:
        """Folder name of the newest checkpoint Ray Train recorded, if any."""
        snapshot = self.read_json(SNAPSHOT_FILE)
        if not snapshot:
            return None
        latest = snapshot.get("latest_checkpoint_result")
        if isinstance(latest, str):  # the snapshot nests its records as JSON strings
            latest = json.loads(latest)
        return (latest or {}).get("checkpoint_dir_name")


def prepare_run_folder(cfg: SFTConfig, storage_path: str, *, restart: bool) -> str | None:
    """Make the run folder ready for this launch; returns the checkpoint it will resume from.

    ``restart`` deletes the folder (checkpoints included). Otherwise an existing folder must hold
    a job with the same training-relevant config, and its latest checkpoint must be readable.
    """
    folder = RunFolder.of(cfg, storage_path)
    if restart:
        folder.delete()
    resume_from = None
    if folder.exists():
        saved = folder.read_json(JOB_CONFIG_FILE)
        if saved is not None:
            # A key the record lacks came with a later zerolab: only a value other than its
            # default changes what is trained. A key the record has and zerolab no longer knows
            # cannot be set any more.
            now, default = cfg.flat(), SFTConfig().flat()
            changed = sorted(k for k in now if k not in RESUME_SAFE_KEYS and saved.get(k, default[k]) != now[k])
            if changed:
                diffs = ", ".join(f"{k}: {saved.get(k, default[k])!r} -> {now[k]!r}" for k in changed[:8])
                raise CheckpointError(
                    f"run.name '{cfg.run.name}' already exists in {folder.uri} with a different training config ({diffs}). "
                    "A relaunch resumes that run, so it must train the same thing: choose a new run.name, or pass "
                    "--restart to discard the old run and its checkpoints."
                )
        resume_from = folder.latest_checkpoint()
        if resume_from is not None:
            verify_checkpoint(folder, resume_from, stage=cfg.deepspeed.stage, world_size=cfg.world_size())
    folder.write_json(JOB_CONFIG_FILE, cfg.flat())
    return resume_from


def verify_checkpoint(folder: RunFolder, name: str, *, stage: int, world_size: int) -> None:
    """Check a checkpoint is complete: DeepSpeed state from every rank, readable archives.

    DeepSpeed's own loader only warns about a missing ``latest`` file and starts from scratch, and
    a truncated file fails deep inside a worker, where Ray would retry it; checking here turns both
    into one clear error before any worker starts.
    """
    path = f"{folder.path}/{name}"
    fix = (f"Delete {folder.uri}/{name} to resume from the checkpoint before it (if the run kept one), "
           "or pass --restart to start over.")
    state = f"{path}/deepspeed/state"
    infos = folder.fs.get_file_info(pafs.FileSelector(state, allow_not_found=True))
    files = {info.base_name: info for info in infos if info.type == pafs.FileType.File}
    if not any(n.startswith("mp_rank_") for n in files):
        raise CheckpointError(f"checkpoint {folder.uri}/{name} has no DeepSpeed model state (deepspeed/state/mp_rank_*); it is incomplete. {fix}")
    if stage > 0:
        ranks = {int(m.group(1)) for n in files if (m := re.match(r"zero_pp_rank_(\d+)_", n))}
        if ranks != set(range(world_size)):
            raise CheckpointError(
                f"checkpoint {folder.uri}/{name} holds ZeRO state of ranks {sorted(ranks)}, not of all {world_size} workers; "
                f"it is incomplete (or was written with another scaling.num_workers). {fix}"
            )
    for base, info in sorted(files.items()):
        if not base.endswith(".pt"):
            continue
        with folder.fs.open_input_file(info.path) as f:
            try:
                with zipfile.ZipFile(f) as archive:
                    bad = archive.testzip()
            except (zipfile.BadZipFile, OSError) as exc:
                raise CheckpointError(f"checkpoint {folder.uri}/{name} is corrupt: {base} cannot be read ({exc}). {fix}") from None
        if bad is not None:
            raise CheckpointError(f"checkpoint {folder.uri}/{name} is corrupt: {base} fails its checksum at {bad}. {fix}")
