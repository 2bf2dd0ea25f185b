"""ZeRO stage × offload, defined once: the estimator's options, the sweeps' ``deepspeed.zero`` key
(``"3+all"``) and the label runs are compared by (``ZeRO-3 + offload``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from zerolab.config import SFTConfig

OffloadMode = Literal["none", "optimizer", "all"]


def label_of(stage: int | str, offload_optimizer: bool, offload_param: bool) -> str:
    """``ZeRO-3 + offload`` (optimizer and parameters), ``ZeRO-2 + optimizer offload``,
    ``ZeRO-3 + param offload``, ``ZeRO-0``."""
    both, opt, param = offload_optimizer and offload_param, offload_optimizer, offload_param
    extra = " + offload" if both else " + optimizer offload" if opt else " + param offload" if param else ""
    return f"ZeRO-{stage}{extra}"


@dataclass(frozen=True)
class Option:
    """A ZeRO stage with an offload mode (``all``: optimizer states and parameters)."""

    stage: int
    offload: OffloadMode = "none"

    @classmethod
    def of(cls, cfg: SFTConfig) -> Option:
        ds = cfg.deepspeed
        return cls(ds.stage, "all" if ds.offload_param else "optimizer" if ds.offload_optimizer else "none")

    @classmethod
    def parse(cls, key: str) -> Option:
        """From a sweep's ``deepspeed.zero`` value (:data:`ZERO_KEYS`); KeyError for others."""
        return _BY_KEY[str(key)]

    @property
    def key(self) -> str:
        return str(self.stage) + ("" if self.offload == "none" else f"+{self.offload}")

    @property
    def label(self) -> str:
        return label_of(self.stage, self.offload != "none", self.offload == "all")

    def values(self) -> dict[str, object]:
        """The config values that select this option."""
        return {"deepspeed.stage": self.stage, "deepspeed.offload_optimizer": self.offload != "none",
                "deepspeed.offload_param": self.offload == "all"}

    def overrides(self) -> list[str]:
        """The ``--set`` overrides that select this option."""
        return [f"{k}={str(v).lower()}" for k, v in self.values().items()]

    def apply(self, cfg: SFTConfig) -> SFTConfig:
        """``cfg`` with this option; a custom DeepSpeed JSON is kept only for the option it was written for."""
        same = Option.of(cfg) == self
        ds = dataclasses.replace(cfg.deepspeed, stage=self.stage, offload_optimizer=self.offload != "none",
                                 offload_param=self.offload == "all", config=cfg.deepspeed.config if same else None)
        return cfg.replace(deepspeed=ds)


SWEEP_OPTIONS = (Option(0), Option(1), Option(2), Option(2, "optimizer"), Option(3), Option(3, "optimizer"), Option(3, "all"))
"""The combinations DeepSpeed accepts, as a sweep names them."""
_BY_KEY = {o.key: o for o in SWEEP_OPTIONS}
ZERO_KEYS = tuple(_BY_KEY)
