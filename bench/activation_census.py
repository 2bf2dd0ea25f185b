"""What one forward of a zerolab model saves for its backward, by tensor shape and dtype, next to the
memory estimate's activation term: the tool for finding which saved tensor a formula misses.

    python bench/activation_census.py --model /tmp/zerolab-bench/models/random-qwen2.5-0.5b \\
        --set adapter.method=adalora --set train.precision=fp32 --set train.micro_batch_size=4 \\
        --set data.max_seq_length=1024 --set data.packing=true --row-tokens 256

The model is built as a worker builds it (``zerolab.engine.build_model``: Liger's kernels, the fused
LoRA forward, the adapter) on this machine's GPU (or CPU), one micro-batch of synthetic rows of
``--row-tokens`` tokens is collated by the run's own batcher, and the forward runs under
``saved_tensors_hooks``. Printed: the largest saved tensors, their total, the allocator's peak over
forward and backward beyond the weights, and the estimate's activations at the configured size
(``train.micro_batch_size`` × ``data.max_seq_length``: packed rows that fill their sequences match it).
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="model folder")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="job config override")
    parser.add_argument("--row-tokens", type=int, default=256, help="tokens per synthetic row")
    parser.add_argument("--top", type=int, default=12, help="saved tensor groups to print")
    args = parser.parse_args(argv)

    import numpy as np
    import torch

    from zerolab.batches import MicroBatches
    from zerolab.config import load_config
    from zerolab.engine import Zero3Loading, build_model
    from zerolab.memory import GIB, estimate, load_model_config

    gpu = torch.cuda.is_available()
    cfg = load_config(None, [f"model.name_or_path={args.model}", f"scaling.use_gpu={str(gpu).lower()}", *args.set])
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    model = build_model(cfg, {}, total_steps=100, zero3=Zero3Loading(), device=device)
    model.train()
    rows_needed = cfg.train.micro_batch_size * max(1, cfg.data.max_seq_length // args.row_tokens if cfg.data.packing else 1)
    rng = np.random.default_rng(0)
    rows = [(ids, ids.copy()) for ids in (rng.integers(10, 1000, args.row_tokens) for _ in range(rows_needed))]
    batches = MicroBatches(rows, micro_batch_size=cfg.train.micro_batch_size, max_seq_length=cfg.data.max_seq_length,
                           packing=cfg.data.packing, pad_id=0, seed=0)
    batch = batches.collate(batches.plan(list(range(len(rows))))[0])
    inputs = {k: v.to(device) for k, v in batch.inputs.items()}
    tokens = inputs["input_ids"].numel()

    params = {p.data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}
    groups: collections.Counter = collections.Counter()

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and storage.data_ptr() not in seen:
            seen[storage.data_ptr()] = storage.nbytes()
            groups[(tuple(t.shape), str(t.dtype).removeprefix("torch."))] += storage.nbytes()
        return t

    if gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(**inputs).loss
    saved = sum(seen.values())
    by_op = _saved_by_op(loss.grad_fn, params)
    loss.backward()
    est = estimate(cfg, load_model_config(cfg))
    print(f"micro-batch {tuple(inputs['input_ids'].shape)} ({tokens} tokens), {cfg.adapter.method}, {cfg.precision()}, "
          f"attention {cfg.model.attn_implementation}, kernels {cfg.model.kernels}")
    for (shape, dtype), nbytes in groups.most_common(args.top):
        print(f"  {nbytes / 2**20:10.1f} MiB  {dtype:9s} {shape}")
    print(f"saved for backward: {saved / GIB:.3f} GiB ({saved / tokens:,.0f} B/token); by the op that saved it:")
    for (op, shape), (nbytes, count) in sorted(by_op.items(), key=lambda kv: -kv[1][0])[:args.top]:
        print(f"  {nbytes / 2**20:10.1f} MiB  {count:4d} × {op} {shape}")
    if gpu:
        print(f"allocator peak over forward+backward beyond the weights: {(torch.cuda.max_memory_allocated() - before) / GIB:.3f} GiB")
    print(f"estimate: activations {est.device['activations'] / GIB:.3f} GiB, logits and loss {est.device['logits and loss'] / GIB:.3f} GiB "
          f"(at {est.micro_batch_size} × {est.seq_len} tokens)")
    return 0


def _saved_by_op(root: Any, params: set[int]) -> dict[tuple[str, tuple], list[int]]:
    """Bytes and count of the tensors each kind of autograd node saved (first node per storage),
    walking the graph from ``root``: built-in nodes' ``_saved_*`` attributes and custom Functions'
    ``saved_tensors``."""
    import torch

    out: dict[tuple[str, tuple], list[int]] = collections.defaultdict(lambda: [0, 0])
    seen_nodes, seen_storage, stack = set(), set(), [root]
    while stack:
        node = stack.pop()
        if node is None or node in seen_nodes:
            continue
        seen_nodes.add(node)
        tensors = []
        for name in dir(node):
            if name.startswith("_saved_"):
                try:
                    value = getattr(node, name)
                except RuntimeError:  # freed or undefined
                    continue
                tensors.extend(value if isinstance(value, (list, tuple)) else [value])
        if hasattr(node, "saved_tensors"):
            try:
                tensors.extend(node.saved_tensors)
            except RuntimeError:
                pass
        tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
        op = type(node).__name__.removesuffix("Backward")
        for t in tensors:
            ptr = t.untyped_storage().data_ptr()
            if ptr in params or ptr in seen_storage or t.untyped_storage().nbytes() < 1 << 20:
                continue
            seen_storage.add(ptr)
            entry = out[(op, tuple(t.shape))]
            entry[0] += t.untyped_storage().nbytes()
            entry[1] += 1
        stack.extend(n for n, _ in node.next_functions)
    return out


if __name__ == "__main__":
    sys.exit(main())
