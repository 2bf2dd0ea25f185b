"""The host's time per call of each product (and an elementwise call) of the 7B LoRA node, with
cuBLAS or cuBLASLt preferred: 400 calls in a row of products small enough that the GPU finishes them
faster than the host issues them, so the time per call is the host's own (``host``; ``host+drain``
adds the wait for the GPU at the end: equal when the host is the bound).

    python bench/host_cost.py   # on a GPU machine; docs/benchmark.md records its output
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

T, IN, OUT, R = 4096, 3584, 512, 16
"""Tokens of one packed 4k row, the 7B shape's hidden size, its K/V projections' width, the LoRA rank."""


def cases() -> dict[str, Callable[[], object]]:
    bf16 = {"device": "cuda", "dtype": torch.bfloat16}
    x, w, b = torch.randn(T, IN, **bf16), torch.randn(OUT, IN, **bf16), torch.randn(OUT, **bf16)
    a, lora_b = torch.randn(R, IN, **bf16), torch.randn(OUT, R, **bf16)
    g, h, out = torch.randn(T, OUT, **bf16), torch.randn(T, R, **bf16), torch.randn(T, OUT, **bf16)
    return {
        "x@A^T (T×16)": lambda: x @ a.t(),
        "x@W^T (base, k_proj)": lambda: x @ w.t(),
        "addmm(bias,x,W^T)": lambda: torch.addmm(b, x, w.t()),
        "out.addmm_(h,B^T)": lambda: out.addmm_(h, lora_b.t(), alpha=2.0),
        "g@B (T×16)": lambda: g @ lora_b,
        "addmm(empty,g,B,beta=0)": lambda: torch.addmm(g.new_empty(()), g, lora_b, beta=0, alpha=2.0),
        "g^T@h (out×16)": lambda: g.t() @ h,
        "mul_ (T×16)": lambda: h.mul_(1.0),
    }


def host_us(fn: Callable[[], object], n: int = 400) -> tuple[float, float]:
    """Microseconds per call: the host's issuing alone, and with the GPU's queue drained at the end."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - start) / n * 1e6
    torch.cuda.synchronize()
    return host, (time.perf_counter() - start) / n * 1e6


def main() -> None:
    products = cases()
    for library in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(library)
        for name, fn in products.items():
            host, drained = host_us(fn)
            print(f"{library:9s} {name:28s} host {host:7.1f} us/call   host+drain {drained:7.1f} us/call")


if __name__ == "__main__":
    main()
