"""Typed JSON for ``backend/bundle.py``: a parsed engine.json section checked against a dataclass's
type hints and converted (objects to dataclasses, lists to tuples), field by field, naming the first
wrong one. Generic; the format's own rules (version, weight files, key order) stay in bundle.py.
Standard library only, like bundle.py (it runs inside Triton's Python backend).
"""
from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from typing import Any



class SectionError(ValueError):
    """A section's own value check failed (raised by its dataclass, e.g. ``ModelConfig``): the message
    starts "engine.json: " and names the key path."""


class FieldError(Exception):
    """One field is missing or wrong: "<field>: <what>" (BundleError adds the file and the hint).
    ``unknown``: the field is not in the format at all (bundle.py says which version it read)."""

    def __init__(self, message: str, unknown: bool = False) -> None:
        super().__init__(message)
        self.unknown = unknown


JSON_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string",
              type(None): "null", dict: "an object", list: "a list", tuple: "a list"}


def expected(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(expected(a) for a in typing.get_args(hint))
    if dataclasses.is_dataclass(hint):
        return "an object"
    return JSON_NAMES.get(origin or hint, str(hint))


def accepts(v: Any, hint: Any) -> bool:
    """Shallow type check (elements of lists and objects are checked by parse)."""
    origin = typing.get_origin(hint) or hint
    if origin in (typing.Union, types.UnionType):
        return any(accepts(v, a) for a in typing.get_args(hint))
    if dataclasses.is_dataclass(hint) or origin is dict:
        return isinstance(v, dict)
    if origin in (tuple, list):
        return isinstance(v, (list, tuple))
    if hint is float:
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if hint is int:
        return isinstance(v, int) and not isinstance(v, bool)
    return isinstance(v, origin)


def parse(v: Any, hint: Any, where: str) -> Any:
    """``v`` (JSON) checked against ``hint`` and converted: objects to dataclasses, lists to tuples."""
    if not accepts(v, hint):
        raise FieldError(f"{where}: expected {expected(hint)}, got {json.dumps(v, default=repr)[:60]}")
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return parse(v, next(a for a in args if accepts(v, a)), where)
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, v, where)
    if origin is tuple:
        return tuple(parse(x, args[0], f"{where}[{i}]") for i, x in enumerate(v))
    if origin is dict:
        return {k: parse(x, args[1], f"{where}.{k}") for k, x in v.items()}
    return v


def from_dict(cls: type, d: dict, where: str) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    prefix = f"{where}." if where else ""
    for key in d:
        if key not in fields:
            raise FieldError(f"{prefix}{key}: unknown field", unknown=True)
    kwargs = {}
    for name, f in fields.items():
        if name not in d:
            no_default = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            if no_default or f.metadata.get("required"):
                raise FieldError(f"{prefix}{name}: missing")
            continue
        kwargs[name] = parse(d[name], hints[name], f"{prefix}{name}")
    try:
        return cls(**kwargs)
    except SectionError as exc:  # its own value checks: "engine.json: model.dtype: ..."
        raise FieldError(str(exc).removeprefix("engine.json: ")) from None


def non_finite(obj: Any, where: str = "") -> str | None:
    """The first field holding NaN or infinity (JSON has neither), or None."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return where or "(top level)"
    if isinstance(obj, dict):
        items = ((f"{where}.{k}" if where else str(k), x) for k, x in obj.items())
    else:
        items = ((f"{where}[{i}]", x) for i, x in enumerate(obj if isinstance(obj, list) else ()))
    return next((found for w, x in items if (found := non_finite(x, w))), None)
