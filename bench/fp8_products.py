"""The GPU time of each frozen product of the 7B shape's decoder layer, bf16 against FP8, forward
(``x·Wᵀ``) and input gradient (``g·W``), at two packed 4k rows: the product alone with rowwise input
scales (what ``model.fp8`` runs), the product alone with one scale per tensor (cuBLASLt's FP8 path),
and the rowwise inputs' quantization (``zerolab.kernels.quantize_rows``) on its own.

    python bench/fp8_products.py   # on an H100-class GPU; docs/benchmark.md records its output
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from zerolab.kernels import E4M3_MAX, Fp8Weight, quantize_rows

ROWS = 8192
"""Tokens of a micro-batch of two packed 4k rows."""
LAYERS = {"q/o_proj": (3584, 3584), "gate/up_proj": (3584, 18944), "down_proj": (18944, 3584), "k/v_proj": (3584, 512)}
"""The 7B shape's frozen projections: (in, out)."""


def gpu_ms(fn: Callable[[], object], n: int = 50) -> float:
    """Milliseconds of GPU time per call, over ``n`` calls queued back to back."""
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def tensorwise(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` in e4m3 with one scale for the whole tensor (the input side of cuBLASLt's FP8 path)."""
    scale = t.abs().amax().float().clamp(min=1e-12) / E4M3_MAX
    return (t.float() / scale).to(torch.float8_e4m3fn), scale


def row(name: str, label: str, x: torch.Tensor, dense: Callable[[torch.Tensor], torch.Tensor],
        fp8_t: torch.Tensor, scale_b: torch.Tensor, weight_scale: torch.Tensor) -> str:
    """One table row: ``x`` times the weight in bf16 (``dense``), and in FP8 against ``fp8_t`` (the
    e4m3 weight laid out as the second operand)."""
    xq, x_scale = quantize_rows(x)
    xt, t_scale = tensorwise(x)
    t_bf16 = gpu_ms(lambda: dense(x))
    t_rows = gpu_ms(lambda: torch._scaled_mm(xq, fp8_t, scale_a=x_scale, scale_b=scale_b, out_dtype=x.dtype,
                                             use_fast_accum=True))
    t_tensor = gpu_ms(lambda: torch._scaled_mm(xt, fp8_t, scale_a=t_scale, scale_b=weight_scale, out_dtype=x.dtype,
                                               use_fast_accum=True))
    t_quant = gpu_ms(lambda: quantize_rows(x))
    return (f"| {name} | {label} | {t_bf16:.3f} | {t_rows:.3f} | {t_tensor:.3f} | {t_quant:.3f} | "
            f"{t_bf16 / (t_rows + t_quant):.2f}× |")


def main() -> None:
    torch.manual_seed(0)
    bf16 = {"device": "cuda", "dtype": torch.bfloat16}
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {ROWS} rows")
    print("| layer | pass | bf16 ms | FP8 rowwise ms | FP8 per-tensor ms | quantize rows ms | bf16 / (rowwise + quantize) |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, (inp, out) in LAYERS.items():
        w = torch.randn(out, inp, **bf16) / inp ** 0.5
        fp8 = Fp8Weight(w)
        print(row(name, "forward", torch.randn(ROWS, inp, **bf16), lambda x, w=w: x @ w.t(), fp8.data.t(),
                  fp8._scale_out, fp8.scale))
        print(row(name, "input grad", torch.randn(ROWS, out, **bf16), lambda g, w=w: g @ w, fp8.data_t.t(),
                  fp8._scale_in, fp8.scale))


if __name__ == "__main__":
    main()
