"""Typed building of the config dataclasses from raw YAML values and back: unknown keys with
'did you mean' hints, values coerced to each field's type or named with the fix."""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from typing import Any, Literal

_ALIASES = {
    "rank": "r", "lora_r": "r", "lora_rank": "r", "lora_alpha": "alpha", "lora_dropout": "dropout",
    "learning_rate": "lr", "batch_size": "micro_batch_size", "per_device_train_batch_size": "micro_batch_size",
    "gradient_accumulation_steps": "grad_accum_steps", "zero_stage": "stage", "num_train_epochs": "num_epochs",
    "model_name_or_path": "name_or_path", "model": "name_or_path", "max_length": "max_seq_length",
}
"""Names other fine-tuning tools use for our keys, for 'did you mean' hints."""


def build(cls: type, raw: Any, prefix: str, problems: list[str]) -> Any:
    where = prefix.rstrip(".") or "config"
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        problems.append(f"{where}: expected a mapping of keys, got {type(raw).__name__} {raw!r}")
        return cls()
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    problems.extend(unknown_key(key, prefix, names) for key in raw if key not in names)
    kwargs = {}
    for name in names:
        if name not in raw:
            continue
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = build(tp, raw[name], f"{prefix}{name}.", problems)
        else:
            ok, value = coerce(raw[name], tp)
            if ok:
                kwargs[name] = value
            else:
                problems.append(f"{prefix}{name}: {raw[name]!r} is not {describe(tp)}; {fix_hint(tp)}")
    return cls(**kwargs)


def unknown_key(key: Any, prefix: str, names: list[str]) -> str:
    close = [_ALIASES[key]] if _ALIASES.get(key) in names else difflib.get_close_matches(str(key), names, n=1)
    hint = f"did you mean '{prefix}{close[0]}'?" if close else f"valid keys: {', '.join(names)}"
    return f"{prefix}{key}: unknown key; {hint}"


def coerce(value: Any, tp: Any) -> tuple[bool, Any]:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None:
            return (type(None) in args), None
        for arg in args:
            if arg is not type(None):
                ok, out = coerce(value, arg)
                if ok:
                    return True, out
        return False, None
    if origin is Literal:
        return (value in args and type(value) in {type(a) for a in args}), value
    if origin is tuple:
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)):
            return False, None
        out = []
        for item in items:
            ok, v = coerce(item, args[0])
            if not ok:
                return False, None
            out.append(v)
        return True, tuple(out)
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is float:
        if isinstance(value, str):
            # PyYAML (YAML 1.1) reads exponent forms such as 3e-4 as strings.
            try:
                value = float(value)
            except ValueError:
                return False, None
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        return ok, float(value) if ok else None
    if tp is str:
        return isinstance(value, str), value
    raise AssertionError(f"unsupported config type {tp}")


def describe(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join("empty (null)" if a is type(None) else describe(a) for a in args)
    if origin is Literal:
        return repr(args[0]) if len(args) == 1 else "one of " + ", ".join(repr(a) for a in args)
    if origin is tuple:
        return f"a list of {describe(args[0])}"
    return {bool: "true/false", int: "an integer", float: "a finite number", str: "a string"}[tp]


def fix_hint(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "choose one of " + ", ".join(str(a) for a in typing.get_args(tp))
    return f"use {describe(tp)}"


def to_plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_plain(v) for v in value]
    return value
