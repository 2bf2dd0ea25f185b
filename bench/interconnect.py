"""What the GPUs of one host give NCCL: all-gather and all-reduce bandwidth by message size, alone
and while a matrix product keeps the GPU busy (as ZeRO-3's gathers run beside the layers' compute).

    torchrun --standalone --nproc_per_node 2 bench/interconnect.py

Prints one line per size, rank 0: algorithm bandwidth (the gathered tensor's bytes / time) and bus
bandwidth (what each rank receives / time: NCCL's own measure, comparable over GPU counts). ``NCCL_DEBUG=INFO`` adds the transport
NCCL chose (P2P over NVLink, or SHM through host memory).
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist


def timed(fn, repeat: int) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeat


def measure(numel: int, world: int, a: torch.Tensor, matmul: float, side: torch.cuda.Stream) -> str:
    shard = torch.ones(numel, device="cuda", dtype=torch.bfloat16)
    full = torch.empty(numel * world, device="cuda", dtype=torch.bfloat16)
    gather = timed(lambda: dist.all_gather_into_tensor(full, shard), 10)
    reduce = timed(lambda: dist.all_reduce(shard), 10)
    products = max(1, round(gather / matmul))

    def both() -> None:
        with torch.cuda.stream(side):
            dist.all_gather_into_tensor(full, shard)
        for _ in range(products):
            a @ a
        torch.cuda.current_stream().wait_stream(side)

    together = timed(both, 10)
    received = numel * 2 * (world - 1)
    return (f"all-gather {gather * 1e3:7.2f} ms, {full.numel() * 2 / gather / 1e9:6.1f} GB/s algbw ({received / gather / 1e9:6.1f} busbw); "
            f"all-reduce {reduce * 1e3:7.2f} ms, {2 * (world - 1) / world * numel * 2 / reduce / 1e9:6.1f} GB/s busbw; "
            f"all-gather beside {products} 8k matmuls ({matmul * 1e3:.2f} ms each, {products * matmul * 1e3:.2f} together): "
            f"{together * 1e3:.2f} ms")


def main() -> None:
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        peers = [(i, j, torch.cuda.can_device_access_peer(i, j)) for i in range(torch.cuda.device_count())
                 for j in range(torch.cuda.device_count()) if i != j]
        print(f"INTERCONNECT {world} ranks, {torch.cuda.get_device_name()}, peer access: {peers}", flush=True)
    side = torch.cuda.Stream()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    matmul = timed(lambda: a @ a, 10)
    for mib in (4, 64, 233):  # 233 MiB: one rank's share of a 7B Qwen2 decoder layer in bf16 on 2 GPUs
        line = measure(mib * 2**20 // 2, world, a, matmul, side)
        if rank == 0:
            print(f"INTERCONNECT {mib:4d} MiB/rank: {line}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
