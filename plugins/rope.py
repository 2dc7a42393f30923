"""Triton kernel: rotary position embedding applied in place to q and k (rotate-half layout).

The cos/sin table comes from reference.rope.rope_cos_sin (computed once per model on the host, with
Llama-3 or linear scaling folded into the inverse frequencies). Reference: plugins/reference/rope.py.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import Variant, check, launch, next_pow2


@triton.jit
def _rotate(ptr, t, stride_t, stride_h, cos, sin, NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
            HALF: tl.constexpr):
    h = tl.arange(0, HEADS_PAD)
    i = tl.arange(0, HALF)
    mask = (h < NUM_HEADS)[:, None]
    p1 = ptr + t * stride_t + h[:, None] * stride_h + i[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(p1, (x1 * cos - x2 * sin).to(ptr.dtype.element_ty), mask=mask)
    tl.store(p1 + HALF, (x2 * cos + x1 * sin).to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def rope_kernel(q_ptr, k_ptr, pos_ptr, cos_sin_ptr, stride_qt, stride_qh, stride_kt, stride_kh,
                NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, Q_PAD: tl.constexpr,
                K_PAD: tl.constexpr, HALF: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    i = tl.arange(0, HALF)
    cos = tl.load(cos_sin_ptr + pos * (2 * HALF) + i)[None, :]
    sin = tl.load(cos_sin_ptr + pos * (2 * HALF) + HALF + i)[None, :]
    _rotate(q_ptr, t, stride_qt, stride_qh, cos, sin, NUM_Q_HEADS, Q_PAD, HALF)
    _rotate(k_ptr, t, stride_kt, stride_kh, cos, sin, NUM_K_HEADS, K_PAD, HALF)


def apply_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, aot=None):
    """In place. q: [T, Hq, D], k: [T, Hkv, D] (head_dim contiguous; views of a fused qkv are fine);
    positions: [T] int; cos_sin: [max_pos, 2, D/2] fp32 contiguous -> (q, k)."""
    T, Hq, D = q.shape
    check(k.shape[0] == T and k.shape[2] == D, f"apply_rope: k shape {tuple(k.shape)} vs q {tuple(q.shape)}")
    check(D % 2 == 0 and D // 2 == next_pow2(D // 2), f"apply_rope: head_dim {D} must be twice a power of two")
    check(cos_sin.dim() == 3 and cos_sin.shape[1:] == (2, D // 2) and cos_sin.is_contiguous(),
          f"apply_rope: cos_sin shape {tuple(cos_sin.shape)} must be contiguous [max_pos, 2, {D // 2}]")
    check(q.stride(-1) == 1 and k.stride(-1) == 1, "apply_rope: head_dim of q and k must be contiguous")
    if T:
        Hk = k.shape[1]
        launch(rope_kernel, (T,), (q, k, positions.long(), cos_sin, q.stride(0), q.stride(1), k.stride(0),
                                   k.stride(1)), _constexprs(Hq, Hk, D), aot=aot)
    return q, k


def _constexprs(hq: int, hk: int, head_dim: int) -> dict:
    return dict(NUM_Q_HEADS=hq, NUM_K_HEADS=hk, Q_PAD=next_pow2(hq), K_PAD=next_pow2(hk), HALF=head_dim // 2)


def aot_variants(e) -> list[Variant]:
    types = dict(q_ptr=f"*{e.act}", k_ptr=f"*{e.act}", pos_ptr="*i64", cos_sin_ptr="*fp32",
                 stride_qt="i32", stride_qh="i32", stride_kt="i32", stride_kh="i32")
    return [Variant(rope_kernel, types, _constexprs(e.num_heads, e.num_kv_heads, e.head_dim))]
