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
