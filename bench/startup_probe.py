"""Where a job's start-up goes, piece by piece, on this machine (no training).

    python bench/startup_probe.py imports     # each heavy import in a fresh process, cumulative
    python bench/startup_probe.py ray         # Ray's start as zerolab makes it, an actor (twice: the
                                              # first sets up zerolab's runtime_env), and an empty Ray Train run
    python bench/startup_probe.py overlap     # Ray's start and the job's imports (cluster.job_imports), one after
                                              # the other, then in one process side by side as a job makes them
    python bench/startup_probe.py overlap --switch 0.005   # ... with another thread switch interval

Prints one ``probe <what> <seconds>`` line per measurement.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))

IMPORTS = ("torch", "transformers", "peft", "deepspeed", "ray.train.torch", "zerolab.train", "mlflow")


def _say(what: str, seconds: float) -> None:
    print(f"probe {what} {seconds:.2f}", flush=True)


def imports() -> None:
    code = ("import time, importlib, sys; t = time.perf_counter()\n"
            f"for m in {IMPORTS!r}:\n"
            "    s = time.perf_counter(); importlib.import_module(m); print(f'probe import {m} {time.perf_counter() - s:.2f}', flush=True)\n"
            "import torch; s = time.perf_counter(); torch.zeros(1, device='cuda' if torch.cuda.is_available() else 'cpu')\n"
            "print(f'probe cuda-init {time.perf_counter() - s:.2f}'); print(f'probe import-all {time.perf_counter() - t:.2f}')")
    subprocess.run([sys.executable, "-c", code], check=True)


def ray_pieces() -> None:
    import ray

    from zerolab.cluster import connect_ray
    from zerolab.config import load_config

    cfg = load_config(None, ["scaling.use_gpu=true"] if _has_gpu() else [])
    t = time.perf_counter()
    connect_ray(cfg)
    _say("ray-init", time.perf_counter() - t)

    @ray.remote(num_cpus=1)
    class Probe:
        def ping(self) -> float:
            return time.time()

        def import_torch(self) -> float:
            s = time.perf_counter()
            import torch  # noqa: F401

            return time.perf_counter() - s

    for label in ("actor", "actor-again"):
        t = time.perf_counter()
        actor = Probe.remote()
        ray.get(actor.ping.remote())
        _say(label, time.perf_counter() - t)
        _say(f"{label}-import-torch", ray.get(actor.import_torch.remote()))
        ray.kill(actor)

    import tempfile

    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer

    mark = Path(tempfile.mkdtemp()) / "started"

    def empty(config: dict) -> None:
        Path(config["mark"]).write_text(str(time.time()))

    t = time.time()
    TorchTrainer(empty, train_loop_config={"mark": str(mark)}, scaling_config=ScalingConfig(num_workers=1, use_gpu=_has_gpu())).fit()
    _say("train-empty-fit", time.time() - t)
    _say("train-empty-fn-started", float(mark.read_text()) - t)


def overlap() -> None:
    """Each in a fresh process: Ray's start then the job's imports; both side by side."""
    for mode in ("serial", "side-by-side"):
        subprocess.run([sys.executable, __file__, "_overlap", mode, *sys.argv[2:]], check=True)


def _overlap() -> None:
    import importlib

    from zerolab import cluster
    from zerolab.config import load_config
    from zerolab.memory import Limits

    mode = sys.argv[2]
    if "--switch" in sys.argv:
        cluster.GIL_SWITCH_S = float(sys.argv[sys.argv.index("--switch") + 1])
    gpu = bool(Limits.detect_with_nvml().gpus_per_node)
    cfg = load_config(None, ["scaling.num_workers=1", *(["scaling.use_gpu=true"] if gpu else [])])
    modules = cluster.job_imports(cfg)
    import ray  # the job's process has it imported before Ray starts (zerolab.cli)

    t = time.perf_counter()
    if mode == "serial":
        cluster.connect_ray(cfg)
        _say("serial-ray", time.perf_counter() - t)
        for name in modules:
            importlib.import_module(name)
    else:
        with cluster._imported_meanwhile(modules):
            cluster._connect(cfg, "local", True)
            _say(f"side-by-side-ray (switch {cluster.GIL_SWITCH_S:g} s)", time.perf_counter() - t)
    _say(f"{mode}-ray-and-imports", time.perf_counter() - t)
    ray.shutdown()


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    {"imports": imports, "ray": ray_pieces, "overlap": overlap, "_overlap": _overlap}[sys.argv[1]]()
