"""A checkpoint's weights files as ``from_pretrained`` finds them: their sizes, read from a local
folder or the local Hugging Face cache without opening a weight, and the model-config key that
carries them from the model's config (``zerolab.models.load_model_config``) to the memory estimate."""

from __future__ import annotations

import json
from pathlib import Path

CHECKPOINT_FILES_KEY = "checkpoint_file_bytes"
"""The model config's entry (attribute, or key of a dict config) that holds the size of each
weights file of the checkpoint, where :func:`checkpoint_file_sizes` found them."""

WEIGHTS_FILES = (("model.safetensors", "model.safetensors.index.json"), ("pytorch_model.bin", "pytorch_model.bin.index.json"))
"""A checkpoint's weights as ``from_pretrained`` looks for them, first found first: one file, or an
index of shards; safetensors before PyTorch's format."""


def checkpoint_file_sizes(name_or_path: str, revision: str | None = None) -> tuple[int, ...] | None:
    """The size of each weights file of the checkpoint at ``name_or_path`` (a local folder, or a hub
    id whose files are in the local Hugging Face cache), in the order its index names them; None
    where they are not all at hand (a hub id not downloaded yet, a partial download, no weights).
    Reads the file system only: nothing is opened but an index."""
    folder = Path(name_or_path).expanduser()

    def find(name: str) -> Path | None:
        if folder.is_dir():
            return folder / name if (folder / name).is_file() else None
        from huggingface_hub import try_to_load_from_cache

        try:
            found = try_to_load_from_cache(name_or_path, name, revision=revision)
        except ValueError:  # not a valid hub id either
            return None
        return Path(found) if isinstance(found, str) else None

    for single, index_name in WEIGHTS_FILES:
        if (path := find(single)) is not None:
            return (path.stat().st_size,)
        if (index := find(index_name)) is not None:
            try:
                names = list(dict.fromkeys(json.loads(index.read_text())["weight_map"].values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                return None
            paths = [find(name) for name in names]
            if not paths or any(p is None for p in paths):
                return None
            return tuple(p.stat().st_size for p in paths if p is not None)
    return None
