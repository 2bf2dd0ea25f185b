"""What to evaluate or export: a :class:`Target`, a base model (hub id, folder or
``builtin:tiny-qwen2``) and optionally what fine-tuning produced, given as a local folder,
``runs:/<run_id>[/<path>]`` (the adapter a training run logged; ``adapter`` when no path is given)
or ``models:/<name>/<version>`` / ``models:/<name>@<alias>`` (a registered version; its ``source``
is downloaded, with ``runs:/<run_id>/adapter`` as the fallback). The folder is a PEFT adapter or,
after full fine-tuning, a whole model. When it comes from a training run, the base model, task,
system prompt and eval split are read from that run's params unless given.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from zerolab import tracking
from zerolab.errors import EvaluationError
from zerolab.integrity import json_problem

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadSpec:
    """How to load one model under evaluation; crosses into Ray actors as a dict."""

    name_or_path: str
    """The base model, or the folder of a fully fine-tuned model."""
    adapter_path: str | None = None
    """A PEFT adapter folder applied on top of ``name_or_path``."""
    merge: bool = False
    """Merge the adapter into the base weights after loading (peft's ``merge_and_unload``)."""
    revision: str | None = None
    trust_remote_code: bool = False
    attn_implementation: str = "sdpa"
    quantization: str = "none"
    """``model.quantization`` of the base (a QLoRA adapter is evaluated on the base quantized as it was trained)."""
    rope: tuple[str, float, int | None] = ("none", 1.0, None)
    """``model.rope_scaling``, ``rope_factor`` and ``rope_original_max_position_embeddings`` the base loads with (as trained)."""


@dataclass
class Target:
    """A base model and, optionally, what fine-tuning made of it, with what is known about its origin."""

    base: str | None
    tuned_path: str | None = None
    tuned_kind: Literal["adapter", "full"] | None = None
    source: str | None = None
    """The reference the tuned model came from, as given (a folder, ``runs:/...`` or ``models:/...``)."""
    run_id: str | None = None
    """The training run that produced it, when known."""
    run_params: dict[str, str] = field(default_factory=dict)
    run_name: str | None = None
    experiment_id: str | None = None
    quantization: str = "none"
    """How the base loads (``model.quantization``): as the training run trained on it, unless given."""
    rope: tuple[str, float, int | None] = ("none", 1.0, None)
    """The RoPE scaling the base loads with: the training run's (``model.rope_scaling``, ``rope_factor``,
    ``rope_original_max_position_embeddings``), so that positions past the trained length mean what they meant in training."""

    def param(self, key: str) -> str | None:
        """A training-run param, None when missing or empty (MLflow stores None as '')."""
        value = self.run_params.get(key)
        return value if value else None

    def tuned_spec(self, *, merge: bool = False) -> LoadSpec | None:
        if self.tuned_path is None:
            return None
        if self.tuned_kind == "full":
            if merge:
                raise EvaluationError(f"{self.source} is a fully fine-tuned model, not an adapter; there is nothing to merge: evaluate it unmerged",
                                      input="merge")
            return LoadSpec(name_or_path=self.tuned_path)
        assert self.base is not None, "an adapter target always knows its base model"
        return LoadSpec(name_or_path=self.base, adapter_path=self.tuned_path, merge=merge, quantization=self.quantization, rope=self.rope)

    def base_spec(self) -> LoadSpec | None:
        return LoadSpec(name_or_path=self.base, quantization=self.quantization, rope=self.rope) if self.base else None


def resolve_target(adapter: str | None, model: str | None, tracking_uri: str, download_dir: str | Path, *,
                   quantization: str | None = None) -> Target:
    """Find the tuned model named by ``adapter`` (downloading it from MLflow into ``download_dir``
    when it is a ``runs:/`` or ``models:/`` reference) and its base model, to be loaded with
    ``quantization`` (default: the training run's ``model.quantization``, else none). Raises EvaluationError."""
    if adapter is None:
        if model is None:
            raise EvaluationError("nothing to evaluate: give a tuned model (a folder, runs:/<run_id> or models:/<name>/<version>) and/or a base model", input="adapter")
        return Target(base=model, quantization=quantization or "none")
    download_dir = Path(download_dir)
    run_id = None
    if adapter.startswith("runs:/"):
        run_id, _, artifact = adapter[len("runs:/"):].strip("/").partition("/")
        if not run_id:
            raise EvaluationError(f"the adapter reference {adapter} has no run id; write runs:/<run_id> (the adapter a training run logged) or runs:/<run_id>/<artifact path>", input="adapter")
        run = _get_run(tracking_uri, run_id, adapter)
        folder = _download(f"runs:/{run_id}/{artifact or 'adapter'}", tracking_uri, download_dir / "adapter", adapter)
    elif adapter.startswith("models:/"):
        folder, run_id = _download_model_version(adapter, tracking_uri, download_dir)
        run = _get_run(tracking_uri, run_id, adapter) if run_id else None
    elif "://" in adapter or adapter.startswith(("runs:", "models:")):
        raise EvaluationError(f"the adapter reference {adapter} is not supported; use a local folder, runs:/<run_id>[/<path>], models:/<name>/<version> or models:/<name>@<alias>", input="adapter")
    else:
        folder = Path(adapter).expanduser()
        if not folder.is_dir():
            raise EvaluationError(f"there is no adapter folder {adapter}; give the adapter folder a training run saved (<run.storage_path>/<run.name>/checkpoint_*/adapter), runs:/<run_id> or models:/<name>/<version>",
                                  input="adapter")
        run = None
    tuned, kind = find_model_folder(folder, adapter)
    params = dict(run.data.params) if run is not None else {}
    base = model or params.get("model.name_or_path") or None
    if base is None and kind == "adapter":
        config = (tuned / "adapter_config.json").read_bytes()
        problem = json_problem(config)
        if problem is not None:
            raise EvaluationError(f"the adapter {adapter} is damaged: adapter_config.json {problem}. Copy it again from the training "
                                  f"run's checkpoint (<run.storage_path>/<run.name>/checkpoint_*/adapter)", input="adapter")
        base = json.loads(config).get("base_model_name_or_path")
        if not base:
            raise EvaluationError(f"the adapter {adapter} names no base model in its adapter_config.json; give the base model it was trained on",
                                  input="model")
    return Target(base=base, tuned_path=str(tuned), tuned_kind=kind, source=adapter, run_id=run_id, run_params=params,
                  run_name=run.info.run_name if run is not None else None,
                  experiment_id=run.info.experiment_id if run is not None else None,
                  quantization=quantization or params.get("model.quantization") or "none", rope=rope_of(params))


def rope_of(params: dict[str, str]) -> tuple[str, float, int | None]:
    """The RoPE scaling a training run's params (MLflow's strings, '' for empty) say its base loaded with."""
    original = params.get("model.rope_original_max_position_embeddings")
    return (params.get("model.rope_scaling") or "none", float(params.get("model.rope_factor") or 1.0),
            int(original) if original else None)


def find_model_folder(folder: Path, ref: str) -> tuple[Path, Literal["adapter", "full"]]:
    """The folder (``folder`` or one below it) holding a PEFT adapter or a whole HF model; ``ref``
    is how the user named it."""
    candidates = [folder, *sorted(p for p in folder.rglob("*") if p.is_dir() and len(p.relative_to(folder).parts) <= 2)]
    for path in candidates:
        if (path / "adapter_config.json").is_file():
            return path, "adapter"
    for path in candidates:
        if (path / "config.json").is_file() and (any(path.glob("*.safetensors")) or any(path.glob("*.bin"))):
            return path, "full"
    raise EvaluationError(
        f"the adapter {ref} holds neither a PEFT adapter (adapter_config.json) nor a saved model (config.json + weights) in {folder} or two levels below it; point it at the adapter folder a training run saved", input="adapter"
    )


def _get_run(uri: str, run_id: str, ref: str) -> Any:

    try:
        return tracking.get_run(uri, run_id)
    except tracking.NotInStore as exc:
        raise EvaluationError(
            f"there is no MLflow run '{run_id}' in {uri} ({exc}) for the adapter reference {ref}; check the run id (`mlflow ui --backend-store-uri {uri}` lists the runs) or point the tracking URI (or MLFLOW_TRACKING_URI) at the store that holds it",
            input="adapter",
        ) from None


def _download(artifact_uri: str, uri: str, dst: Path, ref: str) -> Path:

    try:
        return tracking.download(artifact_uri, uri, dst)
    except tracking.NotInStore as exc:
        raise EvaluationError(
            f"could not download {artifact_uri} for the adapter reference {ref} ({exc}); the run may have logged no adapter (it failed or was stopped before the end), or the artifact path differs: give it as runs:/<run_id>/<path>",
            input="adapter",
        ) from None


def _download_model_version(ref: str, uri: str, download_dir: Path) -> tuple[Path, str | None]:
    """Download a registered version's ``source``, falling back to ``runs:/<run_id>/adapter``."""

    body = ref[len("models:/"):].strip("/")
    alias: str | None = None
    version: str | None = None
    if "@" in body:
        name, alias = body.split("@", 1)
    else:
        name, _, version = body.rpartition("/")
        if not name or not version:
            raise EvaluationError(f"the adapter reference {ref} names no version; write models:/<name>/<version> or models:/<name>@<alias>",
                                  input="adapter")
    try:
        mv = tracking.model_version(uri, name, version=version, alias=alias)
    except tracking.NotInStore as exc:
        raise EvaluationError(
            f"no such registered model version {ref} in {uri} ({exc}); check the name and version or alias in the MLflow UI's Models page, or point the tracking URI at the right store",
            input="adapter",
        ) from None
    tries = [mv.source] if mv.source else []
    if mv.run_id:
        tries.append(f"runs:/{mv.run_id}/adapter")
    for i, artifact_uri in enumerate(tries):
        try:
            folder = _download(artifact_uri, uri, download_dir / f"version-{i}", ref)
            find_model_folder(folder, ref)
            return folder, mv.run_id or None
        except EvaluationError as exc:
            logger.warning("%s: %s", ref, exc)
    raise EvaluationError(f"version {mv.version} of the registered model '{mv.name}' ({ref}) has no loadable adapter or model at {' or '.join(tries) or 'any source'}", input="adapter")
