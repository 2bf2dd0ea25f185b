"""Two training loops launched with torchrun, the baselines of ``jobs/benchmark.py``.

``--mode plain``: what a user writes by hand with PyTorch and peft — the model in bf16, peft's
LoRA (adapters in fp32, as peft makes them), SDPA attention, torch AdamW with its defaults,
micro-batches of ``--micro-batch`` samples padded to their longest (dynamic padding), optional
gradient checkpointing, DDP over several GPUs.

``--mode zerolab``: zerolab's own training step without Ray: the same model building (kernels,
adapter), optimizer, scheduler, DeepSpeed engine and packed micro-batches as
``zerolab.train.train_loop_per_worker``, driven by torchrun instead of Ray Train. The difference
to a zerolab run is what Ray, Ray Data and the tracking add.

    torchrun --nproc_per_node 1 bench/torchrun_loop.py --mode plain --model M --data D --out R ...
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))

from bench.measure import StepMeter, model_counts, write_rank_result  # noqa: E402
from bench.workload import row_counts, tokenized_rows  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["plain", "zerolab"], required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True, type=Path)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--window", type=int, default=10)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--max-seq-length", type=int, default=4096)
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--set", action="append", default=[], help="zerolab mode: config overrides, as for jobs/sft.py")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="zerolab mode: after the measured steps, profile this many more and print where the GPU time goes")
    p.add_argument("--rss-trace", action="store_true",
                   help="zerolab mode: sample the process's resident memory every 20 ms and print its peak in each phase "
                        "(data, model, engine, steps)")
    p.add_argument("--memory-trace", action="store_true",
                   help="zerolab mode: trace the CUDA allocator over the steps and print what holds the memory at their "
                        "peak (bench/memory_trace.py; slows the steps)")
    args = p.parse_args(argv)

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    rss = RssTrace() if args.rss_trace else None
    rows = tokenized_rows(args.data, args.model)
    rows = [r for r in rows if len(r[0]) <= args.max_seq_length]
    counts = row_counts(rows)
    rows = rows[rank::world]
    if rss:
        rss.mark("data")
    meter = StepMeter(device)
    if args.mode == "plain":
        total, trainable = plain_loop(args, rows, device, world, meter)
        result = meter.result(args.window)
    else:
        total, trainable, result = zerolab_loop(args, rows, device, world, meter, rss)
    result.update(counts, total_params=total, trainable_params=trainable, world=world, device=_device_name(device))
    write_rank_result(args.out, result)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


class RssTrace:
    """This process's resident memory, sampled every 20 ms from a thread, split into named phases."""

    def __init__(self) -> None:
        import threading

        import psutil

        self._clock, self._process = time.perf_counter, psutil.Process()
        self.samples: list[tuple[float, int]] = []
        self.marks: list[tuple[float, str]] = [(self._clock(), "start")]
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        while True:
            self.samples.append((self._clock(), self._process.memory_info().rss))
            time.sleep(0.02)

    def mark(self, phase: str) -> None:
        """End the phase that ran since the last mark."""
        self.marks.append((self._clock(), phase))

    def report(self) -> list[str]:
        lines = []
        for (start, _), (end, phase) in zip(self.marks, self.marks[1:], strict=False):
            inside = [rss for t, rss in self.samples if start <= t <= end] or [0]
            lines.append(f"{phase:8s} {end - start:7.1f} s  peak {max(inside) / 2**30:7.3f} GiB  at its end {inside[-1] / 2**30:7.3f} GiB")
        return lines


def plain_loop(args: argparse.Namespace, rows: list, device: torch.device, world: int, meter: StepMeter) -> tuple[int, int]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    if world > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    torch.manual_seed(42)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
                                                 attn_implementation="sdpa").to(device)
    model.config.use_cache = False
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM"))
    total, trainable = model_counts(model)
    optimizer = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-4)
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    model.train()
    order = np.random.default_rng(42).permutation(len(rows))
    pad = 0
    for step in range(args.steps):
        take = [rows[i] for i in order[(step * args.micro_batch) % len(rows):][: args.micro_batch]]
        width = max(len(ids) for ids, _ in take)
        input_ids = torch.full((len(take), width), pad, dtype=torch.long)
        labels = torch.full((len(take), width), -100, dtype=torch.long)
        mask = torch.zeros((len(take), width), dtype=torch.long)
        for r, (ids, lab) in enumerate(take):
            input_ids[r, : len(ids)], labels[r, : len(lab)], mask[r, : len(ids)] = torch.from_numpy(ids), torch.from_numpy(lab), 1
        out = model(input_ids=input_ids.to(device), attention_mask=mask.to(device), labels=labels.to(device))
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_([q for q in model.parameters() if q.requires_grad], 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        meter.step_done(int(mask.sum()))
    return total, trainable


def zerolab_loop(args: argparse.Namespace, rows: list, device: torch.device, world: int,
                 meter: StepMeter, rss: RssTrace | None = None) -> tuple[int, int, dict]:
    from transformers import AutoConfig

    from zerolab import ds_config
    from zerolab.batches import MicroBatches
    from zerolab.config import load_config
    from zerolab.ds_runtime import init_distributed
    from zerolab.engine import Zero3Loading, build_model, initialize_engine
    from zerolab.models import load_tokenizer
    from zerolab.snapshot import seed_everything
    from zerolab.train import optimizer_step

    cfg = load_config(None, [*args.set, f"model.name_or_path={args.model}", f"scaling.num_workers={world}",
                             f"train.max_steps={args.steps}"])
    init_distributed("nccl" if device.type == "cuda" else "gloo")
    seed_everything(cfg.train.seed + dist.get_rank())
    resolved = ds_config.resolve(cfg, AutoConfig.from_pretrained(args.model))
    batches = MicroBatches(rows, micro_batch_size=cfg.train.micro_batch_size, max_seq_length=cfg.data.max_seq_length,
                           packing=cfg.data.packing, pad_id=load_tokenizer(cfg.model).pad_token_id, seed=cfg.train.seed)
    zero3 = Zero3Loading()  # held while the engine trains
    model = build_model(cfg, resolved, args.steps, zero3=zero3)
    mark = rss.mark if rss else lambda _: None
    mark("model")
    total, trainable = model_counts(model)
    engine = initialize_engine(model, cfg, resolved, args.steps)
    mark("engine")
    stream = batches.iterate()
    engine.train()

    def step() -> int:
        micro = [next(stream) for _ in range(cfg.train.grad_accum_steps)]
        optimizer_step(engine, micro, device)
        return sum(b.num_tokens for b in micro)

    def steps() -> None:
        for _ in range(args.steps):
            meter.step_done(step())

    if args.memory_trace and device.type == "cuda":
        from bench.memory_trace import format_breakdown, record

        set_up = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
        trace = record(steps)
        if dist.get_rank() == 0:
            print(f"MEMTRACE set-up peaks: allocated {set_up[0] / 2**30:.3f} GiB, reserved {set_up[1] / 2**30:.3f} GiB")
            print("\n".join(f"MEMTRACE {line}" for line in format_breakdown(trace).splitlines()))
    else:
        steps()
    mark("steps")
    if rss and dist.get_rank() == 0:
        print("\n".join(f"RSSTRACE {line}" for line in rss.report()))
    result = meter.result(args.window)
    if args.profile_steps:
        _profile(step, args.profile_steps, report=dist.get_rank() == 0)
    return total, trainable, result


def _profile(step, n: int, report: bool = True) -> None:
    """Print where ``n`` steps spend their time: GPU time by kernel (the 30 largest), by kind and in
    the wide and narrow matrix products (:func:`print_product_time`),
    how much of the step the GPU computes, communicates or idles (NCCL overlapped with compute or
    not), the host's blocking CUDA calls; then, over ``n`` more steps with the GPU's activity alone
    recorded, where the GPU waits for the host (:func:`print_idle_gaps`); then, over ``n`` more
    steps under cProfile, the host's Python time by function (DeepSpeed's ZeRO-3 hooks run there).
    The ranks that do not ``report`` take the same ``3 * n`` steps unprofiled: their collectives pair
    with the reporting rank's."""
    if not report:
        for _ in range(3 * n):
            step()
        return
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        wall_ms = _timed_steps(step, n)
    print_kernel_time(prof, n, wall_ms)
    _print_overlap(prof.events(), n)
    host = sorted((e for e in prof.key_averages() if e.device_type.name == "CPU" and e.key.startswith("cuda")),
                  key=lambda e: -e.self_cpu_time_total)[:8]
    for e in host:
        print(f"PROFILE host {e.key:40s} {e.count // n:6d}/step  {e.self_cpu_time_total / 1e3 / n:8.1f} ms/step")
    # The host's side slows under the profiler above; recording the GPU's activity alone keeps its
    # pace, so the gaps between kernels are the ones of an unprofiled step.
    with profile(activities=[ProfilerActivity.CUDA]) as quiet:
        wall_ms = _timed_steps(step, n)
    print_idle_gaps(quiet.events(), n, wall_ms)
    py = cProfile.Profile()
    py.enable()
    for _ in range(n):
        step()
    torch.cuda.synchronize()
    py.disable()
    stats = pstats.Stats(py)
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:25]  # by own time
    print(f"PROFILE python, {n} more steps under cProfile (own time; cProfile slows Python-heavy code):")
    for (file, line, func), (_, calls, own, cum, _) in rows:
        where = file.split("site-packages/")[-1].split("/platform/")[-1]
        print(f"PROFILE py {own * 1e3 / n:8.1f} ms/step own {cum * 1e3 / n:8.1f} cum {calls // n:7d}/step  {where}:{line}({func})")


def print_kernel_time(prof, n: int, wall_ms: float) -> None:
    """The GPU's time per step of a profile over ``n`` steps, by kind of kernel and for the 30 largest."""
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]  # kernels, not the operators launching them
    total = sum(e.self_device_time_total for e in events) or 1.0
    kinds = {"attention": ("flash", "fmha", "attention"), "matmul (gemm)": ("gemm", "cutlass", "nvjet", "sm90", "cublas", "splitk"),
             "nccl": ("nccl",), "copies/casts": ("copy", "cast", "convert"), "elementwise/reduce": ("elementwise", "reduce", "vectorized"),
             "liger/triton": ("_kernel", "triton")}
    by_kind: dict[str, float] = {}
    for e in events:
        kind = next((k for k, keys in kinds.items() if any(w in e.key.lower() for w in keys)), "other")
        by_kind[kind] = by_kind.get(kind, 0.0) + e.self_device_time_total
    print(f"PROFILE {n} steps, {wall_ms:.1f} ms/step wall, GPU time {total / 1e3 / n:.1f} ms/step by kind:")
    for kind, t in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"PROFILE   {kind:22s} {100 * t / total:5.1f}%  {t / 1e3 / n:8.1f} ms/step")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:30]:
        print(f"PROFILE   {100 * e.self_device_time_total / total:5.1f}%  {e.count // n:5d}/step  {e.key[:110]}")
    print_product_time(prof, n)


PRODUCTS = ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm")
"""The operators that launch the matrix-product kernels themselves (``matmul`` and ``linear`` call these)."""

NARROW = 128
"""A product with a matrix side under this many is an adapter's (LoRA's rank, or a few ranks stacked)."""


def product_kind(shapes: list[list[int]]) -> str | None:
    """``narrow`` for a product with a matrix side under :data:`NARROW` (an adapter's), else ``wide``
    (a frozen weight's); ``None`` for no matrix operand. ``shapes``: an operator's input shapes
    (a profile's ``record_shapes``), scalars and biases among them."""
    sides = [d for shape in shapes if len(shape) >= 2 for d in shape[-2:]]
    return None if not sides else "narrow" if min(sides) < NARROW else "wide"


def print_product_time(prof, n: int) -> None:
    """The GPU's time per step in the matrix products split by their shapes (:func:`product_kind`):
    the frozen weights' wide products against the adapters' narrow ones. Needs a profile that
    recorded shapes; the time is each operator's own kernels'."""
    by_kind: dict[str, list[float]] = {}
    for e in prof.key_averages(group_by_input_shape=True):
        kind = product_kind(e.input_shapes) if e.key in PRODUCTS else None
        if kind:
            t = by_kind.setdefault(kind, [0.0, 0])
            t[0] += e.self_device_time_total
            t[1] += e.count
    for kind, (t, count) in sorted(by_kind.items()):
        print(f"PROFILE products {kind:6s} {count // n:6d}/step  {t / 1e3 / n:8.1f} ms/step")


def _timed_steps(step, n: int) -> float:
    """Milliseconds per step of ``n`` steps, from an idle GPU to the last kernel's end (inside a
    profiler's block: its processing of the trace afterwards is not counted)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / n


def _print_overlap(events, n: int) -> None:
    """From the kernels' device intervals: the time per step the GPU runs compute kernels, NCCL
    kernels, both at once, and neither (idle)."""
    compute, nccl = [], []
    for e in events:
        if e.device_type.name != "CUDA" or e.time_range.elapsed_us() <= 0:
            continue
        (nccl if "nccl" in e.name.lower() else compute).append((e.time_range.start, e.time_range.end))
    if not compute:
        return

    def union(spans: list) -> list:
        merged: list = []
        for a, b in sorted(spans):
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        return merged

    def length(spans: list) -> float:
        return sum(b - a for a, b in spans)

    c, m = union(compute), union(nccl)
    both = union(compute + nccl)
    first, last = both[0][0], both[-1][1]
    overlap = length(c) + length(m) - length(both)
    per = 1e3 * n
    print(f"PROFILE timeline per step: span {(last - first) / per:.1f} ms, compute {length(c) / per:.1f} ms, NCCL {length(m) / per:.1f} ms "
          f"({overlap / per:.1f} ms of it under compute), idle {(last - first - length(both)) / per:.1f} ms")


def print_idle_gaps(events, n: int, wall_ms: float, min_gap_us: float = 20.0, top: int = 15) -> None:
    """Where the GPU waits for the host: the gaps between consecutive kernels (CUDA activity only)
    of at least ``min_gap_us``, summed per step by the kernels on either side, the largest first."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                   if e.device_type.name == "CUDA" and e.time_range.elapsed_us() > 0)
    if not spans:
        return
    gaps: dict[tuple[str, str], list[float]] = {}
    end, before = spans[0][1], spans[0][2]
    for a, b, name in spans[1:]:
        if a - end >= min_gap_us:
            gaps.setdefault((before[:40], name[:40]), []).append(a - end)
        if b > end:
            end, before = b, name
    idle = sum(sum(g) for g in gaps.values())
    print(f"PROFILE GPU activity only: {wall_ms:.1f} ms/step wall, gaps >= {min_gap_us:.0f} us {idle / 1e3 / n:.1f} ms/step "
          f"({sum(len(g) for g in gaps.values()) // n}/step); the largest, by the kernels before and after:")
    for (prev, nxt), g in sorted(gaps.items(), key=lambda kv: -sum(kv[1]))[:top]:
        print(f"PROFILE gap {sum(g) / 1e3 / n:7.2f} ms/step {len(g) // n:5d}/step  {prev} -> {nxt}")


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


if __name__ == "__main__":
    sys.exit(main())
