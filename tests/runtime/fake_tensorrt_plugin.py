"""The MOCK of ``tensorrt.plugin`` (TensorRT's quickly deployable Python plugins): see fake_tensorrt.py.

Its schema checks are the documented ones TensorRT applies with ``inspect.signature``: register's
TensorDescs first, then typed attributes, a TensorDesc or Tuple[TensorDesc, ...] return, class (never
string) annotations; autotune's and aot_impl's argument names; aot_impl's 4-tuple return annotation.
Its ShapeExpr carries the value a test gave it but is never a Python int, so code that treats a
symbolic dim as one fails here as it would under TensorRT.
"""
from __future__ import annotations

import inspect
import types
import typing
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.runtime.fake_tensorrt import Fake

class ShapeExpr:
    """A symbolic dim that knows its value for the test; like TensorRT's, it is never a Python int
    (no int(), no unary minus): code that treats it as one fails here."""
    def __init__(self, value: int):
        self.value = int(value)

    is_constant = False

    def constant_value(self):
        raise RuntimeError("not a build-time constant")

    def _op(self, other, f):
        o = other.value if isinstance(other, ShapeExpr) else other
        if not isinstance(o, int):
            return NotImplemented
        return ShapeExpr(f(self.value, o))

    def __add__(self, o): return self._op(o, lambda a, b: a + b)
    def __radd__(self, o): return self._op(o, lambda a, b: b + a)
    def __sub__(self, o): return self._op(o, lambda a, b: a - b)
    def __rsub__(self, o): return self._op(o, lambda a, b: b - a)
    def __mul__(self, o): return self._op(o, lambda a, b: a * b)
    def __rmul__(self, o): return self._op(o, lambda a, b: b * a)
    def __floordiv__(self, o): return self._op(o, lambda a, b: a // b)

    def __repr__(self) -> str:
        return f"ShapeExpr({self.value})"


class ShapeExprs(list):
    pass


class TensorDesc:
    def __init__(self, shape_expr=None, dtype=None, format=None, scale=None):
        self.shape_expr = ShapeExprs(x if isinstance(x, ShapeExpr) else ShapeExpr(x) for x in shape_expr or ())
        self.dtype = dtype
        self.alias_of: TensorDesc | None = None

    @property
    def ndim(self) -> int:
        return len(self.shape_expr)

    def aliased(self) -> "TensorDesc":
        d = TensorDesc(self.shape_expr, self.dtype)
        d.alias_of = self
        return d

    def like(self) -> "TensorDesc":
        return TensorDesc(self.shape_expr, self.dtype)


def from_shape_expr(shape_expr, dtype=None) -> TensorDesc:
    return TensorDesc(shape_expr, dtype)


def cdiv(first, second) -> ShapeExpr:
    if isinstance(first, int) and isinstance(second, int):
        raise ValueError("cdiv: both arguments are ints")   # as TensorRT's
    a = first.value if isinstance(first, ShapeExpr) else first
    b = second.value if isinstance(second, ShapeExpr) else second
    return ShapeExpr(-(-a // b))


class SymExprs(list):
    pass


class SymInt32:
    def __init__(self, value):
        if not isinstance(value, (int, ShapeExpr)):
            raise TypeError(f"SymInt32 takes an int or a ShapeExpr, got {type(value).__name__}")
        self.value = value.value if isinstance(value, ShapeExpr) else value


class SymIntExprs(SymExprs):
    @classmethod
    def from_tuple(cls, exprs):
        if not all(isinstance(e, SymInt32) for e in exprs):
            raise TypeError("SymIntExprs.from_tuple takes SymInt32s")
        return cls(exprs)


class KernelLaunchParams:
    _FIELDS = ("grid_x", "grid_y", "grid_z", "block_x", "block_y", "block_z", "shared_mem")

    def __init__(self):
        for f in self._FIELDS:
            object.__setattr__(self, f, 0 if f == "shared_mem" else 1)

    def __setattr__(self, name, value):
        if name not in self._FIELDS or not isinstance(value, (int, ShapeExpr, SymInt32)):
            raise TypeError(f"KernelLaunchParams.{name} = {value!r}")
        object.__setattr__(self, name, value)


class AutoTuneCombination:
    def __init__(self, io_types=None, layouts=None, tactics=None):
        self.io_types, self.layouts, self.tactics = io_types, layouts, tactics


ATTR_TYPES = (int, float, bool, str, bytes)


def _params(fn) -> list[inspect.Parameter]:
    params = list(inspect.signature(fn).parameters.values())
    for p in params:
        if p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            raise ValueError(f"argument {p.name} is not positional-or-keyword")
    return params


def _is_desc_tuple(ann) -> bool:
    return typing.get_origin(ann) is tuple and all(isinstance(a, type) and issubclass(a, TensorDesc)
                                                   for a in typing.get_args(ann))


def _check_register(fn):
    """tensorrt.plugin.register's documented schema: TensorDescs first, then typed attributes; the
    return is TensorDesc or Tuple[TensorDesc, ...]; annotations are classes, never strings."""
    inputs, attrs = [], []
    for p in _params(fn):
        ann = p.annotation
        if ann is inspect.Parameter.empty or isinstance(ann, str):
            raise ValueError(f"argument {p.name}: annotation {ann!r} is not a TensorDesc or attribute type")
        if isinstance(ann, type) and issubclass(ann, TensorDesc):
            if attrs:
                raise ValueError("TensorDescs and attributes cannot be interspersed")
            inputs.append(p.name)
        elif ann in ATTR_TYPES:
            attrs.append(p.name)
        else:
            raise ValueError(f"attribute {p.name}: {ann!r} is not serializable")
    ret = inspect.signature(fn).return_annotation
    if _is_desc_tuple(ret):
        n_out = len(typing.get_args(ret))
    elif isinstance(ret, type) and issubclass(ret, TensorDesc):
        n_out = 1
    else:
        raise ValueError(f"return annotation {ret!r} is not TensorDesc or Tuple[TensorDesc]")
    return inputs, attrs, n_out


def _check_schema(fn, pdef: dict, tail: list[str], what: str) -> list[str]:
    """autotune / aot_impl: the inputs, a subset of the attributes in order, then `tail`."""
    names = [p.name for p in _params(fn)]
    n_in = len(pdef["inputs"])
    attrs = names[n_in:len(names) - len(tail)]
    if names[:n_in] != pdef["inputs"] or names[len(names) - len(tail):] != tail or \
            attrs != [a for a in pdef["attrs"] if a in attrs]:
        raise ValueError(f"{what} signature {names} does not match {pdef['inputs']} + attrs + {tail}")
    for p in _params(fn):
        if p.name == "outputs" and p.annotation is not inspect.Parameter.empty and not _is_desc_tuple(p.annotation):
            raise ValueError(f"'outputs' should be Tuple[TensorDesc], got {p.annotation!r}")
    return attrs


def make_module(fake: "Fake") -> types.ModuleType:
    m = types.ModuleType("tensorrt.plugin")
    for obj in (TensorDesc, ShapeExpr, ShapeExprs, SymExprs, SymInt32, SymIntExprs, KernelLaunchParams,
                AutoTuneCombination, from_shape_expr, cdiv):
        setattr(m, obj.__name__, obj)

    def register(plugin_id: str, lazy_register: bool = False):
        def deco(fn):
            if plugin_id in fake.plugins:
                raise ValueError(f"{plugin_id} is already registered")
            inputs, attrs, n_out = _check_register(fn)
            fake.plugins[plugin_id] = {"register": fn, "inputs": inputs, "attrs": attrs, "num_outputs": n_out}
            fake.calls.append(("plugin.register", plugin_id))
            return fn
        return deco

    def autotune(plugin_id: str):
        def deco(fn):
            pdef = fake.plugins[plugin_id]
            pdef["tune_attrs"] = _check_schema(fn, pdef, ["outputs"], "autotune")
            pdef["autotune"] = fn
            return fn
        return deco

    def aot_impl(plugin_id: str):
        def deco(fn):
            pdef = fake.plugins[plugin_id]
            pdef["aot_attrs"] = _check_schema(fn, pdef, ["outputs", "tactic"], "aot_impl")
            ret = inspect.signature(fn).return_annotation
            args = typing.get_args(ret)
            if typing.get_origin(ret) is not tuple or len(args) != 4 or not issubclass(args[2], KernelLaunchParams) \
                    or not issubclass(args[3], SymExprs):
                raise ValueError(f"aot_impl return annotation {ret!r}")
            pdef["aot_impl"] = fn
            return fn
        return deco

    m.register, m.autotune, m.aot_impl = register, autotune, aot_impl
    return m


def build_time_calls(fake: "Fake", plugin_id: str, inputs: dict[str, tuple[tuple[int, ...], str]], attrs: dict,
                     dtypes: dict):
    """What TensorRT does with a registered plugin while building, called as tensorrt.plugin's plugin
    class calls them: the register function with the attributes by keyword; autotune with the inputs,
    its own attributes and the outputs by position; aot_impl with the inputs, EVERY attribute in the
    node's order (``attrs``' order: the ONNX node's), the outputs and the tactic, all by position.
    (inputs: name -> (shape, DataType name)) -> (outputs, autotune combinations, aot_impl's 4-tuple)."""
    pdef = fake.plugins[plugin_id]
    descs = [TensorDesc(inputs[n][0], dtypes[inputs[n][1]]) for n in pdef["inputs"]]
    outs = pdef["register"](*descs, **attrs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    assert len(outs) == pdef["num_outputs"]
    combos = pdef["autotune"](*descs, *[attrs[a] for a in pdef["tune_attrs"]], outs)
    kernel = pdef["aot_impl"](*descs, *attrs.values(), outs, 0)
    return outs, combos, kernel
