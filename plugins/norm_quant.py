"""Triton kernel: residual add + RMSNorm + the next GEMM's FP8 activation quantization, one pass.

Reads x and the residual once, writes the new residual and the normed row, as the fp8 codes the FP8
GEMM takes (``y / input_scale``, round-to-nearest-even, saturated) when a scale is given: one launch
where the unfused layer had an add, a norm (five ops) and a quantization (four ops).
Reference: plugins/reference/fused.py (add_rms_norm_quant_ref).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import Variant, check, launch, next_pow2, round_to_e4m3


@triton.jit
def add_rms_norm_quant_kernel(out_ptr, res_out_ptr, x_ptr, res_ptr, w_ptr, scale_ptr, eps,
                              stride_x, stride_r, stride_o, stride_ro,
                              HIDDEN: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                              QUANT: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    mask = c < HIDDEN
    x = tl.load(x_ptr + t * stride_x + c, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # the sum is rounded to the activation dtype first, as the unfused model does
        x = (x.to(tl.float32) + tl.load(res_ptr + t * stride_r + c, mask=mask, other=0.0).to(tl.float32))
        x = x.to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + t * stride_ro + c, x, mask=mask)
    h = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(h * h, 0) / HIDDEN + eps)
    y = (h * inv).to(x.dtype).to(tl.float32) * tl.load(w_ptr + c, mask=mask, other=0.0).to(tl.float32)
    y = y.to(x.dtype)
    if QUANT:
        # the interpreter's f32 -> fp8 cast is wrong: round by hand, the cast is then exact
        y = round_to_e4m3(tl.math.div_rn(y.to(tl.float32), tl.load(scale_ptr)))
    tl.store(out_ptr + t * stride_o + c, y.to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                       input_scale: torch.Tensor | None = None, aot=None):
    """x: [T, H] (rows contiguous); weight: [H]; residual: optional [T, H]; input_scale: optional fp32
    one-element tensor. -> (y, new_residual): y [T, H] in x.dtype, or float8_e4m3fn codes of
    y / input_scale; new_residual = x + residual (x itself without a residual, nothing written)."""
    check(x.dim() == 2 and x.stride(-1) == 1, f"add_rms_norm_quant: x must be [T, H] with contiguous rows, "
          f"got {tuple(x.shape)}")
    T, H = x.shape
    check(weight.shape == (H,), f"add_rms_norm_quant: weight shape {tuple(weight.shape)} != ({H},)")
    check(residual is None or (residual.shape == x.shape and residual.stride(-1) == 1),
          f"add_rms_norm_quant: residual shape {None if residual is None else tuple(residual.shape)} "
          f"!= {tuple(x.shape)}")
    quant = input_scale is not None
    out = torch.empty(T, H, dtype=torch.float8_e4m3fn if quant else x.dtype, device=x.device)
    res_out = torch.empty_like(x) if residual is not None else x
    if T:
        r = residual if residual is not None else x
        scale = input_scale.reshape(1) if quant else weight
        launch(add_rms_norm_quant_kernel, (T,),
               (out, res_out, x, r, weight, scale, float(eps), x.stride(0), r.stride(0), out.stride(0),
                res_out.stride(0)),
               _constexprs(H, residual is not None, quant), num_warps=_warps(H), aot=aot)
    return out, res_out


def _warps(hidden: int) -> int:
    return 4 if hidden <= 4096 else 8


def _constexprs(hidden: int, residual: bool, quant: bool) -> dict:
    return dict(HIDDEN=hidden, BLOCK=next_pow2(hidden), HAS_RESIDUAL=residual, QUANT=quant)


def aot_variants(e) -> list[Variant]:
    """With and without the residual add; quantizing for FP8 engines (whose final norm does not)."""
    out = []
    for quant in ((False, True) if e.quant_format == "fp8" else (False,)):
        types = dict(out_ptr="*fp8e4nv" if quant else f"*{e.act}", res_out_ptr=f"*{e.act}", x_ptr=f"*{e.act}",
                     res_ptr=f"*{e.act}", w_ptr=f"*{e.act}", scale_ptr="*fp32" if quant else f"*{e.act}",
                     eps="fp32", stride_x="i32", stride_r="i32", stride_o="i32", stride_ro="i32")
        out += [Variant(add_rms_norm_quant_kernel, types, _constexprs(e.hidden_size, r, quant),
                        num_warps=_warps(e.hidden_size)) for r in (False, True)]
    return out
