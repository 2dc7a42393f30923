"""One table: (op, implementation kind, weight format) -> function, and `get` that picks for a device.

Triton kernels on NVIDIA GPUs, PyTorch references on CPU (or anywhere on request), and Kiln's CPU C
kernels (plugins/cpu) as the "cpu" kind. Entries are "module:function" strings so that looking
something up on CPU never imports a kernel module. Every kernel the runtime launches is chosen here:
the model, the linears, the CPU matmul and the attention backends ask this table (``get``, ``load``,
``fused_layer_kernels``, ``expert_kernel``) rather than importing a kernel themselves.

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
  fused_moe(x, topk_ids, topk_weights, gate_up, down, gate_up_scale=None, down_scale=None) -> out
            (SwiGLU experts on the model's routing; layouts in plugins/reference/moe.py)
  linear(x, **tensors of the format: weight, weight_scale, weight_scale_2, input_scale, pre_quant_scale) -> y
The "cpu" kind's ops take float32 CPU tensors and return None (False for write_kv_fp8) where they do
not apply (no compiler, another dtype or layout): the caller then runs its PyTorch ops, same numbers.
  add_rms_norm(x, delta, weight, eps, scale=None) -> (x + delta, its RMSNorm, fake-quantized by scale)
  rope_tables(x, cos, sin) -> x rotated by the step's cos/sin tables
  fake_quant_fp8(x, scale) -> x through fp8 and back;  mul_fake_quant_fp8(a, b, scale) -> a * b likewise
  write_kv_fp8(k, v, k_cache, v_cache, slots, k_scale, v_scale) -> written
  paged_attention(q, k_cache, v_cache, block_tables, rows, tree, scale) -> out
  panel_pack(w) -> (panels, fmt);  panel_unpack(panels, fmt, n) -> w;  panel_gemm(x, panels, fmt, n, scale) -> y
The CPU GEMMs PyTorch ships (plugins/cpu/vendor.py) are rows of the same kind: a CPU linear's storage
and matmul (backend/ops/cpu_matmul.py) follow which of them this machine has (``available``).
  onednn_linear(x, w_column_major, bias, "none", [], "") -> y
  fp16_pack(w, None) -> packed;  fp16_gemm(x, packed) -> y;  fp16_unpack(packed) -> (w, bias)
"""
from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Callable

import torch

KINDS = ("triton", "torch", "cpu")
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class Impl:
    target: str                                  # "module:function"
    dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES
    # "module:function" answering whether this machine runs it (a CPU without AVX-512, a PyTorch
    # build without FBGEMM); None: wherever its kind runs
    available: str | None = None

    def load(self) -> Callable:
        return _resolve(self.target)

    def runs_here(self) -> bool:
        return self.available is None or bool(_resolve(self.available)())


def _resolve(target: str):
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


_REF = "plugins.reference"
_F32 = (torch.float32,)
_AVX512 = "plugins.cpu.gemm:available"
_VENDOR = "plugins.cpu.vendor"
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
    ("fused_moe", "triton", None): Impl("plugins.fused_moe:fused_moe"),
    ("fused_moe", "torch", None): Impl(f"{_REF}.moe:moe_ref"),
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
    # Kiln's CPU C kernels (plugins/cpu): float32 only
    ("add_rms_norm", "cpu", None): Impl("plugins.cpu.ops:add_rms_norm", _F32),
    ("rope_tables", "cpu", None): Impl("plugins.cpu.ops:rope", _F32),
    ("fake_quant_fp8", "cpu", None): Impl("plugins.cpu.ops:fake_quant_fp8", _F32),
    ("mul_fake_quant_fp8", "cpu", None): Impl("plugins.cpu.ops:mul_fake_quant_fp8", _F32),
    ("write_kv_fp8", "cpu", None): Impl("plugins.cpu.ops:write_kv_fp8", _F32),
    ("paged_attention", "cpu", None): Impl("plugins.cpu.ops:paged_attention", _F32),
    ("panel_pack", "cpu", None): Impl("plugins.cpu.gemm:pack", _F32, _AVX512),
    ("panel_unpack", "cpu", None): Impl("plugins.cpu.gemm:unpack", _F32, _AVX512),
    ("panel_gemm", "cpu", None): Impl("plugins.cpu.gemm:gemm", _F32, _AVX512),
    # PyTorch's own CPU GEMMs (plugins/cpu/vendor.py)
    ("onednn_linear", "cpu", None): Impl(f"{_VENDOR}:onednn_linear", _F32, f"{_VENDOR}:onednn_available"),
    ("fp16_pack", "cpu", None): Impl(f"{_VENDOR}:fp16_pack", _F32, f"{_VENDOR}:fbgemm_available"),
    ("fp16_gemm", "cpu", None): Impl(f"{_VENDOR}:fp16_gemm", _F32, f"{_VENDOR}:fbgemm_available"),
    ("fp16_unpack", "cpu", None): Impl(f"{_VENDOR}:fp16_unpack", _F32, f"{_VENDOR}:fbgemm_available"),
}
# The kinds whose kernels run a decoder layer fused (norm + quant, activation + quant, rope + KV
# write): what the model's fused forward needs. The reference kind keeps the plain ops, whose
# numbers the CPU path is tested against bit for bit.
FUSED_LAYER_OPS = ("add_rms_norm_quant", "silu_mul_quant", "rope_write_kv",
                   # Gemma 3's layer: its post norms (no residual) and the GELU output's fp8 codes
                   "rms_norm", "quantize_fp8")
FUSED_LAYER_KINDS = ("triton",)
# The kinds whose fused_moe runs a model's expert layers; elsewhere the model's per-expert loop over the
# dense path's linears (backend/model/moe.py: on CPU, batch-invariant and held to transformers).
EXPERT_KERNEL_KINDS = ("triton",)


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
    if kind == "cpu" and torch.device(device).type != "cpu":
        raise ValueError(f"plugins.registry: the cpu kind's kernels run on the CPU only (device {device}); "
                         f"allowed there: {', '.join(k for k in KINDS if k != 'cpu')}")
    return impl.load()


def load(op: str, kind: str, fmt: str | None = None) -> Callable:
    """The table's implementation of ``op`` for ``kind``, loaded, for a module that binds one kind's
    kernels once (an attention backend, the CPU paths); ``get`` checks the device and dtype of a call."""
    impl = REGISTRY.get((op, kind, fmt))
    if impl is None:
        have = sorted(f"{o} ({k}, {f})" for o, k, f in REGISTRY if o == op)
        raise ValueError(f"plugins.registry: no {kind} implementation of {op!r} for format {fmt!r}; "
                         f"allowed: {', '.join(have) or 'none'}")
    return impl.load()


def available(op: str, kind: str, fmt: str | None = None) -> bool:
    """Whether this machine runs the table's ``op`` for ``kind`` (False for no such row)."""
    impl = REGISTRY.get((op, kind, fmt))
    return impl is not None and impl.runs_here()


def load_if_available(op: str, kind: str, fmt: str | None = None) -> Callable | None:
    """``load``, or None where this machine does not run it (``available``)."""
    return load(op, kind, fmt) if available(op, kind, fmt) else None


def expert_kernel(kind: str, device: str | torch.device, dtype: torch.dtype) -> Callable | None:
    """The fused expert kernel (fused_moe) for an expert layer under an attention backend of ``kind`` (its
    registry kind): Triton's on an NVIDIA GPU whatever the backend, or where ``kind`` has it (the triton
    backend under the interpreter); None: the model's own per-expert loop."""
    if torch.device(device).type == "cuda":
        kind = "triton"
    if kind not in EXPERT_KERNEL_KINDS:
        return None
    return get("fused_moe", device, dtype, kind=kind)


def fused_layer_kernels(kind: str, device: str | torch.device, dtype: torch.dtype) -> dict[str, Callable] | None:
    """The kernels of a fused decoder layer for an attention backend of ``kind`` (its registry kind),
    or None where that kind runs the plain layer."""
    if kind not in FUSED_LAYER_KINDS:
        return None
    return {op: get(op, device, dtype, kind=kind) for op in FUSED_LAYER_OPS}
