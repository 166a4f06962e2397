"""`key=value` overrides of any scheduler field, nested by dots (`admission.target_ttft_s=2`).

Owns: `apply_overrides`, which `tidal simulate --set` and experiments use to change one knob
of a preset. Values arrive as strings and are read by the type of the field they replace
(int, float, bool, None, str, or a comma-separated tuple of ints); the config's own validation
then runs, so a bad value fails with the same message a YAML config would get. An unknown key
fails with the known ones listed.

Must not import: ray, torch, transformers, fastapi, asyncio, or read the wall clock.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any

from tidal_core.config import SchedulerConfig

_NONE_WORDS = ("none", "null", "off")


def _origin(hint: Any) -> Any:
    return typing.get_origin(hint)


def _parse(text: str, hint: Any, key: str) -> Any:
    """`text` as a value of the annotated type `hint` (an annotation string or type)."""
    options = hint if isinstance(hint, tuple) else (hint,)
    if text.strip().lower() in _NONE_WORDS and type(None) in options:
        return None
    for kind in options:
        if kind is bool:
            if text.lower() in ("true", "1", "yes", "on"):
                return True
            if text.lower() in ("false", "0", "no", "off"):
                return False
        elif kind is int:
            try:
                return int(text)
            except ValueError:
                pass
        elif kind is float:
            try:
                return float(text)
            except ValueError:
                pass
        elif kind is str:
            return text
        elif _origin(kind) is tuple:
            try:
                return tuple(int(v) for v in text.split(",") if v.strip())
            except ValueError:
                pass
    names = "/".join(getattr(k, "__name__", str(k)) for k in options)
    raise ValueError(f"--set {key}={text!r}: expected {names}")


def _types_of(cls: type) -> dict[str, tuple[Any, ...]]:
    hints = typing.get_type_hints(cls)
    out: dict[str, tuple[Any, ...]] = {}
    for name, hint in hints.items():
        if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
            out[name] = typing.get_args(hint)
        else:
            out[name] = (hint,)
    return out


def _apply(obj: Any, changes: dict[str, Any], prefix: str) -> Any:
    """`obj` with `changes` ({field: text, or {nested field: ...}}), one `replace` per level so
    the config validates the combination, not each value in turn."""
    fields = {f.name for f in dataclasses.fields(obj)}
    values: dict[str, Any] = {}
    for head, change in changes.items():
        key = prefix + head
        if head not in fields:
            raise ValueError(f"--set {key}: {type(obj).__name__} has no field {head!r}; "
                             f"known: {', '.join(sorted(fields))}")
        current = getattr(obj, head)
        if isinstance(change, dict):
            if not dataclasses.is_dataclass(current):
                raise ValueError(f"--set {key}.{next(iter(change))}: {head!r} is a plain value, not a group of fields")
            values[head] = _apply(current, change, key + ".")
        elif dataclasses.is_dataclass(current):
            raise ValueError(f"--set {key}: {head!r} is a group; set one of its fields, e.g. {head}."
                             f"{dataclasses.fields(current)[0].name}=...")
        else:
            values[head] = _parse(change, _types_of(type(obj))[head], key)
    return dataclasses.replace(obj, **values)


def apply_overrides(config: SchedulerConfig, overrides: Mapping[str, str]) -> SchedulerConfig:
    """`config` with each dotted `key` set to `value` (parsed by the field's type)."""
    tree: dict[str, Any] = {}
    for key, text in overrides.items():
        *parents, leaf = key.split(".")
        node = tree
        for part in parents:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ValueError(f"--set {key}: {part!r} is set as a value and as a group")
            node = child
        node[leaf] = text
    result: SchedulerConfig = _apply(config, tree, "")
    return result


def parse_pairs(pairs: list[str]) -> dict[str, str]:
    """`["a.b=1", "c=2"]` -> `{"a.b": "1", "c": "2"}`; a pair without `=` is an error."""
    out: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--set {pair!r}: write key=value, e.g. admission.target_ttft_s=2")
        out[key.strip()] = value.strip()
    return out
