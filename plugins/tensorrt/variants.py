"""Which compiled plugin variant a TensorRT graph needs, and how TensorRT launches it: plain Python.

`plugins.tensorrt.compile` writes each plugin variant's PTX and a .json (its key with the constexprs,
inputs / int32 scalars / outputs, block, shared memory, grid formula). A plan's plugin layer cannot
choose a variant per call as the native launcher does, so `select` picks, per plugin, the one variant
whose constexprs match the graph (`GraphConsts`: heads, head dim, KV block size, dtypes, whether the
tree-mask width can be non-zero, the 4-bit format and group size) and refuses in one line naming the
plugin, the SM and what is missing. `launch` computes that variant's grid and int32 scalars from the
plugin inputs' shapes, as the native host wrappers (plugins/paged_prefill.py, plugins/rope_kv.py,
plugins/gemm_w4a16.py) compute them from their tensors: over ints here (the tests compare the two),
over TensorRT's symbolic shape expressions in register.py (the same code, with TensorRT's `cdiv`).
Nothing here imports tensorrt or triton.

The graph side of each plugin (`GRAPH_IO`): the ONNX node's inputs and outputs in SPECS order, each
with its graph dtype ("act" = the model's compute dtype, "kv" = the KV pool's, "w4_scale*" = the 4-bit
format's scales, `W4A16`), and the node's int attributes. The kernel's PTX types must agree with them
(an fp8 pool is FP8, the tree mask BOOL = u8, the packed 4-bit weight UINT8 = u8).
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence


class VariantError(ValueError):
    """No usable plugin variant (or a bundle file that does not fit this runtime); one line."""


@dataclass(frozen=True)
class GraphConsts:
    """What the decoder graph fixes for its plugin nodes (built from the bundle's manifest by the caller:
    plugins never read engine.json)."""
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int     # KV block size (engine.kv_block_size)
    act: str            # the model's compute dtype as a Triton name: bf16 | fp16 | fp32
    kv: str             # the KV pool's element type: act or fp8e4nv
    tree: bool          # the tree-mask width can be > 0 (speculative verification steps)
    w4a16: str | None = None        # the format of the graph's packed 4-bit linears (a W4A16 key), or None
    group_size: int | None = None   # int4_awq's quantization.group_size (nvfp4's blocks are always 16)


@dataclass(frozen=True)
class W4A16Format:
    """A 4-bit weight format as the W4A16 GEMM plugin node takes it."""
    fmt: int                 # the kernel's FMT constexpr = the node's `fmt` attribute (plugins/gemm_w4a16.py)
    scale: str               # weight_scale's graph dtype
    scale_2: str             # weight_scale_2's
    group: int | None        # the scale group along K; None: the bundle's quantization.group_size


# int4_awq has no second scale: the graph feeds weight_scale there again, as the native wrapper does
W4A16 = {"int4_awq": W4A16Format(0, "act", "act", None), "nvfp4": W4A16Format(1, "FP8", "FP32", 16)}


def w4a16_of(g: GraphConsts) -> tuple[W4A16Format, int]:
    """The graph's 4-bit format and its scale group size, or VariantError when it has none."""
    w = W4A16.get(g.w4a16 or "")
    group = (w.group or g.group_size) if w else None
    if w is None or not group:
        raise VariantError(f"kiln_w4a16_gemm: the graph's 4-bit format is {g.w4a16!r} (group size "
                           f"{g.group_size}); the plugin takes {', '.join(W4A16)} with a group size")
    return w, group


@dataclass(frozen=True)
class GraphIO:
    inputs: tuple[tuple[str, str, str], ...]    # (kernel parameter, graph name, graph dtype)
    outputs: tuple[tuple[str, str, str], ...]
    # the node's int attributes in the order the ONNX node stores them (onnx.helper sorts them by name):
    # TensorRT passes every attribute to aot_impl by position, in that order
    attrs: tuple[str, ...] = ("head_dim", "num_heads", "num_kv_heads")

    @property
    def input_names(self) -> list[str]:
        return [g for _, g, _ in self.inputs]


GRAPH_IO: dict[str, GraphIO] = {
    "kiln_rope_kv_write": GraphIO(
        (("qkv_in_ptr", "qkv", "act"), ("k_cache_in_ptr", "k_cache", "kv"), ("v_cache_in_ptr", "v_cache", "kv"),
         ("pos_ptr", "positions", "INT64"), ("slot_ptr", "slot_mapping", "INT64"), ("cos_sin_ptr", "cos_sin", "FP32"),
         ("k_scale_ptr", "k_scale", "FP32"), ("v_scale_ptr", "v_scale", "FP32")),
        (("qkv_ptr", "qkv_out", "act"), ("k_cache_ptr", "k_cache_out", "kv"), ("v_cache_ptr", "v_cache_out", "kv"))),
    "kiln_paged_prefill": GraphIO(
        (("q_ptr", "q", "act"), ("k_cache_ptr", "k_cache", "kv"), ("v_cache_ptr", "v_cache", "kv"),
         ("block_tables_ptr", "block_tables", "INT32"), ("query_start_ptr", "query_start_loc", "INT32"),
         ("context_lens_ptr", "context_lens", "INT32"), ("tree_mask_ptr", "tree_mask", "BOOL"),
         ("k_scale_ptr", "k_scale", "FP32"), ("v_scale_ptr", "v_scale", "FP32"), ("sm_scale_ptr", "sm_scale", "FP32")),
        (("out_ptr", "out", "act"),)),
    "kiln_w4a16_gemm": GraphIO(
        (("x_ptr", "x", "act"), ("w_ptr", "weight", "UINT8"), ("ws_ptr", "weight_scale", "w4_scale"),
         ("ws2_ptr", "weight_scale_2", "w4_scale_2")), (("out_ptr", "out", "act"),), attrs=("fmt", "group_size")),
}

# Triton element type -> TensorRT DataType name as AutoTuneCombination spells it ("FP32" for float32,
# "FP16" for float16, otherwise the trt.DataType member name); a bool tensor reaches a kernel as u8
TRT_TYPE = {"bf16": "BF16", "fp16": "FP16", "fp32": "FP32", "fp8e4nv": "FP8", "i32": "INT32", "i64": "INT64",
            "u8": "BOOL"}
# a PTX pointer type the graph may bind to more than one TensorRT type (u8: a bool mask, packed nibbles)
PTX_TAKES = {"u8": ("BOOL", "UINT8")}
# The grid each plugin's .json states (the part before any ';' comment) and this module implements
GRID = {"kiln_rope_kv_write": "(cdiv(num_tokens, TOKENS), 1, 1)",
        "kiln_paged_prefill": "(cdiv(max_q_len, BLOCK), B, Hkv)",
        "kiln_w4a16_gemm": "(cdiv(M, BLOCK_M), cdiv(N, BLOCK_N), 1)"}


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


# the GRAPH_IO dtypes that depend on the graph (the rest are TensorRT type names already)
_KINDS: dict[str, Callable[[GraphConsts], str]] = {
    "act": lambda g: TRT_TYPE[g.act], "kv": lambda g: TRT_TYPE[g.kv],
    "w4_scale": lambda g: graph_type(w4a16_of(g)[0].scale, g),
    "w4_scale_2": lambda g: graph_type(w4a16_of(g)[0].scale_2, g)}


def graph_type(kind: str, g: GraphConsts) -> str:
    """A GRAPH_IO dtype as the TensorRT type name."""
    return _KINDS[kind](g) if kind in _KINDS else kind


def ptx_takes(ptx_type: str) -> tuple[str, ...]:
    """The TensorRT types a kernel parameter of Triton type `ptx_type` (``*bf16``) can be bound to."""
    t = ptx_type.lstrip("*")
    return PTX_TAKES.get(t, (TRT_TYPE.get(t, t),))


def _heads(g: GraphConsts) -> dict[str, int]:
    return {"head_dim": g.head_dim, "num_heads": g.num_heads, "num_kv_heads": g.num_kv_heads}


def _w4a16_attrs(g: GraphConsts) -> dict[str, int]:
    w, group = w4a16_of(g)
    return {"fmt": w.fmt, "group_size": group}


# plugin -> the node attributes (GraphIO.attrs) the graph gives it
_ATTRS: dict[str, Callable[[GraphConsts], dict[str, int]]] = {
    "kiln_rope_kv_write": _heads, "kiln_paged_prefill": _heads, "kiln_w4a16_gemm": _w4a16_attrs}


def node_attrs(plugin: str, g: GraphConsts) -> dict[str, int]:
    """The int attributes of the graph's `plugin` nodes, by name (what aot_impl must receive)."""
    return _ATTRS[plugin](g)


def _want_prefill(g: GraphConsts) -> dict[str, int]:
    group = g.num_heads // g.num_kv_heads
    return dict(NUM_KV_HEADS=g.num_kv_heads, GROUP=group, GROUP_PAD=next_pow2(group), HEAD_DIM=g.head_dim,
                BLOCK_SIZE=g.block_size, KV_FP8=int(g.kv == "fp8e4nv"), HAS_TREE=int(g.tree))


def _want_rope(g: GraphConsts) -> dict[str, int]:
    return dict(NUM_Q_HEADS=g.num_heads, NUM_KV_HEADS=g.num_kv_heads, Q_PAD=next_pow2(g.num_heads),
                KV_PAD=next_pow2(g.num_kv_heads), HALF=g.head_dim // 2, KV_FP8=int(g.kv == "fp8e4nv"))


def _want_w4a16(g: GraphConsts) -> dict[str, int]:
    # one launch per node: the unsplit variant (convention.spec_for never makes the split-K one a plugin)
    a = _w4a16_attrs(g)
    return dict(FMT=a["fmt"], GROUP=a["group_size"], SPLIT=0)


_WANT: dict[str, Callable[[GraphConsts], dict[str, int]]] = {
    "kiln_paged_prefill": _want_prefill, "kiln_rope_kv_write": _want_rope, "kiln_w4a16_gemm": _want_w4a16}


def want_constexprs(plugin: str, g: GraphConsts) -> dict[str, int]:
    """The constexprs the graph fixes for `plugin` (tile sizes are the compiled variant's own choice)."""
    if plugin not in _WANT:
        raise VariantError(f"{plugin}: not a plugin this Kiln registers with TensorRT (known: {', '.join(GRAPH_IO)})")
    return _WANT[plugin](g)


_KEY = re.compile(r"^(\w+)\[(.*)\]w(\d+)s(\d+)$")


def parse_key(key: str) -> dict[str, Any]:
    """The constexprs of a variant key (`plugins.common.variant_key`): name[K=v,...]w<warps>s<stages>."""
    m = _KEY.match(key)
    if m is None:
        raise VariantError(f"variant key {key!r} is not name[K=v,...]wNsM")
    out: dict[str, Any] = {}
    for item in filter(None, m.group(2).split(",")):
        k, _, v = item.partition("=")
        try:
            out[k] = int(v)
        except ValueError:
            out[k] = float(v)     # a baked-in float (EPS)
    return out


def load_metas(plugins_dir: str | Path, sm: int) -> list[dict]:
    """Every plugin .json under `plugins_dir`/sm<sm> (empty when the bundle has none for that SM)."""
    folder = Path(plugins_dir) / f"sm{sm}"
    metas = []
    for f in sorted(folder.glob("*.json")) if folder.is_dir() else ():
        try:
            meta = json.loads(f.read_text())
        except ValueError as exc:
            raise VariantError(f"{f}: not JSON ({exc}); rebuild the bundle's TensorRT plugins") from None
        missing = [k for k in ("plugin", "key", "entry", "inputs", "scalars", "outputs", "block", "shared", "grid",
                               "sha256") if k not in meta]
        if missing:
            raise VariantError(f"{f}: no {', '.join(missing)}; rebuild the bundle's TensorRT plugins")
        metas.append(dict(meta, _ptx=str(f.with_suffix(".ptx"))))
    return metas


def _type_mismatches(meta: dict, g: GraphConsts) -> list[str]:
    """Where the variant's PTX types differ from the graph's dtypes (unused inputs aside)."""
    io = GRAPH_IO[meta["plugin"]]
    bad = []
    for (param, gname, kind), (mname, mtype) in zip(io.inputs + io.outputs, meta["inputs"] + meta["outputs"]):
        if param != mname:
            return [f"parameter {mname} where this Kiln expects {param} (rebuild the plugins)"]
        if param in meta.get("unused_inputs", ()):
            continue
        if graph_type(kind, g) not in ptx_takes(mtype):
            bad.append(f"{gname} {mtype}")
    if len(meta["inputs"]) + len(meta["outputs"]) != len(io.inputs) + len(io.outputs):
        bad.append(f"{len(meta['inputs'])} inputs + {len(meta['outputs'])} outputs")
    return bad


def select(metas: list[dict], plugin: str, sm: int, g: GraphConsts) -> dict:
    """The one compiled variant of `plugin` for `sm` that the graph `g` can launch."""
    want = want_constexprs(plugin, g)
    fits, why = [], []
    for m in (m for m in metas if m["plugin"] == plugin):
        cx = parse_key(m["key"])
        diff = [f"{k}={cx.get(k)}" for k, v in want.items() if cx.get(k) != v] + _type_mismatches(m, g)
        if diff:
            why.append(f"{m['key']} has {', '.join(diff)}")
        else:
            fits.append(m)
    need = ", ".join(f"{k}={v}" for k, v in want.items())
    if len(fits) == 1:
        return fits[0]
    if fits:
        raise VariantError(f"{plugin} for sm_{sm}: {len(fits)} compiled variants fit ({need}): "
                           f"{', '.join(m['key'] for m in fits)}; rebuild the bundle's TensorRT plugins")
    found = "; ".join(why) if why else "no variant of it"
    raise VariantError(f"{plugin} for sm_{sm}: no compiled variant with {need} ({g.act} activations, {g.kv} KV); "
                       f"the bundle has {found}; rebuild with: make build OVERRIDES=\"tensorrt.enabled=true\" "
                       f"(graph and plugins from one build, engine.target_sms including {sm})")


def read_ptx(meta: dict) -> bytes:
    """The variant's PTX, checked against the sha256 its .json recorded."""
    path = Path(meta["_ptx"])
    if not path.is_file():
        raise VariantError(f"{path}: missing; rebuild the bundle's TensorRT plugins")
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != meta["sha256"]:
        raise VariantError(f"{path}: sha256 differs from its .json; rebuild the bundle's TensorRT plugins")
    return data


# ---- the launch, from the plugin inputs' shapes -------------------------------------------------

Dim = Any   # an int, or TensorRT's symbolic ShapeExpr (register.py)


def int_cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Launch:
    grid: tuple[Dim, Dim, Dim]
    block: tuple[int, int, int]
    shared: int
    scalars: tuple[Dim, ...]       # in the kernel's (the .json's "scalars") order


def _rope(cx: dict, s: dict[str, Sequence[Dim]], cdiv: Callable) -> tuple[tuple, dict]:
    t, width = s["qkv"][0], s["qkv"][1]          # qkv rows are contiguous: stride_t is the row width
    return (cdiv(t, cx["TOKENS"]), 1, 1), {"num_tokens": t, "stride_t": width}


def _prefill(cx: dict, s: dict[str, Sequence[Dim]], cdiv: Callable) -> tuple[tuple, dict]:
    # q is the whole roped qkv [T, (Hq + 2 Hkv) D]: its heads are read through strides (row width, D);
    # out is [T, Hq D] contiguous; the tree mask [T, W] (W = 0 without a tree: the stride the native
    # wrapper passes then too). Dim 0 of the grid covers every token, not just the longest query:
    # TensorRT knows only shapes, and the programs past a sequence's queries exit at once.
    d, hkv = cx["HEAD_DIM"], cx["NUM_KV_HEADS"]
    hq = cx["GROUP"] * hkv
    scalars = {"stride_qt": s["q"][1], "stride_qh": d, "stride_ot": hq * d, "stride_oh": d,
               "stride_bt": s["block_tables"][1], "stride_tm": s["tree_mask"][1]}
    return (cdiv(s["q"][0], cx["BLOCK"]), s["context_lens"][0], hkv), scalars


def _w4a16(cx: dict, s: dict[str, Sequence[Dim]], cdiv: Callable) -> tuple[tuple, dict]:
    # x [M, K] and out [M, N] are contiguous; the packed weight [N, K/2] and its scales [N, K/group] are
    # whole initializers. Unsplit: the one K slice is K in whole BLOCK_K tiles, as the native wrapper sets it.
    m, k, n = s["x"][0], s["x"][1], s["weight"][0]
    scalars = {"M": m, "N": n, "K": k, "k_per_split": cdiv(k, cx["BLOCK_K"]) * cx["BLOCK_K"], "stride_xm": k,
               "stride_om": n, "stride_wn": s["weight"][1], "stride_sn": s["weight_scale"][1]}
    return (cdiv(m, cx["BLOCK_M"]), cdiv(n, cx["BLOCK_N"]), 1), scalars


_LAUNCH = {"kiln_rope_kv_write": _rope, "kiln_paged_prefill": _prefill, "kiln_w4a16_gemm": _w4a16}


def _constant(x: Dim) -> int | None:
    if isinstance(x, int):
        return x
    if getattr(x, "is_constant", False):
        return int(x.constant_value())
    return None


def launch(meta: dict, shapes: dict[str, Sequence[Dim]], cdiv: Callable = int_cdiv) -> Launch:
    """Grid, block, shared memory and int32 scalars of variant `meta` for plugin inputs of `shapes`
    (graph input name -> dims). `cdiv` is TensorRT's for symbolic dims; plain ints by default."""
    plugin = meta["plugin"]
    formula = meta["grid"].split(";")[0].strip()
    if GRID.get(plugin) != formula:
        raise VariantError(f"{plugin}: the bundle's grid {formula!r} is not the one this runtime launches "
                           f"({GRID.get(plugin)!r}); rebuild the bundle's TensorRT plugins with this Kiln")
    grid, scalars = _LAUNCH[plugin](parse_key(meta["key"]), shapes, cdiv)
    if set(scalars) != set(meta["scalars"]):
        raise VariantError(f"{plugin}: the kernel takes scalars {meta['scalars']}, this runtime computes "
                           f"{sorted(scalars)}; rebuild the bundle's TensorRT plugins with this Kiln")
    for name in meta.get("divisible", ()):
        value = _constant(scalars[name])
        if value is not None and value % 16:
            raise VariantError(f"{plugin}: {name}={value} but the PTX was compiled for a multiple of 16")
    block = tuple(int(b) for b in meta["block"])
    return Launch(grid, (block[0], block[1], block[2]), int(meta["shared"]), tuple(scalars[n] for n in meta["scalars"]))


def io_types(plugin: str, g: GraphConsts) -> str:
    """The one type combination of the plugin's inputs then outputs (AutoTuneCombination's io_types)."""
    io = GRAPH_IO[plugin]
    return ",".join(graph_type(kind, g) for _, _, kind in io.inputs + io.outputs)


__all__ = ["GRAPH_IO", "W4A16", "GraphConsts", "GraphIO", "Launch", "VariantError", "W4A16Format", "io_types",
           "launch", "load_metas", "node_attrs", "parse_key", "ptx_takes", "read_ptx", "select", "w4a16_of",
           "want_constexprs"]
