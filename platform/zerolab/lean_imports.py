"""What transformers imports at its own import for a feature zerolab never uses, left to that
feature's first use. Importing this module does it, once per process: ``zerolab.models`` imports it
before transformers, so every process that loads a model (the driver, each worker) starts without it.

transformers' candidate generator (assisted generation, ``generate(assistant_model=...)``) runs
``from sklearn.metrics import roc_curve`` at its import whenever scikit-learn is installed, and every
model class imports the generator: scikit-learn with SciPy and pandas, 1.2 s of a 2-core machine's
CPU and up to 4.7 s when it is busy, for a function that only assisted generation's confidence
threshold calls. While that one module imports, ``sys.modules["sklearn.metrics"]`` is a stand-in
whose functions import scikit-learn's own at their first call; then the entry goes again. So
scikit-learn stays untouched: nothing of it is imported, and a later ``import sklearn.metrics``
(user code in the same process, or the generator's first ``roc_curve`` call) imports the real
package as usual. Where scikit-learn is not installed, or transformers has imported the generator
already, nothing is done.

Python's import statement takes a module it finds in ``sys.modules`` as loaded
(https://docs.python.org/3/reference/import.html#the-module-cache); the stand-in is there for the
generator's import alone, and no other module of the process imports ``sklearn.metrics`` then.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from collections.abc import Callable
from typing import Any

DEFERRED = (
    ("sklearn.metrics", "transformers.generation.candidate_generator"),
    ("scipy.optimize", "transformers.loss.loss_utils"),
)
"""(module left to first use, the transformers module whose import would load it)."""


def _called_later(module: str, name: str) -> Callable[..., Any]:
    """``module.name`` as a function that imports ``module`` at its first call."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module(module), name)(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    call.__module__ = module
    call.__doc__ = f"{module}.{name}, imported at the first call."
    return call


class _FunctionsLater(types.ModuleType):
    """A stand-in for ``module`` whose every public name is :func:`_called_later`."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # __path__, __spec__, ...: what the import system asks of a real module
            raise AttributeError(name)
        return _called_later(self.__name__, name)


def _import_without(deferred: str, importer: str) -> None:
    if importer in sys.modules or deferred in sys.modules or importlib.util.find_spec(deferred.partition(".")[0]) is None:
        return
    stand_in = _FunctionsLater(deferred)
    sys.modules[deferred] = stand_in
    try:
        importlib.import_module(importer)
    finally:
        if sys.modules.get(deferred) is stand_in:
            del sys.modules[deferred]


for _deferred, _importer in DEFERRED:
    _import_without(_deferred, _importer)
