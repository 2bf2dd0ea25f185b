"""The worker group's rendezvous (``zerolab.rendezvous``): rank 0's store holds its port from the
moment the port is named, so no other process on the node can take it before the ranks meet."""

from __future__ import annotations

import errno
import json
import socket
from datetime import timedelta

import pytest


def test_the_store_holds_its_port_from_the_moment_it_is_named():
    """Ray Train's own backend names a port it has already let go of; here nothing else can bind
    the named port while the store lives, and a client joining it reaches rank 0's server."""
    import torch.distributed as dist

    from zerolab import rendezvous

    addr, port = rendezvous.open_store(world_size=2, timeout_s=30)
    try:
        with socket.socket() as other, pytest.raises(OSError) as taken:
            other.bind((addr, port))
        assert taken.value.errno == errno.EADDRINUSE
        client = dist.TCPStore(addr, port, 2, is_master=False, timeout=timedelta(seconds=30))
        client.set("rank1", "here")
        assert rendezvous._store.get("rank1") == b"here"
    finally:
        rendezvous._store = None


@pytest.mark.ray
def test_two_workers_meet_at_rank_zeros_held_store(ray_cluster, tmp_path):
    """A two-worker group under zerolab's torch config: both ranks join the store rank 0 opened
    (the port they were told is the one its server holds) and reduce across it, in the world
    group and in a group made afterwards."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from zerolab.rendezvous import HeldPortTorchConfig

    def meet() -> None:  # defined here: Ray pickles it by value (the test module is not importable on workers)
        import os

        import ray.train
        import torch
        import torch.distributed as dist

        from zerolab import rendezvous

        rank = ray.train.get_context().get_world_rank()
        total = torch.tensor([rank + 1.0])
        dist.all_reduce(total)
        later = dist.new_group([0, 1])  # a group made after the rendezvous (DeepSpeed's) meets through the same store
        again = torch.tensor([rank + 1.0])
        dist.all_reduce(again, group=later)
        if rank == 0:  # this machine's one node: the test reads it back
            out.write_text(json.dumps({"sum": total.item(), "again": again.item(), "port": int(os.environ["MASTER_PORT"]),
                                       "held": rendezvous._store.port, "agent_store": os.environ["TORCHELASTIC_USE_AGENT_STORE"]}))

    out = tmp_path / "rank0.json"
    trainer = TorchTrainer(meet, torch_config=HeldPortTorchConfig(backend="gloo"), scaling_config=ScalingConfig(num_workers=2),
                           run_config=RunConfig(name="meet", storage_path=str(tmp_path)))
    trainer.fit()
    metrics = json.loads(out.read_text())
    assert metrics["sum"] == metrics["again"] == 3.0
    assert metrics["port"] == metrics["held"] and metrics["agent_store"] == "True"
