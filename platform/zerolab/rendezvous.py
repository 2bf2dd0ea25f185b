"""The worker group's ``torch.distributed`` rendezvous, its port held from the moment it is chosen.

Ray Train's torch backend asks rank 0 for a free port (binding port 0 and closing the socket),
tells every rank, and rank 0's ``init_process_group`` binds that port again to serve the
rendezvous store. In between any process of the node may take it, an outgoing connection's
ephemeral port or another job's store: rank 0 then fails with EADDRINUSE and the run with it, or
the other ranks reach a store that is not theirs. Here rank 0 opens the store on port 0 and keeps
it open for as long as its process lives, and every rank, rank 0 too, joins it as a client: torch's
``env://`` rendezvous with ``TORCHELASTIC_USE_AGENT_STORE``, as torchrun's agent hosts the store
for its workers. Ray Train's torch backend does the rest as before (its rank variables, its
process group set-up and shutdown).

Imported where the worker group's trainer is built (``zerolab.run``), never in a job that trains
in its own process."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import ray
import torch.distributed as dist
from ray.train.torch import TorchConfig
from ray.train.torch.config import _set_torch_distributed_env_vars, _setup_torch_process_group, _TorchBackend

_store: Any = None
"""Rank 0's store server (``torch.distributed.TCPStore``), open while its worker process lives:
process groups made later (DeepSpeed's, sequence parallelism's) go through it too."""


def open_store(world_size: int, timeout_s: int) -> tuple[str, int]:
    """On rank 0: serve a rendezvous store on a port the system picks, kept open; its address."""
    global _store
    addr = ray.util.get_node_ip_address()
    _store = dist.TCPStore(addr, 0, world_size, is_master=True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    return addr, _store.port


def join_store(addr: str, port: int) -> None:
    """On every rank: the ``env://`` rendezvous joins the store at ``addr:port`` as a client."""
    os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True")


class _HeldPortBackend(_TorchBackend):
    def on_start(self, worker_group: Any, backend_config: TorchConfig) -> None:
        size = len(worker_group)
        addr, port = worker_group.execute_single(0, open_store, world_size=size, timeout_s=backend_config.timeout_s)
        worker_group.execute(join_store, addr=addr, port=port)
        worker_group.execute(_set_torch_distributed_env_vars)
        ray.get([worker_group.execute_single_async(rank, _setup_torch_process_group, backend=backend_config.backend, world_rank=rank,
                                                   world_size=size, init_method="env://", timeout_s=backend_config.timeout_s)
                 for rank in range(size)])


@dataclass
class HeldPortTorchConfig(TorchConfig):
    """Ray Train's :class:`~ray.train.torch.TorchConfig` whose rendezvous store is open before its
    port is named (the module's docstring). ``backend`` must be given (``nccl``, ``gloo``)."""

    @property
    def backend_cls(self) -> type:
        return _HeldPortBackend
