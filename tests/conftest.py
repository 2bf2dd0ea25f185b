"""Shared fixtures: tiny configs, one local Ray cluster per session, a temp MLflow store."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ["HF_HUB_OFFLINE"] = "1"  # tests never download; an attempt fails at once instead of timing out


def pytest_sessionstart(session: pytest.Session) -> None:
    """The machine and versions, as test-suite properties of a --junitxml report (bench/gpu_report.py
    puts them in the recorded page; without --junitxml this does nothing). Added by the process that
    writes the report: under pytest-xdist (``-n``, as the GPU tier runs) that is the controller, and
    its workers' ``record_testsuite_property`` records nothing."""
    from _pytest.junitxml import xml_key

    xml = session.config.stash.get(xml_key, None)
    if xml is None:
        return
    for name, value in _environment().items():
        xml.add_global_property(name, value)


def _environment() -> dict[str, object]:
    import importlib.metadata

    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    found = {"device": torch.cuda.get_device_name(0) if gpus else "cpu", "gpus": gpus, "cuda": torch.version.cuda or "none"}
    for package in ("torch", "deepspeed", "ray", "transformers", "peft", "mlflow", "liger_kernel"):
        found[package] = "not installed"
        # mlflow-skinny, MLflow without its server (the GPU hosts), is imported as mlflow too.
        for distribution in (package.replace("_", "-"), *(("mlflow-skinny",) if package == "mlflow" else ())):
            try:
                found[package] = importlib.metadata.version(distribution)
                break
            except importlib.metadata.PackageNotFoundError:
                pass
    found["commit"] = os.environ.get("ZEROLAB_COMMIT") or _checkout_commit()
    return found


_BACKGROUND: list = []


def pytest_collection_finish(session: pytest.Session) -> None:
    """DeepSpeed compiles its CPU Adam op, the optimizer of every offload run, at its first use: about a
    minute on two cores of a fresh machine, while the first offload test waits. When offload tests
    are collected, a process builds it on one core from the session's start, beside the tests that
    need no compiler; an offload test that comes first waits for the build (torch's extension lock)."""
    import subprocess
    import sys

    if any("offload" in item.nodeid for item in session.items):
        _BACKGROUND.append(subprocess.Popen(
            [sys.executable, "-c", "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()"],
            env={**os.environ, "MAX_JOBS": "1"}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The suite runs on two pytest-xdist workers (``-n 2 --dist loadgroup`` in ``pyproject.toml``),
    test by test; a module's tests that share a module-scoped fixture (a trained adapter, an interrupted
    sweep) go to one worker, which builds it once. GPU cases stay apart: each worker has its own Ray.
    A slow-tier test (several whole jobs) may take 15 minutes beside another worker before it counts as hung."""
    for item in items:
        if item.get_closest_marker("slow") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(900))
        info = getattr(item, "_fixtureinfo", None)
        if info is None or item.get_closest_marker("gpu"):
            continue
        if any(defs[-1].scope == "module" for defs in info.name2fixturedefs.values()):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))


def pytest_sessionfinish(session: pytest.Session) -> None:
    for proc in _BACKGROUND:  # never killed: a build stopped halfway leaves its lock behind
        proc.wait()


def _checkout_commit() -> str:
    """The commit of this checkout (``-dirty`` with changed tracked files), or ``unknown``: also for a
    copy without ``.git`` (``git archive``) inside another repository, whose commit it is not (set
    ``ZEROLAB_COMMIT`` for such a copy)."""
    import subprocess

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()

    try:
        if Path(git("rev-parse", "--show-toplevel") or "/nonexistent").resolve() != REPO.resolve():
            return "unknown"
        commit, dirty = git("rev-parse", "--short", "HEAD"), git("status", "--porcelain", "--untracked-files=no")
    except OSError:  # no git on this machine
        return "unknown"
    return f"{commit}{'-dirty' if dirty else ''}" if commit else "unknown"


def tiny_overrides(tmp_path: Path, **extra: object) -> list[str]:
    """Overrides for a short CPU run: small generated data, few steps, temp storage and MLflow."""
    values: dict[str, object] = {
        "data.num_train_rows": 192,
        "data.num_eval_rows": 32,
        "train.micro_batch_size": 8,
        "train.max_steps": 10,
        "train.log_every_n_steps": 2,
        "run.name": f"t-{uuid.uuid4().hex[:8]}",
        "run.storage_path": str(tmp_path / "runs"),
        "tracking.uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "tracking.experiment": "tests",
        "tracking.system_metrics_interval_s": 0,
    }
    values.update(extra)
    return [f"{k}={v}" for k, v in values.items()]


_handed_out: set[int] = set()


def free_port() -> int:
    """A loopback port free now, between Ray's worker ports (10002-19999) and the kernel's ephemeral
    range, and not handed out before in this process. What binds it does so seconds later (a spawned
    rank after its imports, a server once started), and meanwhile a port of the ephemeral range (what
    binding port 0 gives) can go to any process's outgoing connection, Ray's of the session's other
    tests among them: a two-rank test failed there with EADDRINUSE."""
    ephemeral = Path("/proc/sys/net/ipv4/ip_local_port_range")
    low = int(ephemeral.read_text().split()[0]) if ephemeral.exists() else 32768
    for port in random.SystemRandom().sample(range(20000, low), low - 20000):
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free loopback port in 20000-{low - 1}")


def on_ranks(nprocs: int, target, *args: object) -> dict:
    """Run ``target(rank, *args, port, results)`` on ``nprocs`` spawned ranks (a world on a free port);
    returns what they put in ``results``. The results' manager process is spawned too, never forked: a
    fork of a process connected to Ray (a pytest worker whose earlier test started it) leaves that
    process deaf to its GCS subscription, so the next Ray Train job of the worker never hears that its
    controller started and waits for ever."""
    import torch.multiprocessing as mp

    with mp.get_context("spawn").Manager() as manager:
        results = manager.dict()
        mp.spawn(target, args=(*args, free_port(), results), nprocs=nprocs)
        return dict(results)


def on_two_ranks(target, *args: object) -> dict:
    """:func:`on_ranks` with a world of two."""
    return on_ranks(2, target, *args)


def rows_of(lengths, seed=0):
    """Tokenized rows (ids, labels) of the given lengths, the first half of each masked as prompt."""
    import numpy as np

    from zerolab.batches import IGNORE_INDEX

    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        ids = rng.integers(5, 1000, size=n)
        labels = ids.copy()
        labels[: n // 2] = IGNORE_INDEX
        out.append((ids, labels))
    return out


@contextlib.contextmanager
def step_gradients(engine):
    """Inside the block ``engine.step`` first copies every trainable parameter's whole gradient
    (gathered under ZeRO-3) at an accumulation boundary into the dict it yields, by name, before
    DeepSpeed clears them."""
    from deepspeed.utils import safe_get_full_grad

    trainable = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    grads: dict = {}
    step = engine.step

    def step_keeping_grads():
        if engine.is_gradient_accumulation_boundary():
            grads.update({n: safe_get_full_grad(p).detach().float().clone() for n, p in trainable})
        step()

    engine.step = step_keeping_grads
    try:
        yield grads
    finally:
        engine.step = step


def kill_a_training_worker() -> int:
    """SIGKILL one live Ray Train worker of the connected Ray instance, as the kernel's OOM killer
    would; returns its pid. The workers come from the GCS actor table, which answers without the
    dashboard that Ray's state API (``ray.util.state``) needs and the GPU hosts' trimmed Ray lacks."""
    from ray._private.state import actors

    pids = [a["Pid"] for a in actors(actor_state_name="ALIVE").values() if a["ActorClassName"] == "RayTrainWorker"]
    assert pids, "no training workers to kill"
    os.kill(pids[-1], signal.SIGKILL)
    return pids[-1]


def trained_state(checkpoint: Path, stage: int) -> dict:
    """The engine's final weights, read back independently from the DeepSpeed checkpoint in a run's
    checkpoint folder: under ZeRO 0-2 rank 0's module state (the weights the forward ran with, in
    the training dtype); under ZeRO-3 the fp32 master partitions of every rank, consolidated."""
    import torch

    folder = checkpoint / "deepspeed"
    if stage < 3:  # every rank holds whole parameters; rank 0 saved the module
        return torch.load(folder / "state" / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(folder), tag="state")


def peft_reload(base, adapter_path):
    """The adapter in ``adapter_path`` on ``base`` by peft's own ``PeftModel.from_pretrained``, the
    documented way to load a result, without peft's AdaLoRA rank-pattern warning, which is wrong
    (``zerolab.generation._ADALORA_RANK_PATTERN_WARNING``)."""
    import warnings

    from peft import PeftModel

    from zerolab.generation import _ADALORA_RANK_PATTERN_WARNING

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_ADALORA_RANK_PATTERN_WARNING, category=RuntimeWarning)
        return PeftModel.from_pretrained(base, adapter_path)


@pytest.fixture(scope="session")
def _ray_session():
    """Ray is shut down once, after the last test; starting it costs seconds each time."""
    import ray

    yield
    ray.shutdown()


def ensure_ray():
    """The local Ray instance the tests share: started by the first test that needs it, and again
    after a test whose job shut it down (as a job's command line does)."""
    import ray

    from zerolab.cluster import connect_ray
    from zerolab.config import load_config

    if not ray.is_initialized():
        connect_ray(load_config(None, []))
    return ray


@pytest.fixture
def ray_cluster(_ray_session):
    return ensure_ray()


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    from zerolab.models import build_tiny_model

    return str(build_tiny_model())


GPU_SHAPE = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
"""The GPU tier's model: head_dim 64 and grouped-query attention as in Qwen2.5, an untied head (the
built-in tiny model ties it), small enough that a ZeRO-3 offload run takes seconds."""


@pytest.fixture(scope="session")
def gpu_model_path(tmp_path_factory) -> str:
    """A random-init Qwen2 of ``GPU_SHAPE`` in bf16 (:func:`save_random_qwen2`)."""
    return save_random_qwen2(tmp_path_factory.mktemp("gpu-qwen2"), GPU_SHAPE)


def save_random_qwen2(folder: Path, shape: dict) -> str:
    """A random-init Qwen2 of ``shape`` in bf16 with an untied head and the built-in model's tokenizer
    (trained in seconds; the built-in model's pre-training is not needed), saved to ``folder``."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from zerolab.models import _train_tiny_tokenizer

    tokenizer = _train_tiny_tokenizer()
    tokenizer.save_pretrained(folder)
    config = Qwen2Config(vocab_size=len(tokenizer), max_position_embeddings=2048, tie_word_embeddings=False, bos_token_id=None,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **shape)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """A real `mlflow server` on a free loopback port with its own SQLite store and proxied
    artifacts (as a team server runs); yields its http:// URI."""
    import subprocess
    import sys
    import time
    import urllib.request

    root = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    log = (root / "server.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--artifacts-destination", str(root / "artifacts")],
        stdout=log, stderr=subprocess.STDOUT, cwd=root,
    )
    uri = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise RuntimeError(f"mlflow server did not start: {(root / 'server.log').read_text()[-2000:]}")
        time.sleep(0.5)
    yield uri
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="module")
def gpu_ray():
    """A local Ray instance whose workers see the GPUs and use DeepSpeed's CUDA accelerator: workers
    inherit the environment Ray starts with, and the suite's conftest sets DS_ACCELERATOR=cpu. A
    CPU instance of the session is stopped first (the next test that needs one starts it again)."""
    import ray

    from zerolab.cluster import connect_ray
    from zerolab.config import load_config

    ray.shutdown()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DS_ACCELERATOR", "cuda")
        mp.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # mlflow-skinny's file store (case_config), MLflow 3 refuses it otherwise
        connect_ray(load_config(None, ["scaling.use_gpu=true"]))
        yield ray
        ray.shutdown()
