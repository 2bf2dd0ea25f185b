"""Correctness of the GPU kernels on the machine the benchmark runs on, before any figure is taken.

    python bench/gpu_checks.py --model <folder of a Qwen2-shaped model> --data <mix.jsonl> --out checks.json

One batch of the benchmark's rows (seven short, one of ~1,000 tokens) gives the loss and the gradient norm of the
model in bf16 four ways: padded with SDPA (the reference), packed with SDPA and the block-diagonal
mask from position ids, packed with the varlen kernel, and packed with the varlen kernel and
Liger's kernels (fused linear + cross-entropy, RMSNorm, SwiGLU, RoPE). Each must match the
reference within bf16 rounding; the relative differences are written out and printed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))


def main(argv: list[str] | None = None) -> int:
    from bench.workload import tokenized_rows

    from zerolab import kernels
    from zerolab.batches import MicroBatches
    from zerolab.config import ModelSpec
    from zerolab.models import load_model

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)

    device = torch.device("cuda")
    rows = tokenized_rows(args.data, args.model)
    long = min(range(len(rows)), key=lambda i: abs(len(rows[i][0]) - 1024))  # a long row, small enough to pad 8 rows to
    batch_rows = [rows[long], *rows[:7]]
    padded = MicroBatches(batch_rows, micro_batch_size=8, max_seq_length=8192, packing=False, pad_id=0, seed=0).sequential()[0]
    packed = MicroBatches(batch_rows, micro_batch_size=8, max_seq_length=8192, packing=True, pad_id=0, seed=0).sequential()[0]
    report: dict[str, object] = {"varlen_unavailable": kernels.varlen_unavailable_reason(device), "rows": len(batch_rows),
                                 "tokens": padded.num_tokens, "packed_rows": int(packed.inputs["input_ids"].shape[0])}

    def loss_and_grad(attn: str, batch, liger: bool = False) -> tuple[float, float]:
        torch.manual_seed(0)
        model = load_model(ModelSpec(name_or_path=args.model, attn_implementation=attn), torch.bfloat16)
        model.config.use_cache = False
        applied = kernels.apply_liger(model, fused_loss=True) if liger else []
        if liger:
            report["liger_applied"] = applied
        model.to(device).train()
        out = model(**{k: v.to(device) for k, v in batch.inputs.items()}, num_items_in_batch=batch.num_targets)
        out.loss.backward()
        norm = torch.linalg.vector_norm(torch.stack([p.grad.float().norm() for p in model.parameters() if p.grad is not None]))
        result = (out.loss.item(), norm.item())
        del model, out
        torch.cuda.empty_cache()
        return result

    ref = loss_and_grad("sdpa", padded)
    report["reference"] = {"loss": ref[0], "grad_norm": ref[1]}
    variants = [("packed_sdpa", "sdpa", False), ("packed_varlen", "varlen", False)]
    if kernels.liger_available():
        variants.append(("packed_varlen_liger", "varlen", True))
    ok = True
    for name, attn, liger in variants:
        loss, norm = loss_and_grad(attn, packed, liger)
        d_loss, d_norm = abs(loss - ref[0]) / abs(ref[0]), abs(norm - ref[1]) / abs(ref[1])
        passed = d_loss < 1e-2 and d_norm < 5e-2
        ok &= passed
        report[name] = {"loss": loss, "grad_norm": norm, "rel_diff_loss": d_loss, "rel_diff_grad_norm": d_norm, "ok": passed}
    report["ok"] = ok
    args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
