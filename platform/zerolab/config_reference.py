"""The configuration reference of docs/configuration.md, generated from the config dataclasses'
attribute docstrings (``tests/test_config.py`` checks the page holds what this makes)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import typing

from zerolab.config import SFTConfig


def reference_markdown() -> str:
    """The configuration reference table of docs/configuration.md (regenerate with
    ``python -c "from zerolab.config_reference import reference_markdown as r; print(r())"``)."""
    lines = ["| key | default | meaning |", "|---|---|---|"]
    for key, default, doc in reference_rows():
        shown = f"`{default}`" if default else "—"
        lines.append(f"| `{key}` | {shown} | {doc} |")
    return "\n".join(lines)


def reference_rows() -> list[tuple[str, str, str]]:
    """(dotted key, default, description) for every config field, from the attribute docstrings."""
    rows = []
    for section in dataclasses.fields(SFTConfig):
        cls = typing.get_type_hints(SFTConfig)[section.name]
        docs = _attribute_docstrings(cls)
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            shown = "" if default is None else (", ".join(default) if isinstance(default, tuple) else str(default))
            rows.append((f"{section.name}.{f.name}", shown, docs.get(f.name, "")))
    return rows


def _attribute_docstrings(cls: type) -> dict[str, str]:
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())  # type: ignore[union-attr]
    return docs
