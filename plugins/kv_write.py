"""Triton kernel: scatter this step's K/V into the paged cache through a slot mapping.
Reference: plugins/reference/kv_cache.py (write_kv_ref)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import Variant, check, launch, next_pow2, round_to_e4m3, scale_tensor


# tokens per program: one on a GPU (plenty of programs, no wasted lanes); many in the interpreter,
# where each program costs Python time
GPU_TOKENS = 1
CPU_TOKENS = 16


@triton.jit
def kv_write_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
                    num_tokens, stride_kt, stride_kh, stride_vt, stride_vh,
                    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr,
                    TOKENS: tl.constexpr, KV_FP8: tl.constexpr):
    r = tl.arange(0, TOKENS * HEADS_PAD)          # row = token-major, head-minor
    t = tl.program_id(0) * TOKENS + r // HEADS_PAD
    h = r % HEADS_PAD
    d = tl.arange(0, HEAD_DIM)
    slot = tl.load(slot_ptr + t, mask=t < num_tokens, other=-1).to(tl.int64)
    mask = ((slot >= 0) & (h < NUM_KV_HEADS))[:, None]     # slot -1: padding, written nowhere
    # the cache is contiguous [blocks, block_size, Hkv, D]: a flat slot is one Hkv*D row
    dst = slot[:, None] * (NUM_KV_HEADS * HEAD_DIM) + h[:, None] * HEAD_DIM + d[None, :]
    k = tl.load(k_ptr + t[:, None].to(tl.int64) * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(v_ptr + t[:, None].to(tl.int64) * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    if KV_FP8:
        k = round_to_e4m3(k.to(tl.float32) / tl.load(k_scale_ptr))
        v = round_to_e4m3(v.to(tl.float32) / tl.load(v_scale_ptr))
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale=None, v_scale=None, aot=None) -> None:
    """In-place. k, v: [T, Hkv, D] (last dim contiguous); caches: contiguous
    [num_blocks, block_size, Hkv, D] of k's dtype or float8_e4m3fn (stored = x / scale);
    slot_mapping: [T] int (-1 = skip). Same semantics as reference.kv_cache.write_kv_ref."""
    T, H, D = k.shape
    check(v.shape == k.shape, f"write_kv: v shape {tuple(v.shape)} != k shape {tuple(k.shape)}")
    check(k_cache.shape[2:] == (H, D) and v_cache.shape == k_cache.shape,
          f"write_kv: cache shape {tuple(k_cache.shape)} does not hold [*, *, {H}, {D}]")
    check(k_cache.is_contiguous() and v_cache.is_contiguous(), "write_kv: caches must be contiguous")
    check(k.stride(-1) == 1 and v.stride(-1) == 1, "write_kv: k/v head_dim must be contiguous")
    check(slot_mapping.shape == (T,), f"write_kv: slot_mapping shape {tuple(slot_mapping.shape)} != ({T},)")
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if T == 0:
        return
    tokens = GPU_TOKENS if k.is_cuda else CPU_TOKENS
    args = (k, v, k_cache, v_cache, slot_mapping.long(), scale_tensor(k_scale, k.device),
            scale_tensor(v_scale, k.device), T, k.stride(0), k.stride(1), v.stride(0), v.stride(1))
    launch(kv_write_kernel, (triton.cdiv(T, tokens),), args, _constexprs(H, D, fp8, tokens), aot=aot)


def _constexprs(heads: int, head_dim: int, fp8: bool, tokens: int) -> dict:
    return dict(NUM_KV_HEADS=heads, HEAD_DIM=head_dim, HEADS_PAD=next_pow2(heads), TOKENS=tokens, KV_FP8=fp8)


def aot_variants(e) -> list[Variant]:
    """The variants an engine with shapes `e` (common.EngineShapes) launches."""
    types = dict(k_ptr=f"*{e.act}", v_ptr=f"*{e.act}", k_cache_ptr=f"*{e.kv}", v_cache_ptr=f"*{e.kv}",
                 slot_ptr="*i64", k_scale_ptr="*fp32", v_scale_ptr="*fp32", num_tokens="i32",
                 stride_kt="i32", stride_kh="i32", stride_vt="i32", stride_vh="i32")
    return [Variant(kv_write_kernel, types, _constexprs(e.num_kv_heads, e.head_dim, e.kv == "fp8e4nv", GPU_TOKENS))]
