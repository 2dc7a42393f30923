"""TensorRT signatures of the kernel variants Kiln's plan needs, and their compile into checked PTX.

For each kernel a TensorRT plugin would launch (paged attention decode + split + reduction, varlen
prefill with and without the EAGLE tree mask, rope + paged KV write, W4A16 GEMM, fused add + RMSNorm
(+ FP8 quant)), `SPECS` says which parameters are input tensors, which are int32 scalars (TensorRT
extra args, computed from shapes), which are outputs, which float scalars are baked in as constexprs
(`TrtFloats`: RMSNorm's eps, from the bundle's model config), which are fp32[1] inputs instead (the
softmax scale: kernels.py says why), which outputs alias an input (in place), and which inputs a
variant never reads (the graph feeds a 1-element constant there). `trt_plan(shapes, floats)`
maps `plugins.aot.plan(shapes)` onto them, so the variants are the native ones with the same
constexprs; `compile_trt(tv, sm)` compiles the TensorRT-order wrapper (plugins/tensorrt/kernels.py),
refuses a variant that needs scratch memory, strips Triton's scratch pointers and checks the entry.
Kernels with no spec (kv_write, rope, plain rms_norm, the FP8 GEMMs, act quant) are not plugins here:
the fused kernels above replace them, or TensorRT has a layer for them.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Callable

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from .. import aot
from ..common import EngineShapes, Variant, variant_key
from . import kernels as K
from .ptx import ConventionError, check_entry, entry_params, strip_scratch

TRITON_SCRATCH_PARAMS = 2   # global scratch, profile scratch (Triton 3.7)


@dataclass(frozen=True)
class TrtFloats:
    """The float scalars baked into the PTX as constexprs, from the bundle's model config. (The softmax
    scale is not one: it is an fp32[1] input, `sm_scale_ptr`, whose value the graph holds.)"""
    rms_eps: float


def _never(cx: dict) -> tuple[str, ...]:
    return ()


@dataclass(frozen=True)
class TrtSpec:
    plugin: str                       # plugin name (ONNX op type)
    wrapper: object                   # @triton.jit in TensorRT order (kernels.py)
    inputs: tuple[str, ...]
    scalars: tuple[str, ...]
    outputs: tuple[str, ...]
    floats: dict = field(default_factory=dict)       # wrapper constexpr -> TrtFloats field
    extra_types: dict = field(default_factory=dict)  # inputs the native kernel has not (float scalars as tensors)
    aliases: dict = field(default_factory=dict)      # output -> the input it aliases (in place)
    unused: Callable[[dict], tuple[str, ...]] = _never   # inputs a variant with these constexprs never reads
    grid: str = ""                    # what the plugin's KernelLaunchParams grid is, in the kernel's terms

    @property
    def params(self) -> tuple[str, ...]:
        return self.inputs + self.scalars + self.outputs


_DECODE_IN = ("q_ptr", "k_cache_ptr", "v_cache_ptr", "block_tables_ptr", "seq_lens_ptr", "k_scale_ptr", "v_scale_ptr")
_PREFILL_IN = ("q_ptr", "k_cache_ptr", "v_cache_ptr", "block_tables_ptr", "query_start_ptr", "context_lens_ptr",
               "tree_mask_ptr", "k_scale_ptr", "v_scale_ptr", "sm_scale_ptr")
SM_SCALE_INPUT = {"sm_scale_ptr": "*fp32"}   # fp32[1]: the value the native kernels take as an argument
SCALAR_INPUTS = {"sm_scale_ptr"}             # 1-element inputs: never assumed 16-byte aligned

SPECS = {
    "paged_decode": TrtSpec(
        "kiln_paged_decode", K.trt_paged_decode, _DECODE_IN + ("out_scale_ptr", "sm_scale_ptr"),
        ("stride_qb", "stride_qh", "stride_ob", "stride_oh", "stride_bt", "tokens_per_split", "num_splits"),
        ("out_ptr",), extra_types=SM_SCALE_INPUT,
        unused=lambda cx: () if cx["OUT_FP8"] else ("out_scale_ptr",),
        grid="(Hkv, B, 1) if HEADS_FIRST else (B, Hkv, 1)"),
    "paged_decode_split": TrtSpec(
        "kiln_paged_decode_split", K.trt_paged_decode_split, _DECODE_IN + ("sm_scale_ptr",),
        ("stride_qb", "stride_qh", "stride_bt", "tokens_per_split", "num_splits"),
        ("part_acc_ptr", "part_ml_ptr"), extra_types=SM_SCALE_INPUT,
        grid="(Hkv, B, num_splits) if HEADS_FIRST else (B, Hkv, num_splits)"),
    "paged_decode_reduce": TrtSpec(
        "kiln_paged_decode_reduce", K.trt_paged_decode_reduce,
        ("part_acc_ptr", "part_ml_ptr", "act_ptr", "out_scale_ptr"), ("stride_ob", "stride_oh", "num_splits"),
        ("out_ptr",), unused=lambda cx: () if cx["OUT_FP8"] else ("act_ptr", "out_scale_ptr"), grid="(B, Hq, 1)"),
    "paged_prefill": TrtSpec(
        "kiln_paged_prefill", K.trt_paged_prefill, _PREFILL_IN,
        ("stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_bt", "stride_tm"), ("out_ptr",),
        extra_types=SM_SCALE_INPUT, unused=lambda cx: () if cx["HAS_TREE"] else ("tree_mask_ptr",),
        grid="(cdiv(max_q_len, BLOCK), B, Hkv); programs past a sequence's queries exit, so TensorRT may "
             "size dim 0 from the token count"),
    "rope_kv_write": TrtSpec(
        "kiln_rope_kv_write", K.trt_rope_kv_write,
        ("qkv_in_ptr", "k_cache_in_ptr", "v_cache_in_ptr", "pos_ptr", "slot_ptr", "cos_sin_ptr", "k_scale_ptr",
         "v_scale_ptr"), ("num_tokens", "stride_t"), ("qkv_ptr", "k_cache_ptr", "v_cache_ptr"),
        aliases={"qkv_ptr": "qkv_in_ptr", "k_cache_ptr": "k_cache_in_ptr", "v_cache_ptr": "v_cache_in_ptr"},
        unused=lambda cx: ("qkv_in_ptr", "k_cache_in_ptr", "v_cache_in_ptr"),   # read through the aliases
        grid="(cdiv(num_tokens, TOKENS), 1, 1)"),
    "w4a16_gemm": TrtSpec(
        "kiln_w4a16_gemm", K.trt_w4a16_gemm, ("x_ptr", "w_ptr", "ws_ptr", "ws2_ptr"),
        ("M", "N", "K", "k_per_split", "stride_xm", "stride_om", "stride_wn", "stride_sn"), ("out_ptr",),
        unused=lambda cx: () if cx["FMT"] == 1 else ("ws2_ptr",), grid="(cdiv(M, BLOCK_M), cdiv(N, BLOCK_N), 1)"),
    "add_rms_norm_quant": TrtSpec(
        "kiln_add_rms_norm_quant", K.trt_add_rms_norm_quant, ("x_ptr", "res_ptr", "w_ptr", "scale_ptr"),
        ("stride_x", "stride_r", "stride_o", "stride_ro"), ("out_ptr", "res_out_ptr"), floats={"EPS": "rms_eps"},
        unused=lambda cx: () if cx["QUANT"] else ("scale_ptr",), grid="(num_tokens, 1, 1)"),
    "rms_norm_quant": TrtSpec(
        "kiln_rms_norm_quant", K.trt_rms_norm_quant, ("x_ptr", "w_ptr", "scale_ptr"), ("stride_x", "stride_o"),
        ("out_ptr",), floats={"EPS": "rms_eps"}, unused=lambda cx: () if cx["QUANT"] else ("scale_ptr",),
        grid="(num_tokens, 1, 1)"),
}


def spec_for(v: Variant) -> TrtSpec | None:
    """The plugin that launches native variant `v`, or None when it is not a TensorRT plugin here."""
    name, cx = v.fn.__name__, v.constexprs
    if name == "paged_decode_kernel":
        return SPECS["paged_decode_split" if cx["SPLIT"] else "paged_decode"]
    if name == "paged_decode_reduce_kernel":
        return SPECS["paged_decode_reduce"]
    if name == "paged_prefill_kernel":
        return SPECS["paged_prefill"]
    if name == "rope_kv_write_kernel":
        return SPECS["rope_kv_write"]
    if name == "w4a16_gemm_kernel":
        # split-K sums fp32 partials in the host wrapper: one launch cannot; the unsplit variant is
        # always planned beside it (gemm_w4a16.aot_variants), so the plugin uses that one
        return None if cx["SPLIT"] else SPECS["w4a16_gemm"]
    if name == "add_rms_norm_quant_kernel":
        return SPECS["add_rms_norm_quant" if cx["HAS_RESIDUAL"] else "rms_norm_quant"]
    return None


@dataclass(frozen=True)
class TrtVariant:
    spec: TrtSpec
    native: Variant
    types: dict          # TensorRT-order parameter -> Triton type
    constexprs: dict     # the native constexprs + the baked-in floats

    @property
    def key(self) -> str:
        return variant_key(self.spec.wrapper.__name__, self.constexprs, self.native.num_warps, self.native.num_stages)


def trt_variant(spec: TrtSpec, v: Variant, floats: TrtFloats) -> TrtVariant:
    names = list(spec.wrapper.arg_names)
    assert tuple(names[:len(spec.params)]) == spec.params, f"{spec.plugin}: spec and wrapper disagree"
    native = v.types
    types = {p: native[p] if p in native else spec.extra_types.get(p) or native[_alias_target(spec, p)]
             for p in spec.params}
    for p in spec.scalars:
        if types[p] != "i32":   # TensorRT's extra args are int32 SymExprs: a float is a constexpr or input
            raise ConventionError(f"{v.key}: scalar {p} is {types[p]}; TensorRT passes only int32 scalars")
    cx = dict(v.constexprs, **{c: getattr(floats, f) for c, f in spec.floats.items()})
    missing = set(names[len(spec.params):]) - set(cx)
    assert not missing, f"{spec.plugin}: constexprs {missing} not set by {v.key}"
    return TrtVariant(spec, v, types, {n: cx[n] for n in names[len(spec.params):]})


def _alias_target(spec: TrtSpec, inp: str) -> str:
    """The output an in-place input aliases (its type is the native parameter's)."""
    return next(o for o, i in spec.aliases.items() if i == inp)


def trt_plan(shapes: EngineShapes, floats: TrtFloats) -> list[TrtVariant]:
    """The TensorRT-convention variants of every planned kernel that a plugin launches (stable order)."""
    out: dict[str, TrtVariant] = {}
    for v in aot.plan(shapes):
        spec = spec_for(v)
        if spec is not None:
            tv = trt_variant(spec, v, floats)
            out.setdefault(tv.key, tv)
    return list(out.values())


@dataclass(frozen=True)
class TrtKernel:
    ptx: str
    meta: dict


def compile_trt(tv: TrtVariant, sm: int) -> TrtKernel:
    """Compile `tv` for `sm` into PTX that declares exactly TensorRT's arguments, or raise
    ConventionError naming the kernel (scratch memory needed, clusters, or an entry that does not fit)."""
    spec = tv.spec
    sig = dict(tv.types, **{n: "constexpr" for n in tv.constexprs})
    aligned = set(aot.aligned_params(sig)) - SCALAR_INPUTS
    divisible = set(tv.native.divisible) & set(spec.scalars)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(sig) if n in aligned or n in divisible}
    try:
        k = triton.compile(ASTSource(spec.wrapper, sig, tv.constexprs, attrs), target=GPUTarget("cuda", sm, 32),
                           options={"num_warps": tv.native.num_warps, "num_stages": tv.native.num_stages})
    except Exception as exc:  # triton raises many types; the variant and SM are what the user needs
        raise ConventionError(f"TensorRT compile of {tv.key} for sm_{sm} failed: {exc}") from exc
    kernel = finish(tv, sm, k.asm["ptx"], k.metadata)
    # what the compile assumed and the plugin must guarantee at run time (the native launcher checks
    # it per call; TensorRT cannot): 16-byte aligned data pointers, integer args multiples of 16
    kernel.meta.update(aligned=sorted(aligned), divisible=sorted(divisible))
    return kernel


def finish(tv: TrtVariant, sm: int, ptx: str, md) -> TrtKernel:
    """Checks on a compiled variant (split from compile_trt so tests can feed it any PTX/metadata)."""
    where = f"{tv.key} for sm_{sm}"
    for kind in ("global", "profile"):
        size = getattr(md, f"{kind}_scratch_size", 0) or 0
        if size:
            raise ConventionError(f"{where}: needs {size} bytes of {kind} scratch memory; "
                                  f"TensorRT passes no scratch pointer")
    if getattr(md, "num_ctas", 1) != 1:
        raise ConventionError(f"{where}: num_ctas={md.num_ctas}; TensorRT's launch params have no cluster dims")
    spec = tv.spec
    entry, raw = entry_params(ptx, md.name)
    if len(raw) != len(spec.params) + TRITON_SCRATCH_PARAMS:
        raise ConventionError(f"{where}: compiled entry has {len(raw)} parameters, expected {len(spec.params)} "
                              f"+ {TRITON_SCRATCH_PARAMS} Triton scratch pointers")
    trt_ptx = strip_scratch(ptx, entry, TRITON_SCRATCH_PARAMS)
    params = check_entry(trt_ptx, entry, len(spec.inputs), len(spec.scalars), len(spec.outputs), list(spec.params))
    unused = spec.unused(tv.constexprs)
    meta = {
        "plugin": spec.plugin, "key": tv.key, "native_key": tv.native.key, "entry": entry, "sm": sm,
        "inputs": [[n, tv.types[n]] for n in spec.inputs], "scalars": list(spec.scalars),
        "outputs": [[n, tv.types[n]] for n in spec.outputs], "aliases": dict(spec.aliases),
        "unused_inputs": list(unused),
        "floats": {c: tv.constexprs[c] for c in spec.floats},
        "block": [md.num_warps * 32, 1, 1], "shared": md.shared, "grid": spec.grid,
        "ptx_param_types": [p.kind for p in params], "stripped_params": [p.name for p in raw[len(params):]],
        "sha256": hashlib.sha256(trt_ptx.encode()).hexdigest(), "triton_version": triton.__version__,
    }
    return TrtKernel(trt_ptx, meta)
