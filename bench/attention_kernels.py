"""Causal attention kernels on one GPU, forward and backward, at the shapes zerolab trains: the
varlen FlashAttention-2 kernel zerolab runs on rows of several samples (``torch.nn.attention.varlen``),
and SDPA's FlashAttention and cuDNN backends on rows of one sample (GQA's fewer K/V heads as they
are, and repeated to the query heads). Prints TFLOP/s (causal FLOPs: forward 2·2·S²/2·H·D per
sequence, backward 2.5× that), the memory each holds above its inputs, and each kernel's relative
error against the varlen kernel's output and gradients.

    python bench/attention_kernels.py --out attention.md
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))

SHAPES = {"qwen2.5-7b": (28, 4, 128), "qwen2.5-0.5b": (14, 2, 64)}
# (shape, the sequences of one packed row): short samples as the benchmark mix packs them, long rows of one
# sample, and a long row packed from several.
CASES = [("qwen2.5-7b", [1024] * 4), ("qwen2.5-7b", [2900, 700, 300, 196]), ("qwen2.5-7b", [32768]),
         ("qwen2.5-7b", [20000, 8000, 4768]), ("qwen2.5-7b", [131072]), ("qwen2.5-0.5b", [1024] * 4), ("qwen2.5-0.5b", [65536])]


def sdpa(backend, gqa):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run(q, k, v, cu, max_len, scale):
        assert cu.numel() == 2, "one sequence only"
        qt, kt, vt = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        if not gqa:
            rep = q.shape[1] // k.shape[1]
            kt, vt = kt.repeat_interleave(rep, 1), vt.repeat_interleave(rep, 1)
        with sdpa_kernel(getattr(SDPBackend, backend)):
            out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=gqa)
        return out.squeeze(0).transpose(0, 1)

    return run


def kernels():
    from zerolab.kernels import _varlen_call

    return {"varlen FA2": _varlen_call, "SDPA flash": sdpa("FLASH_ATTENTION", True), "SDPA cuDNN, enable_gqa": sdpa("CUDNN_ATTENTION", True),
            "SDPA cuDNN, K/V repeated": sdpa("CUDNN_ATTENTION", False)}


def measure(fn, q, k, v, cu, max_len, scale, grad, iters):
    def once():
        for t in (q, k, v):
            t.grad = None
        out = fn(q, k, v, cu, max_len, scale)
        out.backward(grad)
        return out

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = once()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    start, mid, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    fwd = bwd = 0.0
    for _ in range(iters):
        for t in (q, k, v):
            t.grad = None
        start.record()
        o = fn(q, k, v, cu, max_len, scale)
        mid.record()
        o.backward(grad)
        end.record()
        torch.cuda.synchronize()
        fwd += start.elapsed_time(mid) / iters
        bwd += mid.elapsed_time(end) / iters
    return out.detach(), [t.grad.detach().clone() for t in (q, k, v)], fwd, bwd, peak


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    dev = torch.device("cuda")
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, {torch.cuda.get_device_name()}", flush=True)
    lines = ["| shape | sequences | kernel | forward ms | backward ms | TFLOP/s fwd / bwd | peak above inputs MiB | rel. error out / dq / dk / dv |",
             "|---|---|---|---|---|---|---|---|"]
    records = []
    for shape, lengths in CASES:
        hq, hkv, d = SHAPES[shape]
        total = sum(lengths)
        gen = torch.Generator(device=dev).manual_seed(0)
        q, k, v = (torch.randn(total, h, d, device=dev, dtype=torch.bfloat16, generator=gen).requires_grad_() for h in (hq, hkv, hkv))
        grad = torch.randn(total, hq, d, device=dev, dtype=torch.bfloat16, generator=gen)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=dev)
        flops = sum(2 * 2 * n * n / 2 * hq * d for n in lengths)
        iters = 2 if total > 100_000 else 5
        ref = None
        for name, fn in kernels().items():
            if name.startswith("SDPA") and len(lengths) > 1:
                continue  # SDPA takes rows of one sequence
            try:
                out, grads, fwd, bwd, peak = measure(fn, q, k, v, cu, max(lengths), d**-0.5, grad, iters)
            except Exception as exc:  # a backend this torch or GPU lacks
                print(f"{shape} {lengths} {name}: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}", flush=True)
                lines.append(f"| {shape} | {'+'.join(map(str, lengths))} | {name} | — | — | — | — | {type(exc).__name__} |")
                continue
            if ref is None:
                ref = (out, grads)
            err = [((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip([out, *grads], [ref[0], *ref[1]])]
            rec = {"shape": shape, "lengths": lengths, "kernel": name, "fwd_ms": fwd, "bwd_ms": bwd,
                   "tflops_fwd": flops / fwd / 1e9, "tflops_bwd": 2.5 * flops / bwd / 1e9, "peak_mib": peak / 2**20, "rel_err": err}
            records.append(rec)
            print(json.dumps(rec), flush=True)
            lines.append(f"| {shape} | {'+'.join(map(str, lengths))} | {name} | {fwd:.2f} | {bwd:.2f} | {rec['tflops_fwd']:.0f} / "
                         f"{rec['tflops_bwd']:.0f} | {peak / 2**20:,.0f} | {' / '.join(f'{e:.1e}' for e in err)} |")
            del out, grads
            torch.cuda.empty_cache()
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
        args.out.with_suffix(".json").write_text(json.dumps(records, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
