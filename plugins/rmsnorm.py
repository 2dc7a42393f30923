"""Triton kernel: RMSNorm with an optional fused residual add (one read of x and residual, one write
of each output instead of three passes). Reference: plugins/reference/norm.py (rms_norm_ref)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import Variant, check, launch, next_pow2


@triton.jit
def rms_norm_kernel(out_ptr, res_out_ptr, x_ptr, res_ptr, w_ptr, eps,
                    stride_x, stride_r, stride_o, stride_ro,
                    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
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
    y = (h * inv).to(out_ptr.dtype.element_ty).to(tl.float32) * tl.load(w_ptr + c, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_o + c, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, aot=None):
    """x: [T, H] (rows contiguous); weight: [H]; residual: optional [T, H].
    -> normalized [T, H], or (normalized(x + residual), x + residual) with a residual; dtype of x."""
    check(x.dim() == 2 and x.stride(-1) == 1, f"rms_norm: x must be [T, H] with contiguous rows, got {tuple(x.shape)}")
    T, H = x.shape
    check(weight.shape == (H,), f"rms_norm: weight shape {tuple(weight.shape)} != ({H},)")
    check(residual is None or (residual.shape == x.shape and residual.stride(-1) == 1),
          f"rms_norm: residual shape {None if residual is None else tuple(residual.shape)} != {tuple(x.shape)}")
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else out
    if T:
        r = residual if residual is not None else x
        launch(rms_norm_kernel, (T,), (out, res_out, x, r, weight, float(eps), x.stride(0), r.stride(0),
                                       out.stride(0), res_out.stride(0)),
               _constexprs(H, residual is not None), num_warps=_warps(H), aot=aot)
    return out if residual is None else (out, res_out)


def _warps(hidden: int) -> int:
    return 4 if hidden <= 4096 else 8


def _constexprs(hidden: int, residual: bool) -> dict:
    return dict(HIDDEN=hidden, BLOCK=next_pow2(hidden), HAS_RESIDUAL=residual)


def aot_variants(e) -> list[Variant]:
    """With and without the fused residual add, at the model's hidden size."""
    types = dict(out_ptr=f"*{e.act}", res_out_ptr=f"*{e.act}", x_ptr=f"*{e.act}", res_ptr=f"*{e.act}",
                 w_ptr=f"*{e.act}", eps="fp32", stride_x="i32", stride_r="i32", stride_o="i32", stride_ro="i32")
    return [Variant(rms_norm_kernel, types, _constexprs(e.hidden_size, r), num_warps=_warps(e.hidden_size))
            for r in (False, True)]
