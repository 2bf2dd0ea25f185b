"""The 7B step's frozen products at two packed 4k rows, cuBLAS: gate/up as one 37,888-wide product against
two 18,944-wide products into the column halves of one output; Q/K/V stacked against apart; medians of 5 rounds."""
import statistics

import torch

M, H, I, KV = 8192, 3584, 18944, 512
dev, dt = "cuda", torch.bfloat16
r = lambda *s: torch.randn(*s, device=dev, dtype=dt)


def t(fn, n=20):
    for _ in range(3):
        fn()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    s.record()
    for _ in range(n):
        fn()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / n


x = r(M, H); wgu = r(2 * I, H) * 0.02; wg, wu = wgu[:I], wgu[I:]; y = r(M, 2 * I); dy = r(M, 2 * I); dx = r(M, H)
wqkv = r(H + 2 * KV, H) * 0.02; yq = r(M, H + 2 * KV); dyq = r(M, H + 2 * KV)
yg, yu = r(M, I), r(M, I); yq1, yk, yv = r(M, H), r(M, KV), r(M, KV); dyq1, dyk, dyv = r(M, H), r(M, KV), r(M, KV)
wd = r(H, I) * 0.02; h = r(M, I); yd = r(M, H); dyd = r(M, H); dh = r(M, I)
cases = {
    "gu fwd stacked acc": lambda: y.addmm_(x, wgu.t()),
    "gu fwd stacked plain": lambda: torch.mm(x, wgu.t(), out=y),
    "gu fwd split acc (strided out)": lambda: (y[:, :I].addmm_(x, wg.t()), y[:, I:].addmm_(x, wu.t())),
    "gu fwd split plain (separate outs)": lambda: (x @ wg.t(), x @ wu.t()),
    "gu fwd split acc (separate outs, as shipped)": lambda: (yg.addmm_(x, wg.t()), yu.addmm_(x, wu.t())),
    "gu bwd stacked acc": lambda: dx.addmm_(dy, wgu),
    "gu bwd split acc (strided in)": lambda: (dx.addmm_(dy[:, :I], wg), dx.addmm_(dy[:, I:], wu)),
    "gu bwd split plain+acc": lambda: torch.mm(dy[:, :I], wg, out=dx).addmm_(dy[:, I:], wu),
    "qkv fwd stacked acc": lambda: yq.addmm_(x, wqkv.t()),
    "qkv fwd split plain": lambda: (x @ wqkv[:H].t(), x @ wqkv[H:H + KV].t(), x @ wqkv[H + KV:].t()),
    "qkv fwd split acc (as shipped)": lambda: (yq1.addmm_(x, wqkv[:H].t()), yk.addmm_(x, wqkv[H:H + KV].t()), yv.addmm_(x, wqkv[H + KV:].t())),
    "qkv bwd split acc (as shipped)": lambda: (dx.addmm_(dyq1, wqkv[:H]), dx.addmm_(dyk, wqkv[H:H + KV]), dx.addmm_(dyv, wqkv[H + KV:])),
    "qkv bwd stacked acc": lambda: dx.addmm_(dyq, wqkv),
    "down fwd acc": lambda: yd.addmm_(h, wd.t()),
    "down fwd plain": lambda: torch.mm(h, wd.t(), out=yd),
    "down bwd acc": lambda: dh.addmm_(dyd, wd),
    "down bwd plain": lambda: torch.mm(dyd, wd, out=dh),
}
res = {k: [] for k in cases}
for _ in range(5):
    for k, f in cases.items():
        res[k].append(t(f))
for k, v in res.items():
    print(f"{k:40s} {statistics.median(v):.3f} ms  (min {min(v):.3f}, max {max(v):.3f})", flush=True)
