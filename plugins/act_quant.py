"""Triton kernels: SwiGLU's silu(gate) * up with the down GEMM's FP8 activation quantization fused in,
and a plain FP8 quantization of an activation (for inputs no other kernel writes quantized).

One launch where the unfused MLP had a silu, a multiply and a quantization (four ops); the fp8 codes
are ``value / input_scale`` rounded to nearest even and saturated, after the value was rounded to the
activation dtype as the unfused model does. Reference: plugins/reference/fused.py (silu_mul_quant_ref)
and plugins/reference/kv_cache.py (quantize_fp8).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import Variant, check, launch, next_pow2, round_to_e4m3

BLOCK_N = 1024     # columns per program on a GPU
CPU_BLOCK_N = 4096  # the interpreter pays per program


@triton.jit
def silu_mul_quant_kernel(out_ptr, gu_ptr, scale_ptr, N, stride_g, stride_o,
                          BLOCK: tl.constexpr, QUANT: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < N
    g = tl.load(gu_ptr + t * stride_g + c, mask=mask, other=0.0)
    u = tl.load(gu_ptr + t * stride_g + N + c, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)                 # F.silu: fp32 inside, rounded
    y = (s.to(tl.float32) * u.to(tl.float32)).to(g.dtype)      # the multiply in the activation dtype
    if QUANT:
        y = round_to_e4m3(tl.math.div_rn(y.to(tl.float32), tl.load(scale_ptr)))
    tl.store(out_ptr + t * stride_o + c, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def quant_fp8_kernel(out_ptr, x_ptr, scale_ptr, N, stride_x, stride_o, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < N
    x = tl.load(x_ptr + t * stride_x + c, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_o + c, round_to_e4m3(tl.math.div_rn(x, tl.load(scale_ptr))).to(out_ptr.dtype.element_ty),
             mask=mask)


def _block(n: int, device: torch.device) -> int:
    return min(BLOCK_N if device.type == "cuda" else CPU_BLOCK_N, next_pow2(n))


def silu_mul_quant(gate_up: torch.Tensor, input_scale: torch.Tensor | None = None, aot=None) -> torch.Tensor:
    """gate_up: [T, 2I] (gate | up, rows contiguous); input_scale: optional fp32 one-element tensor.
    -> silu(gate) * up [T, I] in gate_up.dtype, or its float8_e4m3fn codes of value / input_scale."""
    check(gate_up.dim() == 2 and gate_up.stride(-1) == 1 and gate_up.shape[1] % 2 == 0,
          f"silu_mul_quant: gate_up must be [T, 2I] with contiguous rows, got {tuple(gate_up.shape)}")
    T, N = gate_up.shape[0], gate_up.shape[1] // 2
    quant = input_scale is not None
    out = torch.empty(T, N, dtype=torch.float8_e4m3fn if quant else gate_up.dtype, device=gate_up.device)
    if T:
        block = _block(N, gate_up.device)
        launch(silu_mul_quant_kernel, (T, triton.cdiv(N, block)),
               (out, gate_up, input_scale.reshape(1) if quant else gate_up, N, gate_up.stride(0), out.stride(0)),
               dict(BLOCK=block, QUANT=quant), aot=aot)
    return out


def quantize_fp8(x: torch.Tensor, input_scale: torch.Tensor, aot=None) -> torch.Tensor:
    """x: [T, N] (rows contiguous) -> float8_e4m3fn codes of x / input_scale (nearest even, saturated)."""
    check(x.dim() == 2 and x.stride(-1) == 1, f"quantize_fp8: x must be [T, N] with contiguous rows, "
          f"got {tuple(x.shape)}")
    T, N = x.shape
    out = torch.empty(T, N, dtype=torch.float8_e4m3fn, device=x.device)
    if T:
        block = _block(N, x.device)
        launch(quant_fp8_kernel, (T, triton.cdiv(N, block)),
               (out, x, input_scale.reshape(1), N, x.stride(0), out.stride(0)), dict(BLOCK=block), aot=aot)
    return out


def aot_variants(e) -> list[Variant]:
    """silu * up at the intermediate size (quantized for FP8 engines), and the plain quantization of an
    FP8 engine's attention output (the O projection's input) at Hq * D."""
    out = []
    for quant in ((False, True) if e.quant_format == "fp8" else (False,)):
        types = dict(out_ptr="*fp8e4nv" if quant else f"*{e.act}", gu_ptr=f"*{e.act}",
                     scale_ptr="*fp32" if quant else f"*{e.act}", N="i32", stride_g="i32", stride_o="i32")
        out.append(Variant(silu_mul_quant_kernel, types,
                           dict(BLOCK=min(BLOCK_N, next_pow2(e.intermediate_size)), QUANT=quant)))
    if e.quant_format == "fp8":
        types = dict(out_ptr="*fp8e4nv", x_ptr=f"*{e.act}", scale_ptr="*fp32", N="i32", stride_x="i32",
                     stride_o="i32")
        out.append(Variant(quant_fp8_kernel, types, dict(BLOCK=min(BLOCK_N, next_pow2(e.num_heads * e.head_dim)))))
    return out
