"""Which compiled plugin variant a TensorRT graph needs, and how TensorRT launches it: plain Python.

`plugins.tensorrt.compile` writes each plugin variant's PTX and a .json (its key with the constexprs,
inputs / int32 scalars / outputs, block, shared memory, grid formula). A plan's plugin layer cannot
choose a variant per call as the native launcher does, so `select` picks, per plugin, the one variant
whose constexprs match the graph (`GraphConsts`: heads, head dim, KV block size, dtypes, whether the
tree-mask width can be non-zero) and refuses in one line naming the plugin, the SM and what is missing.
`launch` computes that variant's grid and int32 scalars from the plugin inputs' shapes, as the native
host wrappers (plugins/paged_prefill.py, plugins/rope_kv.py) compute them from their tensors: over
ints here (the tests compare the two), over TensorRT's symbolic shape expressions in register.py (the
same code, with TensorRT's `cdiv`). Nothing here imports tensorrt or triton.

The graph side of each plugin (`GRAPH_IO`): the ONNX node's inputs and outputs in SPECS order, each
with its graph dtype ("act" = the model's compute dtype, "kv" = the KV pool's), and the node's int
attributes. The kernel's PTX types must agree with them (an fp8 pool is FP8, the tree mask BOOL = u8).
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
}

# Triton element type -> TensorRT DataType name as AutoTuneCombination spells it ("FP32" for float32,
# "FP16" for float16, otherwise the trt.DataType member name); a bool tensor reaches a kernel as u8
TRT_TYPE = {"bf16": "BF16", "fp16": "FP16", "fp32": "FP32", "fp8e4nv": "FP8", "i32": "INT32", "i64": "INT64",
            "u8": "BOOL"}
# The grid each plugin's .json states (the part before any ';' comment) and this module implements
GRID = {"kiln_rope_kv_write": "(cdiv(num_tokens, TOKENS), 1, 1)",
        "kiln_paged_prefill": "(cdiv(max_q_len, BLOCK), B, Hkv)"}


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def graph_type(kind: str, g: GraphConsts) -> str:
    """A GRAPH_IO dtype as the TensorRT type name."""
    return TRT_TYPE[g.act] if kind == "act" else TRT_TYPE[g.kv] if kind == "kv" else kind


def want_constexprs(plugin: str, g: GraphConsts) -> dict[str, int]:
    """The constexprs the graph fixes for `plugin` (tile sizes are the compiled variant's own choice)."""
    fp8 = int(g.kv == "fp8e4nv")
    if plugin == "kiln_paged_prefill":
        group = g.num_heads // g.num_kv_heads
        return dict(NUM_KV_HEADS=g.num_kv_heads, GROUP=group, GROUP_PAD=next_pow2(group), HEAD_DIM=g.head_dim,
                    BLOCK_SIZE=g.block_size, KV_FP8=fp8, HAS_TREE=int(g.tree))
    if plugin == "kiln_rope_kv_write":
        return dict(NUM_Q_HEADS=g.num_heads, NUM_KV_HEADS=g.num_kv_heads, Q_PAD=next_pow2(g.num_heads),
                    KV_PAD=next_pow2(g.num_kv_heads), HALF=g.head_dim // 2, KV_FP8=fp8)
    raise VariantError(f"{plugin}: not a plugin this Kiln registers with TensorRT (known: {', '.join(GRAPH_IO)})")


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
        if TRT_TYPE.get(mtype.lstrip("*")) != graph_type(kind, g):
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


_LAUNCH = {"kiln_rope_kv_write": _rope, "kiln_paged_prefill": _prefill}


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


__all__ = ["GRAPH_IO", "GraphConsts", "GraphIO", "Launch", "VariantError", "io_types", "launch", "load_metas",
           "parse_key", "read_ptx", "select", "want_constexprs"]
