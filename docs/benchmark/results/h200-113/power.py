"""Do the frozen products run faster when memory-bound work sits between them (as in TRL's step) than
back to back (as in zerolab's)? Each phase ~4 s; every product timed by its own pair of events."""
import statistics
import subprocess
import time

import torch

M, H, I = 8192, 3584, 18944
r = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16)
x, w, y = r(M, H), r(I, H) * 0.02, r(M, I)
big = r(M, I)  # 310 MB: one add_ reads and writes it (~0.15 ms at H200's bandwidth)
smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu", "--format=csv,noheader", "-lms", "200"],
                       stdout=open("/tmp/smi.csv", "w"))


def phase(gap_ops: int, seconds: float = 4.0) -> float:
    times, t0 = [], time.time()
    while time.time() - t0 < seconds:
        evs = []
        for _ in range(50):
            s, e = torch.cuda.Event(True), torch.cuda.Event(True)
            s.record(); torch.mm(x, w.t(), out=y); e.record(); evs.append((s, e))
            for _ in range(gap_ops):
                big.add_(1.0)
        torch.cuda.synchronize()
        times += [s.elapsed_time(e) for s, e in evs]
    return statistics.median(times[50:])


for rep in (1, 2):
    for gaps in (0, 1, 3):
        t = phase(gaps)
        print(f"rep{rep} gap_ops={gaps}: product {t:.3f} ms ({2 * M * H * I / t / 1e9:.0f} TFLOP/s)  at {time.strftime('%H:%M:%S')}", flush=True)
smi.terminate()
