"""What the training stack's libraries import at their own import for features zerolab never uses,
left to that feature's first use.

transformers: importing this module does it, once per process (``zerolab.models`` imports it before
transformers, so every process that loads a model starts without them). Its candidate generator
(assisted generation, ``generate(assistant_model=...)``) runs ``from sklearn.metrics import
roc_curve`` at its import whenever scikit-learn is installed, and its object-detection losses ``from
scipy.optimize import linear_sum_assignment``; every model class imports both: scikit-learn with
SciPy and pandas, 1.2 s of a 2-core machine's CPU and up to 4.7 s when it is busy, for functions
only assisted generation's confidence threshold and DETR-style losses call.

DeepSpeed: :func:`import_deepspeed`, a training worker's first ``import deepspeed``
(``zerolab.ds_runtime``), leaves out the MLflow that DeepSpeed's autotuner imports (zerolab never
runs the autotuner): rank 0 then imports MLflow for its metric logger after the first optimizer
step, the other ranks never. It also imports DeepSpeed's Muon optimizer module with its
``torch.compile`` decorations left to the functions' first calls (:func:`_muon_compiled_at_first_call`).

bitsandbytes: peft imports it at its own import (``peft.helpers``), 1.3 s of the 2-core machine's
CPU in every process that loads peft; and its LoRA and AdaLoRA import it again to ask each targeted
module whether it is one of its quantized layers. Importing this module puts a stand-in in its place
that loads it at the first attribute read (quantized bases load it through transformers first); while
peft wraps a model in a process that has not loaded it, :func:`peft_without_bitsandbytes` has peft
take it as not installed (no layer can be one of its layers then).

How: while the one library module that would import it imports, ``sys.modules[name]`` holds a
stand-in whose names load the real module when they are used (a function when it is called); then
the entry goes again (bitsandbytes' stays until its first use: more than one module imports it). Python's import statement takes a module it finds in ``sys.modules`` as loaded
(https://docs.python.org/3/reference/import.html#the-module-cache), so the library binds the
stand-in's names, and the packages themselves stay untouched: nothing of them is imported, and any
later ``import`` of them (user code in the same process, or the feature's first use) loads the real
package as usual. Where a package is not installed, is imported already, or the library module was
imported before, nothing is done.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import sys
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

DEFERRED = (
    ("sklearn.metrics", "transformers.generation.candidate_generator"),
    ("scipy.optimize", "transformers.loss.loss_utils"),
)
"""(module left to first use, the transformers module whose import would load it)."""

_loading = threading.Lock()


def _real(name: str, stand_in: types.ModuleType) -> types.ModuleType:
    """The real module ``name``, imported now if it was not (also while ``stand_in`` still holds its place)."""
    with _loading:
        if sys.modules.get(name) is stand_in:
            del sys.modules[name]
    return importlib.import_module(name)


class _FunctionsLater(types.ModuleType):
    """A stand-in whose every public name is the real module's function, imported at its first call:
    for ``from module import function``, which takes the name at once."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # __path__, __file__, ...: what the import system asks of a real module
            raise AttributeError(name)
        module, stand_in = self.__name__, self

        def call(*args: Any, **kwargs: Any) -> Any:
            return getattr(_real(module, stand_in), name)(*args, **kwargs)

        call.__name__ = call.__qualname__ = name
        call.__module__ = module
        call.__doc__ = f"{module}.{name}, imported at the first call."
        return call


class _ModuleLater(types.ModuleType):
    """A stand-in that is the real module from the first attribute read on: for ``import module``,
    which reads nothing until the module is used."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.__spec__ = importlib.util.find_spec(name)  # find_spec(name) meanwhile answers as for the real module
        self.__file__ = self.__spec__.origin  # what scans of sys.modules read (inspect.getmodule, for each module)

    def __getattr__(self, name: str) -> Any:
        return getattr(_real(self.__name__, self), name)


def _import_without(deferred: str, importer: str, stand_in: Callable[[str], types.ModuleType]) -> None:
    if importer in sys.modules or deferred in sys.modules or importlib.util.find_spec(deferred.partition(".")[0]) is None:
        importlib.import_module(importer)
        return
    placeholder = stand_in(deferred)
    with _loading:
        sys.modules[deferred] = placeholder
    try:
        importlib.import_module(importer)
    finally:
        with _loading:
            if sys.modules.get(deferred) is placeholder:
                del sys.modules[deferred]


def import_deepspeed() -> types.ModuleType:
    """``import deepspeed`` without the MLflow its autotuner imports, where this is the process's
    first import of DeepSpeed and MLflow is not loaded yet; else a plain ``import deepspeed``."""
    _import_without("mlflow", "deepspeed", _ModuleLater)
    _muon_compiled_at_first_call()
    return sys.modules["deepspeed"]


_MUON = "deepspeed.runtime.zero.muon.muon_optimizer"


def _muon_compiled_at_first_call() -> None:
    """Import DeepSpeed's Muon optimizer module with ``deepspeed.runtime.compiler.compile`` deferring
    ``torch.compile`` to each decorated function's first call.

    DeepSpeed imports that module wherever it asks whether the optimizer is Muon: in the ZeRO sanity
    check of ``deepspeed.initialize``, the bf16 and ZeRO-3 optimizers' set-up, ZeRO-2's gradient
    reduction. The module decorates three functions with ``torch.compile`` at its import, which loads
    TorchInductor and AOTAutograd: 3.5 s of ``deepspeed.initialize`` on an H100 host (py-spy,
    docs/benchmark.md), for functions only a Muon optimizer calls. Nothing else changes: a Muon
    optimizer's first step compiles them as before."""
    try:
        if _MUON in sys.modules or importlib.util.find_spec(_MUON) is None:
            return
    except ModuleNotFoundError:  # a DeepSpeed without the Muon package
        return
    from deepspeed.runtime import compiler

    eager = compiler.compile

    def deferred() -> Callable[[Callable], Callable]:
        def decorate(fn: Callable) -> Callable:
            compiled: Callable | None = None

            @functools.wraps(fn)
            def call(*args: Any, **kwargs: Any) -> Any:
                nonlocal compiled
                if compiled is None:
                    compiled = eager()(fn)
                return compiled(*args, **kwargs)

            return call

        return decorate

    compiler.compile = deferred
    try:
        importlib.import_module(_MUON)
    finally:
        compiler.compile = eager


BITSANDBYTES = "bitsandbytes"


def loaded(name: str) -> bool:
    """Whether the real module ``name`` is imported in this process (not a stand-in of this module)."""
    module = sys.modules.get(name)
    return module is not None and not isinstance(module, (_ModuleLater, _FunctionsLater))


def _bitsandbytes_at_first_use() -> None:
    if BITSANDBYTES in sys.modules or importlib.util.find_spec(BITSANDBYTES) is None:
        return
    with _loading:
        sys.modules[BITSANDBYTES] = _ModuleLater(BITSANDBYTES)


@contextlib.contextmanager
def peft_without_bitsandbytes() -> Iterator[None]:
    """peft takes bitsandbytes as not installed while it wraps a model here, where this process has
    not loaded bitsandbytes (so no layer is one of its quantized layers); else nothing changes.

    peft's checks (``peft.import_utils.is_bnb_available``, ``is_bnb_4bit_available``) are cached per
    process: they are cleared on both sides, so later calls see bitsandbytes as installed again."""
    if loaded(BITSANDBYTES):
        yield
        return
    from peft import import_utils

    checks = (import_utils.is_bnb_available, import_utils.is_bnb_4bit_available)
    with _loading:
        held = sys.modules.get(BITSANDBYTES)
        sys.modules[BITSANDBYTES] = None  # type: ignore[assignment]  # find_spec then answers None
    for check in checks:
        check.cache_clear()
    try:
        yield
    finally:
        with _loading:
            if held is None:
                sys.modules.pop(BITSANDBYTES, None)
            else:
                sys.modules[BITSANDBYTES] = held
        for check in checks:
            check.cache_clear()


_bitsandbytes_at_first_use()
for _deferred, _importer in DEFERRED:
    _import_without(_deferred, _importer, _FunctionsLater)
