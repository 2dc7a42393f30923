"""Generic machinery that turns nested dicts (parsed YAML) into frozen, validated dataclasses.

Each dataclass field may carry metadata made with :func:`opt`: allowed choices, numeric bounds and
a custom check. :func:`build` walks the dict, rejects unknown keys (suggesting the closest one),
checks types and bounds, and raises :class:`ConfigError` with exactly one line of the form
``<file>: <key.path>: <problem>; allowed: <...>``.

Kept apart from ``builder/config.py`` so the section definitions there read like the contract.
"""
from __future__ import annotations

import dataclasses
import math
import re
import difflib
import types
import typing
from typing import Any, Callable

MISSING = dataclasses.MISSING


class ConfigError(ValueError):
    """A user mistake in a config file or override; the message is one line."""

    def __init__(self, file: str, path: str, problem: str, allowed: str | None = None):
        self.file, self.path, self.problem, self.allowed = file, path, problem, allowed
        msg = f"{file}: {path}: {problem}" if path else f"{file}: {problem}"
        if allowed:
            msg += f"; allowed: {allowed}"
        super().__init__(msg.replace("\n", " "))


def opt(default: Any = MISSING, *, choices: tuple | None = None, min: float | None = None,
        max: float | None = None, check: Callable[[Any], str | None] | None = None,
        allowed: str | None = None) -> Any:
    """A dataclass field with validation metadata.

    ``check(value)`` returns a problem string or None; ``allowed`` describes valid values when the
    other metadata cannot (it is printed after "allowed:" in errors).
    """
    meta = {"choices": choices, "min": min, "max": max, "check": check, "allowed": allowed}
    if isinstance(default, (list, dict, set)):
        raise TypeError("use a tuple or a dataclass default: config sections are frozen")
    if dataclasses.is_dataclass(default):
        return dataclasses.field(default_factory=lambda: default, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if tp is type(None):
        return "null"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is tuple:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return {int: "an integer", float: "a number", str: "a string", bool: "true/false"}.get(tp, str(tp))


def _describe_allowed(tp: Any, meta: dict) -> str:
    if meta.get("allowed"):
        return meta["allowed"]
    if meta.get("choices"):
        return " | ".join("null" if c is None else str(c) for c in meta["choices"])
    text = _type_name(tp)
    lo, hi = meta.get("min"), meta.get("max")
    if lo is not None and hi is not None:
        text += f" in {lo}..{hi}"
    elif lo is not None:
        text += f" >= {lo}"
    elif hi is not None:
        text += f" <= {hi}"
    return text


class _Mismatch(Exception):
    pass


class _NotFinite(Exception):
    """A number field got NaN or infinity (YAML .nan/.inf, or 1e999): no fallback type may take it."""

    def __init__(self, path: str, value: Any):
        super().__init__(path)
        self.path, self.value = path, value


_EXPONENT_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _coerce(value: Any, tp: Any, file: str, path: str) -> Any:
    """Return value converted to tp (lists -> tuples, ints -> floats) or raise _Mismatch."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _coerce(value, arg, file, path)
            except _Mismatch:
                continue
        raise _Mismatch
    if tp is type(None):
        if value is None:
            return None
        raise _Mismatch
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise _Mismatch
        return build(tp, value, file, path)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise _Mismatch
        item_tp = typing.get_args(tp)[0]
        return tuple(_coerce(v, item_tp, file, f"{path}[{i}]") for i, v in enumerate(value))
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _Mismatch
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _Mismatch
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = value
        elif isinstance(value, str) and _EXPONENT_FLOAT.fullmatch(value.strip()):
            # YAML 1.1 (PyYAML) reads 1e-3 as a string: it wants a dot (1.0e-3); take what users write
            number = value
        else:
            raise _Mismatch
        try:
            number = float(number)
        except OverflowError:  # an integer beyond float range
            raise _NotFinite(path, value) from None
        if not math.isfinite(number):  # NaN passes every min/max comparison: refuse it here, once
            raise _NotFinite(path, value)
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        raise _Mismatch
    raise AssertionError(f"unsupported schema type {tp!r} at {path}")


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def build(cls: type, data: dict, file: str, prefix: str = "") -> Any:
    """Construct dataclass ``cls`` from ``data``, validating every field."""
    hints = typing.get_type_hints(cls)
    # fields marked internal (e.g. where the config came from) are not user keys
    fields = {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("internal")}
    if not isinstance(data, dict):
        raise ConfigError(file, prefix or "<root>", f"expected a mapping, got {_show(data)}")
    for key in data:
        if key not in fields:
            full = f"{prefix}.{key}" if prefix else str(key)
            close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.5)
            near = f"{prefix}.{close[0]}" if close and prefix else (close[0] if close else "")
            hint = f"unknown key; did you mean '{near}'?" if close else "unknown key"
            raise ConfigError(file, full, hint, ", ".join(fields))
    kwargs = {}
    for name, f in fields.items():
        path = f"{prefix}.{name}" if prefix else name
        tp, meta = hints[name], dict(f.metadata)
        if name not in data:
            if f.default is MISSING and f.default_factory is MISSING:
                raise ConfigError(file, path, "required key is missing", _describe_allowed(tp, meta))
            continue
        raw = data[name]
        if dataclasses.is_dataclass(tp) and raw is None:
            raw = {}  # an empty YAML section ("engine:") means "all defaults"
        try:
            value = _coerce(raw, tp, file, path)
        except _Mismatch:
            raise ConfigError(file, path, f"expected {_type_name(tp)}, got {_show(raw)}",
                              _describe_allowed(tp, meta)) from None
        except _NotFinite as e:
            raise ConfigError(file, e.path, f"{_show(e.value)} is not a finite number",
                              _describe_allowed(tp, meta) + " (not NaN or infinity)") from None
        _check_value(value, tp, meta, file, path)
        kwargs[name] = value
    return cls(**kwargs)


def _check_value(value: Any, tp: Any, meta: dict, file: str, path: str) -> None:
    allowed = _describe_allowed(tp, meta)
    if meta.get("choices") is not None and value not in meta["choices"]:
        raise ConfigError(file, path, f"invalid value {_show(value)}", allowed)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if meta.get("min") is not None and value < meta["min"]:
            raise ConfigError(file, path, f"{value} is too small", allowed)
        if meta.get("max") is not None and value > meta["max"]:
            raise ConfigError(file, path, f"{value} is too large", allowed)
    if meta.get("check") is not None and value is not None:
        problem = meta["check"](value)
        if problem:
            raise ConfigError(file, path, problem, allowed)


def all_key_paths(cls: type, prefix: str = "") -> list[str]:
    """Every leaf key path of a schema, e.g. ``engine.max_batch_size`` (for suggestions and docs)."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if f.metadata.get("internal"):
            continue
        path = f"{prefix}.{f.name}" if prefix else f.name
        if dataclasses.is_dataclass(hints[f.name]):
            out += all_key_paths(hints[f.name], path)
        else:
            out.append(path)
    return out
