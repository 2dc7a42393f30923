"""One table: (op, implementation kind, weight format) -> function, and `get` that picks for a device.

Triton kernels on NVIDIA GPUs, PyTorch references on CPU (or anywhere on request). Entries are
"module:function" strings so that looking something up on CPU never imports a kernel module.

Ops and their call signatures (shapes on the functions themselves):
  write_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale) -> None
  paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, k_scale, v_scale) -> out
  paged_prefill(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale,
                k_scale, v_scale, tree_mask=None) -> out
  rms_norm(x, weight, eps, residual=None) -> out | (out, residual)
  rope(q, k, positions, cos_sin) -> (q, k)
  add_rms_norm_quant(x, weight, eps, residual=None, input_scale=None) -> (y | fp8 codes, new residual)
  silu_mul_quant(gate_up, input_scale=None) -> silu(gate) * up | its fp8 codes
  quantize_fp8(x, input_scale) -> fp8 codes
  rope_write_kv(qkv, positions, cos_sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads,
                k_scale, v_scale) -> q (rotated in place in qkv; k, v written to the caches)
  fp8_gemm_small_m(xq, weight, weight_scale, input_scale, out_dtype, locks=None) -> y  (M <= 16, fp8 codes in)
  linear(x, **tensors of the format: weight, weight_scale, weight_scale_2, input_scale, pre_quant_scale) -> y
"""
from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Callable

import torch

KINDS = ("triton", "torch")
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class Impl:
    target: str                                  # "module:function"
    dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES

    def load(self) -> Callable:
        module, _, name = self.target.partition(":")
        return getattr(importlib.import_module(module), name)


_REF = "plugins.reference"
REGISTRY: dict[tuple[str, str, str | None], Impl] = {
    ("write_kv", "triton", None): Impl("plugins.kv_write:write_kv"),
    ("write_kv", "torch", None): Impl(f"{_REF}.kv_cache:write_kv_ref"),
    ("paged_decode", "triton", None): Impl("plugins.paged_decode:paged_decode"),
    ("paged_decode", "torch", None): Impl(f"{_REF}.attention:paged_decode_ref"),
    ("paged_prefill", "triton", None): Impl("plugins.paged_prefill:paged_prefill"),
    ("paged_prefill", "torch", None): Impl(f"{_REF}.attention:paged_prefill_ref"),
    ("rms_norm", "triton", None): Impl("plugins.rmsnorm:rms_norm"),
    ("rms_norm", "torch", None): Impl(f"{_REF}.norm:rms_norm_ref"),
    ("rope", "triton", None): Impl("plugins.rope:apply_rope"),
    ("rope", "torch", None): Impl(f"{_REF}.rope:apply_rope_ref"),
    ("add_rms_norm_quant", "triton", None): Impl("plugins.norm_quant:add_rms_norm_quant"),
    ("add_rms_norm_quant", "torch", None): Impl(f"{_REF}.fused:add_rms_norm_quant_ref"),
    ("silu_mul_quant", "triton", None): Impl("plugins.act_quant:silu_mul_quant"),
    ("silu_mul_quant", "torch", None): Impl(f"{_REF}.fused:silu_mul_quant_ref"),
    ("quantize_fp8", "triton", None): Impl("plugins.act_quant:quantize_fp8"),
    ("quantize_fp8", "torch", None): Impl(f"{_REF}.kv_cache:quantize_fp8"),
    ("rope_write_kv", "triton", None): Impl("plugins.rope_kv:rope_write_kv"),
    ("rope_write_kv", "torch", None): Impl(f"{_REF}.fused:rope_write_kv_ref"),
    ("fp8_gemm_small_m", "triton", None): Impl("plugins.gemm_fp8_small:fp8_gemm_small_m"),
    ("fp8_gemm_small_m", "torch", None): Impl(f"{_REF}.gemm:fp8_gemm_codes_ref"),
    ("linear", "triton", "nvfp4"): Impl("plugins.linear_impls:nvfp4_triton"),
    ("linear", "torch", "nvfp4"): Impl("plugins.linear_impls:nvfp4_torch"),
    ("linear", "triton", "int4_awq"): Impl("plugins.linear_impls:int4_awq_triton"),
    ("linear", "torch", "int4_awq"): Impl("plugins.linear_impls:int4_awq_torch"),
    ("linear", "triton", "w4a8_awq"): Impl("plugins.linear_impls:w4a8_awq_triton"),
    ("linear", "torch", "w4a8_awq"): Impl("plugins.linear_impls:w4a8_awq_torch"),
    ("linear", "triton", "fp8"): Impl("plugins.linear_impls:fp8_triton"),
    ("linear", "torch", "fp8"): Impl("plugins.linear_impls:fp8_torch"),
    ("linear", "triton", "none"): Impl("plugins.linear_impls:dense"),
    ("linear", "torch", "none"): Impl("plugins.linear_impls:dense"),
}


def default_kind(device: str | torch.device) -> str:
    """Triton on an NVIDIA GPU; on CPU the reference, except under the interpreter (tests)."""
    if torch.device(device).type == "cuda":
        return "triton"
    return "triton" if os.environ.get("TRITON_INTERPRET") == "1" else "torch"


def get(op: str, device: str | torch.device, dtype: torch.dtype, fmt: str | None = None,
        kind: str | None = None) -> Callable:
    """The implementation of `op` for tensors of `dtype` on `device` (and weight format `fmt` for
    "linear"). kind: "triton" | "torch" | None (= default_kind(device))."""
    kind = kind or default_kind(device)
    if kind not in KINDS:
        raise ValueError(f"plugins.registry: kind {kind!r}; allowed: {', '.join(KINDS)}")
    ops = sorted({k[0] for k in REGISTRY})
    if op not in ops:
        raise ValueError(f"plugins.registry: unknown op {op!r}; allowed: {', '.join(ops)}")
    impl = REGISTRY.get((op, kind, fmt))
    if impl is None:
        fmts = sorted(str(k[2]) for k in REGISTRY if k[0] == op and k[1] == kind)
        raise ValueError(f"plugins.registry: no {kind} implementation of {op!r} for format {fmt!r}; "
                         f"allowed: {', '.join(fmts)}")
    if dtype not in impl.dtypes:
        raise ValueError(f"plugins.registry: {op!r} ({kind}) does not take {dtype}; "
                         f"allowed: {', '.join(str(d) for d in impl.dtypes)}")
    if kind == "triton" and torch.device(device).type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"plugins.registry: Triton kernels need an NVIDIA GPU (device {device}) or "
                         f"TRITON_INTERPRET=1; use kind='torch' on CPU")
    return impl.load()
