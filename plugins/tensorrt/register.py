"""Register a bundle's plugins with TensorRT (`tensorrt.plugin`, imported here lazily, on a TensorRT host).

`register(plugins_dir, sm, plugins, graph)` defines, for each plugin name (an ONNX op type of the
decoder graph, namespace "kiln"), the three functions TensorRT's quickly deployable plugins take:
- `@register("kiln::<name>")`: output descriptors from the inputs' (rope + KV write: its outputs alias
  its first three inputs; paged prefill: out = [T, num_heads * head_dim] in qkv's dtype; W4A16 GEMM:
  out = [M, N] in x's dtype, N the packed weight's rows);
- `@autotune`: the one type combination the bundle's PTX was compiled for, linear formats;
- `@aot_impl`: (entry name, the PTX for `sm`, KernelLaunchParams, int32 SymExprs), with the grid and
  scalars of `variants.launch` evaluated on TensorRT's symbolic shapes.
The variant is chosen (`variants.select`) before tensorrt is imported, so a bundle without a matching
variant is refused in one line whatever the host.

TensorRT reads these functions' signatures with `inspect.signature` and checks that each annotation
IS `TensorDesc` (or an attribute type): string annotations would fail, so the signatures are built
here from `variants.GRAPH_IO` with the real classes (`__signature__`) rather than written as `def`s
under `from __future__ import annotations`. Assumed, not run here (no TensorRT on our machines): that
the ONNX parser strips `plugin_namespace` (and `aot`) and passes the node's int attributes, and that a
plugin with only an AOT implementation is built as AOT. TensorRT's AOT plugin class calls `aot_impl`
with every attribute by position in the node's order (read in NVIDIA's tensorrt.plugin source), so the
attributes are declared in the order the ONNX node holds them (`variants.GraphIO.attrs`).
"""
from __future__ import annotations

import inspect
import typing
import weakref
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

from .variants import GRAPH_IO, GraphConsts, VariantError, io_types, launch, load_metas, node_attrs, read_ptx, select

NAMESPACE = "kiln"
# TensorRT's plugin registry is per process and refuses a second definition of an id: what this
# process registered, per tensorrt.plugin module (weakly: a test's fake module goes with its test)
_REGISTERED: "weakref.WeakKeyDictionary[ModuleType, dict[str, str]]" = weakref.WeakKeyDictionary()
_TRT_DTYPE = {"FP32": "FLOAT", "FP16": "HALF"}   # AutoTuneCombination spelling -> trt.DataType member


def choose(plugins_dir: str | Path, sm: int, plugins: typing.Sequence[str], graph: GraphConsts) -> dict[str, dict]:
    """plugin name -> the variant meta it will launch (its PTX read and checked); no tensorrt needed."""
    metas = load_metas(plugins_dir, sm)
    chosen = {}
    for name in plugins:
        if name not in GRAPH_IO:
            raise VariantError(f"{name}: engine.json tensorrt.plugins names a plugin this Kiln has no TensorRT "
                               f"registration for (known: {', '.join(GRAPH_IO)})")
        meta = select(metas, name, sm, graph)
        chosen[name] = dict(meta, _ptx_bytes=read_ptx(meta))
    return chosen


def register(plugins_dir: str | Path, sm: int, plugins: typing.Sequence[str], graph: GraphConsts) -> dict[str, dict]:
    """Register `plugins` (names) for a build or a plan load on an sm_`sm` GPU. -> name -> variant meta."""
    chosen = choose(plugins_dir, sm, plugins, graph)
    try:
        import tensorrt.plugin as trtp
    except ImportError as exc:   # tensorrt imports (the caller checked) but is older than its plugin API
        raise VariantError(f"tensorrt.plugin does not import ({exc}); Kiln's plugins need a TensorRT with AOT "
                           f"Python plugins (tensorrt.plugin.aot_impl)") from None
    if not hasattr(trtp, "aot_impl"):
        raise VariantError("this TensorRT's tensorrt.plugin has no aot_impl; Kiln's plugins need a TensorRT with AOT "
                           "Python plugins")
    done = _REGISTERED.setdefault(trtp, {})
    for name, meta in chosen.items():
        pid = f"{NAMESPACE}::{name}"
        if pid in done:
            if done[pid] != meta["sha256"]:
                raise VariantError(f"{pid}: already registered in this process with another variant; "
                                   f"TensorRT's plugin registry is per process: run this bundle in a new one")
            continue
        _define(trtp, name, meta, graph)
        done[pid] = meta["sha256"]
    return chosen


def _signature(params: list[tuple[str, Any]], ret: Any) -> inspect.Signature:
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    return inspect.Signature([inspect.Parameter(n, kind, annotation=a) for n, a in params], return_annotation=ret)


def _with_signature(body: Callable[[dict], Any], sig: inspect.Signature) -> Callable:
    """A function TensorRT can introspect (`sig`) that hands `body` its arguments by name."""
    def fn(*args, **kwargs):
        return body(sig.bind(*args, **kwargs).arguments)
    fn.__signature__ = sig   # type: ignore[attr-defined]
    return fn


def _define(trtp: ModuleType, name: str, meta: dict, graph: GraphConsts) -> None:
    io = GRAPH_IO[name]
    pid = f"{NAMESPACE}::{name}"
    desc_t = trtp.TensorDesc
    inputs = [(n, desc_t) for n in io.input_names]
    attrs = [(a, int) for a in io.attrs]
    outs = typing.Tuple[tuple([desc_t] * len(io.outputs))]   # Tuple[TensorDesc, ...] spelled out
    ret = outs if len(io.outputs) > 1 else desc_t
    describe = _DESCRIBE[name]
    trtp.register(pid)(_with_signature(lambda a: describe(trtp, a), _signature(inputs + attrs, ret)))

    combination = io_types(name, graph)
    tune_ret = typing.List[trtp.AutoTuneCombination]
    trtp.autotune(pid)(_with_signature(lambda a: [trtp.AutoTuneCombination(combination, "LINEAR")],
                                       _signature(inputs + [("outputs", outs)], tune_ret)))

    aot_ret = typing.Tuple[typing.Union[str, bytes], typing.Union[str, bytes], trtp.KernelLaunchParams,
                           trtp.SymIntExprs]
    trtp.aot_impl(pid)(_with_signature(lambda a: _aot(trtp, name, meta, graph, a),
                                       _signature(inputs + attrs + [("outputs", outs), ("tactic", int)], aot_ret)))


def _describe_rope(trtp: ModuleType, a: dict) -> tuple:
    # in place: q is roped inside qkv, k/v land in the pool; the outputs are the inputs' buffers
    return a["qkv"].aliased(), a["k_cache"].aliased(), a["v_cache"].aliased()


def _describe_prefill(trtp: ModuleType, a: dict):
    q = a["q"]
    return trtp.from_shape_expr((q.shape_expr[0], a["num_heads"] * a["head_dim"]), dtype=q.dtype)


def _describe_w4a16(trtp: ModuleType, a: dict):
    x = a["x"]
    return trtp.from_shape_expr((x.shape_expr[0], a["weight"].shape_expr[0]), dtype=x.dtype)


# plugin -> its output descriptors from the inputs' (what @register returns)
_DESCRIBE = {"kiln_rope_kv_write": _describe_rope, "kiln_paged_prefill": _describe_prefill,
             "kiln_w4a16_gemm": _describe_w4a16}


def _aot(trtp: ModuleType, name: str, meta: dict, graph: GraphConsts, a: dict) -> tuple:
    import tensorrt as trt
    io = GRAPH_IO[name]
    got = {k: a[k] for k in io.attrs}
    want = node_attrs(name, graph)
    if got != want:   # a graph from another model, or attributes passed in another order than io.attrs
        raise VariantError(f"{name}: aot_impl got node attributes {got} (TensorRT passes them by position, "
                           f"expected in the order {', '.join(io.attrs)}); the bundle's graph has {want}")
    for (_, gname, _), takes in zip(io.inputs, io_types(name, graph).split(",")):
        if a[gname].dtype != getattr(trt.DataType, _TRT_DTYPE.get(takes, takes)):
            raise VariantError(f"{name}: input {gname} is {a[gname].dtype}, the plugin's PTX ({meta['key']}) "
                               f"takes {takes}")
    shapes = {g: [a[g].shape_expr[i] for i in range(a[g].ndim)] for g in io.input_names}

    def cdiv(x, y):
        # TensorRT's cdiv refuses two ints; a dim TensorRT knows as a constant may arrive as either
        return -(-x // y) if isinstance(x, int) and isinstance(y, int) else trtp.cdiv(x, y)
    spec = launch(meta, shapes, cdiv)
    params = trtp.KernelLaunchParams()
    params.grid_x, params.grid_y, params.grid_z = spec.grid
    params.block_x, params.block_y, params.block_z = spec.block
    params.shared_mem = spec.shared
    extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(v) for v in spec.scalars])
    return meta["entry"].encode(), meta["_ptx_bytes"], params, extra
