"""What the driver hands every training worker: one small, picklable, frozen :class:`WorkerPlan`
(``zerolab.run.build_trainer`` makes it; ``zerolab.train.train_loop_per_worker`` reads it once).

Ray Train passes its ``train_loop_config`` as a dict: the plan travels under its one key, ``"plan"``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from zerolab.config import SFTConfig

if TYPE_CHECKING:
    from zerolab.placement import InDriver


@dataclass(frozen=True)
class TrackingTarget:
    """The MLflow run that rank 0 logs metrics to (and each node's local rank 0 its system metrics)."""

    uri: str | None
    """The tracking URI the driver resolved."""
    run_id: str


@dataclass(frozen=True)
class WorkerPlan:
    sft: SFTConfig
    """The driver's validated job config; workers do not re-check paths that exist on the driver only."""
    deepspeed: dict[str, Any]
    """The resolved DeepSpeed JSON."""
    tracking: TrackingTarget | None = None
    """Where metrics go; ``None``: the run is not tracked."""
    stop_flag: Any = None
    """The driver's stop flag (``zerolab.stop.StopSignal``): an Event in the job's own process, else an
    actor; ``None``: nothing asks the run to stop."""
    deadline_unix: float | None = None
    """``run.max_wall_time_s`` as a wall-clock time."""
    report_every_log: bool = False
    """Under Tune: every logged window is reported, not only checkpoints."""
    in_driver: InDriver | None = None
    """Set when the job's own process is the one worker (``scaling.launch=driver``)."""
