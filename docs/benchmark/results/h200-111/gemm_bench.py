"""The 7B step's frozen products at two packed 4k rows: plain (beta 0) against accumulating (beta 1),
cuBLAS against cuBLASLt, forward and input gradient."""
import torch

M, H, I = 8192, 3584, 18944
shapes = {"qkv": (H, 4608), "o": (H, H), "gate_up": (H, 2 * I), "down": (I, H)}
dev, dt = "cuda", torch.bfloat16


def t(fn, n=30):
    for _ in range(5):
        fn()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    s.record()
    for _ in range(n):
        fn()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / n


for lib in ("cublas", "cublaslt"):
    torch.backends.cuda.preferred_blas_library(lib)
    tot = {"plain": 0.0, "acc": 0.0}
    for name, (k, n) in shapes.items():
        x = torch.randn(M, k, device=dev, dtype=dt); w = torch.randn(n, k, device=dev, dtype=dt) * 0.02
        g = torch.randn(M, n, device=dev, dtype=dt); out = torch.randn(M, n, device=dev, dtype=dt); gx = torch.randn(M, k, device=dev, dtype=dt)
        fl = 2 * M * k * n
        r = {"fwd plain": t(lambda: x @ w.t()), "fwd acc": t(lambda: out.addmm_(x, w.t())),
             "bwd plain": t(lambda: g @ w), "bwd acc": t(lambda: gx.addmm_(g, w))}
        tot["plain"] += r["fwd plain"] + r["bwd plain"]; tot["acc"] += r["fwd acc"] + r["bwd acc"]
        print(lib, name, " ".join(f"{kk} {v:.3f}ms {fl / v / 1e9:.0f}TF" for kk, v in r.items()), flush=True)
    print(lib, "per layer ms", {k: round(v, 3) for k, v in tot.items()}, "x28:", {k: round(28 * v, 1) for k, v in tot.items()}, flush=True)
