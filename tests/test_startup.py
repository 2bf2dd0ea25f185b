"""What a job's process does before its first step: the libraries it imports (each check in a fresh
interpreter, as a job starts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

TRAINING_STACK = "import zerolab.models, zerolab.train, ray.train.torch, peft, deepspeed"
"""What a job that trains in its own process imports before it trains (``cluster.job_imports``)."""


def _python(code: str) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'platform'}{os.pathsep}{REPO}", "DS_ACCELERATOR": "cpu"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_training_stack_loads_without_scikit_learn_or_scipys_optimizers():
    pytest.importorskip("sklearn")
    loaded = _python(f"{TRAINING_STACK}\nimport json, sys\n"
                     "print(json.dumps(sorted(m for m in sys.modules if m.startswith(('sklearn', 'scipy.optimize')))))")
    assert loaded == []


def test_what_transformers_left_for_later_is_the_real_function_at_its_first_call():
    """Assisted generation's roc_curve and the detection losses' linear_sum_assignment still work, and
    code that imports scikit-learn itself, after zerolab or before it, gets scikit-learn's own module."""
    pytest.importorskip("sklearn")
    after = _python("import json, sys\nimport zerolab.models\n"
                    "from transformers.generation import candidate_generator as cg\n"
                    "from transformers.loss import loss_for_object_detection as od\n"
                    "loaded_before = 'sklearn' in sys.modules\n"
                    "curve = [a.tolist() for a in cg.roc_curve([0, 1, 1, 0], [0.1, 0.9, 0.8, 0.3])]\n"
                    "rows, cols = od.linear_sum_assignment([[4, 1], [2, 8]])\n"
                    "import sklearn.metrics\n"
                    "print(json.dumps({'loaded_before': loaded_before, 'curve': curve, 'assignment': cols.tolist(),\n"
                    "                  'own': [a.tolist() for a in sklearn.metrics.roc_curve([0, 1, 1, 0], [0.1, 0.9, 0.8, 0.3])],\n"
                    "                  'real': sklearn.metrics.__file__ is not None and hasattr(sklearn.metrics, 'f1_score')}))")
    assert not after["loaded_before"]
    assert after["curve"] == after["own"] and after["real"]
    assert after["assignment"] == [1, 0]
    before = _python("import json\nimport sklearn.metrics\nimport zerolab.models\n"
                     "from transformers.generation import candidate_generator as cg\n"
                     "print(json.dumps(cg.roc_curve is sklearn.metrics.roc_curve))")
    assert before is True


def test_a_lora_worker_on_an_unquantized_base_never_loads_bitsandbytes():
    """peft imports bitsandbytes at its import and asks it about every targeted module; a worker that
    trains LoRA, DoRA and AdaLoRA on a bf16 base never loads it, nor does an evaluation that applies
    a saved adapter and merges it; peft still takes it as installed afterwards, and the first use of
    it (as a quantized base's loading makes) loads the real module."""
    pytest.importorskip("bitsandbytes")
    loaded = _python(f"{TRAINING_STACK}\nimport json, sys, tempfile, torch\nfrom zerolab.adapters import apply_adapter\n"
                     "from zerolab.config import AdapterSpec\nfrom zerolab.lora_nodes import fuse_lora\n"
                     "from transformers import Qwen2Config, Qwen2ForCausalLM\nstates = []\n"
                     "for method in ('lora', 'dora', 'adalora'):\n"
                     "    base = Qwen2ForCausalLM(Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,\n"
                     "                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=128))\n"
                     "    model = apply_adapter(base, AdapterSpec(method=method), 10)\n"
                     "    fuse_lora(model)\n"
                     "    ids = torch.randint(0, 128, (1, 8))\n"
                     "    model(ids, labels=ids).loss.backward()\n"
                     "    states.append(type(sys.modules['bitsandbytes']).__name__)\n"
                     "    if method == 'lora':\n"
                     "        model.save_pretrained(folder := tempfile.mkdtemp())\n"
                     "from zerolab import generation\n"
                     "generation.apply_adapter(Qwen2ForCausalLM(base.config), folder, merge=True)\n"
                     "states.append(type(sys.modules['bitsandbytes']).__name__)\n"
                     "from peft.import_utils import is_bnb_4bit_available\nimport bitsandbytes\n"
                     "print(json.dumps({'during': states, 'available': is_bnb_4bit_available(),\n"
                     "                  'layer': bitsandbytes.nn.Linear4bit.__module__, 'real': type(sys.modules['bitsandbytes']).__name__}))")
    assert loaded == {"during": ["_ModuleLater"] * 4, "available": True, "layer": "bitsandbytes.nn.modules", "real": "module"}


def test_a_workers_deepspeed_leaves_mlflow_to_the_metric_logger():
    """A training worker's first import of DeepSpeed does not import MLflow (rank 0 imports it for its
    metric logger after the first step); DeepSpeed's autotuner still gets MLflow's own module."""
    loaded = _python("import json, sys\nimport zerolab.train\nfrom zerolab.lean_imports import import_deepspeed\n"
                     "import_deepspeed()\nbefore = 'mlflow' in sys.modules\n"
                     "from deepspeed.autotuning import autotuner\nimport mlflow\n"
                     "print(json.dumps({'before': before, 'has': autotuner.has_mlflow,\n"
                     "                  'same': autotuner.mlflow.MlflowClient is mlflow.MlflowClient,\n"
                     "                  'real': type(sys.modules['mlflow']).__name__}))")
    assert loaded == {"before": False, "has": True, "same": True, "real": "module"}


def test_deepspeeds_muon_module_loads_without_torchinductor_and_compiles_at_its_first_call():
    """DeepSpeed imports its Muon optimizer module while it builds any ZeRO optimizer; that module's
    ``torch.compile`` decorations loaded TorchInductor at import. After a worker's first import of
    DeepSpeed the module is loaded without it, and a decorated function still computes what the
    undecorated one does, compiled when first called (here under the eager stance, which runs what
    ``torch.compile`` wrapped without generating code)."""
    loaded = _python("import json, sys\nfrom zerolab.lean_imports import import_deepspeed\nimport_deepspeed()\n"
                     "from deepspeed.runtime.zero.muon import original_muon as m\n"
                     "before = 'torch._inductor.compile_fx' in sys.modules\n"
                     "import torch\ng = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))\n"
                     "eager = m.zeropower_via_newtonschulz5.__wrapped__(g, 5)\n"
                     "with torch.compiler.set_stance('force_eager'):\n"
                     "    called = m.zeropower_via_newtonschulz5(g, 5)\n"
                     "print(json.dumps({'before': before, 'same': bool(torch.equal(eager, called)),\n"
                     "                  'after': 'torch._inductor.compile_fx' in sys.modules}))")
    assert loaded == {"before": False, "same": True, "after": True}


def test_a_run_started_off_the_main_thread_starts_no_stop_flag_actor():
    """Signals reach only the main thread: a Tune trial's worker group gets no flag (an actor would be
    a process of its own, started for each trial), and nothing here needs Ray."""
    import threading

    from zerolab.stop import StopSignal

    flags = {}
    thread = threading.Thread(target=lambda: flags.update(workers=StopSignal(5, "workers").flag, driver=StopSignal(5, "driver").flag))
    thread.start()
    thread.join()
    assert flags["workers"] is None and isinstance(flags["driver"], threading.Event)


def test_the_first_step_ends_when_its_step_is_done_not_after_the_hosts_work_that_follows():
    import time

    import torch

    from zerolab.train import _FirstStepClock

    clock = _FirstStepClock(torch.device("cpu"))
    assert clock.unix() is None
    clock.mark()
    done = time.time()
    time.sleep(0.2)  # MLflow's set-up after the step
    assert abs(clock.unix() - done) < 0.05


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_first_step_ends_when_the_device_has_done_it():
    """The step's work is queued; the host then works (MLflow's set-up) while the device finishes:
    the clock reads the device's end, without a sync at the mark."""
    import time

    import torch

    from zerolab.train import _FirstStepClock

    device = torch.device("cuda", 0)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10**7)
    end.record()
    end.synchronize()
    cycles = int(0.3 / (start.elapsed_time(end) / 1000 / 10**7))  # ≈ 0.3 s of device time
    clock = _FirstStepClock(device)
    issued = time.time()
    torch.cuda._sleep(cycles)
    clock.mark()
    time.sleep(1.0)
    first = clock.unix()
    assert issued + 0.1 < first < issued + 0.9


def test_the_engine_is_built_without_deepcompiles_backend_unless_the_config_turns_it_on():
    """DeepSpeed's engine registered DeepCompile's graph passes whenever torch could run it (on CUDA,
    which DeepSpeed's check is made to answer here as on a GPU host), which imports DeepCompile's
    backend (AOTAutograd, TorchInductor's lowering). A ZeRO-2 engine of the tiny LoRA model is built
    without it; a config with DeepCompile on keeps DeepSpeed's own check."""
    built = _python("import json, os, sys, torch\n"
                    "import deepspeed.runtime.engine as e\ne.is_deepcompile_supported = own = lambda: True\n"
                    "os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT='29561', RANK='0', WORLD_SIZE='1', LOCAL_RANK='0')\n"
                    "from zerolab.ds_runtime import init_distributed\ninit_distributed('gloo')\n"
                    "from zerolab import ds_config\nfrom zerolab.config import load_config\n"
                    "from zerolab.engine import Zero3Loading, build_model, initialize_engine\n"
                    "cfg = load_config(None, ['scaling.num_workers=1', 'train.precision=bf16'])\n"
                    "ds = ds_config.resolve(cfg, {'hidden_size': 128})\n"
                    "engine = initialize_engine(build_model(cfg, ds, 10, zero3=Zero3Loading()), cfg, ds, 10)\n"
                    "from zerolab.engine import _deepcompile_passes_left_out\n"
                    "with _deepcompile_passes_left_out({'compile': {'deepcompile': True}}):\n    kept = e.is_deepcompile_supported is own\n"
                    "print(json.dumps({'optimizer': type(engine.optimizer).__name__, 'kept': kept, 'restored': e.is_deepcompile_supported is own,\n"
                    "                  'backend': 'deepspeed.compile.backend' in sys.modules}))")
    assert built == {"optimizer": "DeepSpeedZeroOptimizer", "kept": True, "restored": True, "backend": False}

def test_a_job_that_trains_in_its_process_tokenizes_on_all_cores_and_trains_with_the_workers_setting(monkeypatch):
    """The process takes the training processes' environment before it imports the training stack,
    except the fast tokenizer's threading, which the training function turns off once the data is
    tokenized; a value the user exported wins throughout."""
    from zerolab.cluster import adopt_worker_env
    from zerolab.config import load_config
    from zerolab.worker_log import setup_worker_logging

    cfg = load_config(None, ["scaling.num_workers=1"])
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    adopt_worker_env(cfg)
    assert os.environ["DS_ACCELERATOR"] == "cpu" and "TOKENIZERS_PARALLELISM" not in os.environ
    setup_worker_logging(own_handler=False)
    assert os.environ["TOKENIZERS_PARALLELISM"] == "false"
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")
    setup_worker_logging(own_handler=False)
    assert os.environ["TOKENIZERS_PARALLELISM"] == "true"
