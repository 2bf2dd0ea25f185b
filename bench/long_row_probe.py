"""Where a long row's GPU memory goes, layer by layer: the model as zerolab's engine builds it
(Liger's kernels, the fused LoRA forward, the varlen kernel, gradient checkpointing and the
long-row settings), one packed row of random tokens, forward and backward without DeepSpeed.

    python bench/long_row_probe.py --model M --tokens 131072 --variant ckpt --variant ckpt-offload --variant ckpt-offload-tiled

For each variant it prints the memory allocated after loading, after the forward pass, at each decoder
layer's backward (the allocator's current bytes as its backward begins) and the peak, and the
memory estimate's figure for the same job (``zerolab.memory.estimate``), so a term the estimate
misses shows as the layer where the two part.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))

GIB = 1024**3
VARIANTS = {"ckpt": (), "ckpt-offload": ("model.offload_checkpoints=true",), "ckpt-tiled": ("model.tiled_mlp=auto",),
            "ckpt-offload-tiled": ("model.offload_checkpoints=true", "model.tiled_mlp=auto")}


def probe(model_path: str, tokens: int, variant: str, rope_factor: float, device: torch.device) -> dict:
    from zerolab.batches import MicroBatches
    from zerolab.config import load_config
    from zerolab.engine import Zero3Loading, build_model
    from zerolab.memory import estimate
    from zerolab.models import decoder_layers, load_model_config

    overrides = [f"model.name_or_path={model_path}", "model.attn_implementation=varlen", "model.gradient_checkpointing=true",
                 "adapter.r=16", "adapter.alpha=32", "adapter.dropout=0.0", "adapter.target_modules=[all-linear]",
                 f"scaling.use_gpu={str(device.type == 'cuda').lower()}", "scaling.num_workers=1", "train.micro_batch_size=1", "data.packing=true",
                 f"data.max_seq_length={tokens}", "deepspeed.stage=0", *VARIANTS[variant]]
    if rope_factor > 1:
        overrides += ["model.rope_scaling=yarn", f"model.rope_factor={rope_factor:g}"]
    cfg = load_config(None, overrides)
    cuda = device.type == "cuda"
    allocated = torch.cuda.memory_allocated if cuda else (lambda: 0)  # a CPU run checks the script, measures nothing
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    model = build_model(cfg, {}, 1, zero3=Zero3Loading(), device=device).train()
    loaded = allocated()
    gen = torch.Generator().manual_seed(0)
    vocab = model.get_input_embeddings().weight.shape[0]
    ids = torch.randint(5, min(vocab, 30000), (tokens - 1,), generator=gen).numpy()
    batch = MicroBatches([(ids, ids.copy())], micro_batch_size=1, max_seq_length=tokens, packing=True, pad_id=0, seed=0).sequential()[0]
    marks: list[float] = []
    hooks = [layer.register_full_backward_pre_hook(lambda m, g: marks.append(allocated() / GIB))
             for layer in decoder_layers(model)]
    inputs = {k: v.to(device) for k, v in batch.inputs.items()}
    out = model(**inputs, num_items_in_batch=batch.num_targets)
    after_forward = allocated()
    out.loss.backward()
    if cuda:
        torch.cuda.synchronize()
    for h in hooks:
        h.remove()
    predicted = estimate(cfg, load_model_config(cfg.model))
    result = {"variant": variant, "tokens": tokens, "loaded_gib": loaded / GIB, "after_forward_gib": after_forward / GIB,
              "peak_gib": torch.cuda.max_memory_allocated() / GIB if cuda else 0.0, "layers_backward_gib": [round(m, 2) for m in marks],
              "estimate_peak_gib": predicted.device_peak / GIB,
              "estimate_device_gib": {k: round(v / GIB, 3) for k, v in predicted.device.items()}}
    del model, out
    if cuda:
        torch.cuda.empty_cache()
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--tokens", type=int, required=True)
    p.add_argument("--variant", action="append", choices=sorted(VARIANTS), default=[])
    p.add_argument("--rope-factor", type=float, default=1.0)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    results = []
    for variant in args.variant or ["ckpt"]:
        r = probe(args.model, args.tokens, variant, args.rope_factor, torch.device(args.device))
        results.append(r)
        print(json.dumps(r), flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
