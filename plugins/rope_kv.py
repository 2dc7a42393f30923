"""Triton kernel: rotary embedding of q and k read straight from the fused qkv GEMM output, with the
rotated k and v written into the paged KV cache (bf16/fp16/fp32 or fp8 with per-layer scales).

One launch where the unfused layer had the RoPE of q and k (about ten ops) and the KV write: q is
rotated in place inside qkv (attention reads it from there), k and v go to the cache only (attention
reads keys from the cache). The rotated k is rounded to the activation dtype before the fp8
quantization, as the unfused model does. Reference: plugins/reference/fused.py (rope_write_kv_ref).

Models with q/k norms (Qwen3, Gemma 3: an RMSNorm over each head's q and k before rope) fuse them here
too (rope_kv_norm_write_kernel): the head's sum of squares is taken over its two halves in registers,
so the normed q and k never leave the kernel. The roundings are the models' own: Qwen3's norm rounds
x_normed to the activation dtype before * w, Gemma 3's multiplies by (1 + w) in fp32 and rounds once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import Variant, check, launch, next_pow2, round_to_e4m3, scale_tensor

# q/k norm forms (EngineShapes.qk_norm) -> the kernel's QK_NORM constexpr
QK_NORMS = {"none": 0, "rms": 1, "rms_1p": 2}

GPU_TOKENS = 1     # tokens per program (as in kv_write: many in the interpreter, where programs cost Python time)
CPU_TOKENS = 16


@triton.jit
def _half_rows(qkv_ptr, pos_ptr, cos_sin_ptr, t, tmask, h, head0, stride_t, HALF: tl.constexpr):
    """Pointers to the first halves of rows (token t, head head0 + h), and their cos/sin."""
    i = tl.arange(0, HALF)
    pos = tl.load(pos_ptr + t, mask=tmask, other=0).to(tl.int64)
    cs = cos_sin_ptr + pos[:, None] * (2 * HALF) + i[None, :]
    p = qkv_ptr + t[:, None].to(tl.int64) * stride_t + (head0 + h)[:, None] * (2 * HALF) + i[None, :]
    return p, tl.load(cs), tl.load(cs + HALF)


@triton.jit
def _head_rms_norm(x1, x2, w_ptr, eps, i, ty, HALF: tl.constexpr, QK_NORM: tl.constexpr):
    """RMSNorm of each row's head (halves x1 | x2, fp32 [rows, HALF]) with weight w: QK_NORM 1 rounds
    x_normed to `ty` before * w (Qwen3RMSNorm), 2 takes x_normed * (1 + w) in fp32 (Gemma3RMSNorm);
    -> the halves rounded to `ty`, back in fp32 for the rotation."""
    inv = 1.0 / tl.sqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)
    w1 = tl.load(w_ptr + i).to(tl.float32)[None, :]
    w2 = tl.load(w_ptr + HALF + i).to(tl.float32)[None, :]
    y1 = x1 * inv[:, None]
    y2 = x2 * inv[:, None]
    if QK_NORM == 2:
        y1 = (y1 * (1.0 + w1)).to(ty)
        y2 = (y2 * (1.0 + w2)).to(ty)
    else:
        y1 = (y1.to(ty).to(tl.float32) * w1).to(ty)
        y2 = (y2.to(ty).to(tl.float32) * w2).to(ty)
    return y1.to(tl.float32), y2.to(tl.float32)


@triton.jit
def _rope_kv_program(qkv_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, slot_ptr, cos_sin_ptr, k_scale_ptr, v_scale_ptr,
                     q_norm_ptr, k_norm_ptr, eps, num_tokens, stride_t,
                     NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, Q_PAD: tl.constexpr,
                     KV_PAD: tl.constexpr, HALF: tl.constexpr, TOKENS: tl.constexpr, KV_FP8: tl.constexpr,
                     QK_NORM: tl.constexpr):
    """One program's tokens; QK_NORM = 0 (the kernel without norms) compiles to the code it had before."""
    pid = tl.program_id(0)
    i = tl.arange(0, HALF)
    # q: rotated in place (rows token-major, head-minor)
    r = tl.arange(0, TOKENS * Q_PAD)
    t = pid * TOKENS + r // Q_PAD
    h = r % Q_PAD
    tmask = t < num_tokens
    p, cos, sin = _half_rows(qkv_ptr, pos_ptr, cos_sin_ptr, t, tmask, h, 0, stride_t, HALF)
    mask = (tmask & (h < NUM_Q_HEADS))[:, None]
    x1 = tl.load(p, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p + HALF, mask=mask, other=0.0).to(tl.float32)
    if QK_NORM:
        x1, x2 = _head_rms_norm(x1, x2, q_norm_ptr, eps, i, qkv_ptr.dtype.element_ty, HALF, QK_NORM)
    tl.store(p, (x1 * cos - x2 * sin).to(qkv_ptr.dtype.element_ty), mask=mask)
    tl.store(p + HALF, (x2 * cos + x1 * sin).to(qkv_ptr.dtype.element_ty), mask=mask)
    # k (rotated) and v into the cache at the token's slot; slot -1 (padding) is written nowhere
    r = tl.arange(0, TOKENS * KV_PAD)
    t = pid * TOKENS + r // KV_PAD
    h = r % KV_PAD
    tmask = t < num_tokens
    slot = tl.load(slot_ptr + t, mask=tmask, other=-1).to(tl.int64)
    mask = ((slot >= 0) & (h < NUM_KV_HEADS))[:, None]
    p, cos, sin = _half_rows(qkv_ptr, pos_ptr, cos_sin_ptr, t, tmask, h, NUM_Q_HEADS, stride_t, HALF)
    k1 = tl.load(p, mask=mask, other=0.0).to(tl.float32)
    k2 = tl.load(p + HALF, mask=mask, other=0.0).to(tl.float32)
    if QK_NORM:
        k1, k2 = _head_rms_norm(k1, k2, k_norm_ptr, eps, i, qkv_ptr.dtype.element_ty, HALF, QK_NORM)
    k1, k2 = (k1 * cos - k2 * sin).to(qkv_ptr.dtype.element_ty), (k2 * cos + k1 * sin).to(qkv_ptr.dtype.element_ty)
    vp = p + NUM_KV_HEADS * (2 * HALF)
    v1 = tl.load(vp, mask=mask, other=0.0)
    v2 = tl.load(vp + HALF, mask=mask, other=0.0)
    if KV_FP8:
        ks, vs = tl.load(k_scale_ptr), tl.load(v_scale_ptr)
        k1 = round_to_e4m3(tl.math.div_rn(k1.to(tl.float32), ks))
        k2 = round_to_e4m3(tl.math.div_rn(k2.to(tl.float32), ks))
        v1 = round_to_e4m3(tl.math.div_rn(v1.to(tl.float32), vs))
        v2 = round_to_e4m3(tl.math.div_rn(v2.to(tl.float32), vs))
    # the cache is contiguous [blocks, block_size, Hkv, D]: a flat slot is one Hkv*D row
    dst = slot[:, None] * (NUM_KV_HEADS * 2 * HALF) + h[:, None] * (2 * HALF) + i[None, :]
    ty = k_cache_ptr.dtype.element_ty
    tl.store(k_cache_ptr + dst, k1.to(ty), mask=mask)
    tl.store(k_cache_ptr + dst + HALF, k2.to(ty), mask=mask)
    tl.store(v_cache_ptr + dst, v1.to(ty), mask=mask)
    tl.store(v_cache_ptr + dst + HALF, v2.to(ty), mask=mask)


@triton.jit
def rope_kv_write_kernel(qkv_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, slot_ptr, cos_sin_ptr, k_scale_ptr,
                         v_scale_ptr, num_tokens, stride_t,
                         NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, Q_PAD: tl.constexpr,
                         KV_PAD: tl.constexpr, HALF: tl.constexpr, TOKENS: tl.constexpr, KV_FP8: tl.constexpr):
    # no norms: their pointers are never read (qkv stands in), eps is unused
    _rope_kv_program(qkv_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, slot_ptr, cos_sin_ptr, k_scale_ptr, v_scale_ptr,
                     qkv_ptr, qkv_ptr, 0.0, num_tokens, stride_t, NUM_Q_HEADS, NUM_KV_HEADS, Q_PAD, KV_PAD, HALF,
                     TOKENS, KV_FP8, 0)


@triton.jit
def rope_kv_norm_write_kernel(qkv_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, slot_ptr, cos_sin_ptr, k_scale_ptr,
                              v_scale_ptr, q_norm_ptr, k_norm_ptr, eps, num_tokens, stride_t,
                              NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, Q_PAD: tl.constexpr,
                              KV_PAD: tl.constexpr, HALF: tl.constexpr, TOKENS: tl.constexpr,
                              KV_FP8: tl.constexpr, QK_NORM: tl.constexpr):
    """q/k RMSNorm (weights [head_dim], QK_NORM 1: * w, 2: * (1 + w)) before the rotation."""
    _rope_kv_program(qkv_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, slot_ptr, cos_sin_ptr, k_scale_ptr, v_scale_ptr,
                     q_norm_ptr, k_norm_ptr, eps, num_tokens, stride_t, NUM_Q_HEADS, NUM_KV_HEADS, Q_PAD, KV_PAD,
                     HALF, TOKENS, KV_FP8, QK_NORM)


def rope_write_kv(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int,
                  k_scale=None, v_scale=None, aot=None, q_norm: torch.Tensor | None = None,
                  k_norm: torch.Tensor | None = None, eps: float = 1e-6, qk_norm: str = "rms") -> torch.Tensor:
    """qkv: [T, (Hq + 2 Hkv) D] (q | k | v, rows contiguous); positions: [T] int; cos_sin: [max_pos, 2, D/2]
    fp32 contiguous (reference.rope.rope_cos_sin); caches: contiguous [num_blocks, block_size, Hkv, D] of
    qkv's dtype or float8_e4m3fn (stored = x / scale); slot_mapping: [T] int (-1 = skip).
    q_norm / k_norm: optional [D] weights of the q and k RMS norms (both or neither), applied with `eps`
    before the rotation in the form `qk_norm`: "rms" (x_normed * w) or "rms_1p" (x_normed * (1 + w)).
    Rotates q in place, writes rotated k and v to the caches -> q as a [T, Hq, D] view of qkv."""
    check(qkv.dim() == 2 and qkv.stride(-1) == 1, f"rope_write_kv: qkv must be [T, C] with contiguous rows, "
          f"got {tuple(qkv.shape)}")
    T, C = qkv.shape
    check(C % (num_heads + 2 * num_kv_heads) == 0, f"rope_write_kv: qkv width {C} is not (Hq + 2 Hkv) * D "
          f"for Hq={num_heads}, Hkv={num_kv_heads}")
    D = C // (num_heads + 2 * num_kv_heads)
    check(D % 2 == 0 and D // 2 == next_pow2(D // 2), f"rope_write_kv: head_dim {D} must be twice a power of two")
    check(cos_sin.dim() == 3 and cos_sin.shape[1:] == (2, D // 2) and cos_sin.is_contiguous(),
          f"rope_write_kv: cos_sin shape {tuple(cos_sin.shape)} must be contiguous [max_pos, 2, {D // 2}]")
    check(k_cache.shape[2:] == (num_kv_heads, D) and v_cache.shape == k_cache.shape,
          f"rope_write_kv: cache shape {tuple(k_cache.shape)} does not hold [*, *, {num_kv_heads}, {D}]")
    check(k_cache.is_contiguous() and v_cache.is_contiguous(), "rope_write_kv: caches must be contiguous")
    check(positions.shape == (T,) and slot_mapping.shape == (T,),
          f"rope_write_kv: positions {tuple(positions.shape)} / slot_mapping {tuple(slot_mapping.shape)} != ({T},)")
    normed = q_norm is not None or k_norm is not None
    if normed:
        check(q_norm is not None and k_norm is not None, "rope_write_kv: q_norm and k_norm go together (got one)")
        check(q_norm.shape == (D,) and k_norm.shape == (D,) and q_norm.is_contiguous() and k_norm.is_contiguous(),
              f"rope_write_kv: q_norm {tuple(q_norm.shape)} / k_norm {tuple(k_norm.shape)} must be contiguous ({D},)")
        check(qk_norm in QK_NORMS and qk_norm != "none",
              f"rope_write_kv: qk_norm {qk_norm!r}; allowed: rms, rms_1p")
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if T:
        tokens = GPU_TOKENS if qkv.is_cuda else CPU_TOKENS
        scales = (scale_tensor(k_scale, qkv.device), scale_tensor(v_scale, qkv.device))
        head = (qkv, k_cache, v_cache, positions, slot_mapping, cos_sin) + scales
        cx = _constexprs(num_heads, num_kv_heads, D, fp8, tokens)
        if normed:
            launch(rope_kv_norm_write_kernel, (triton.cdiv(T, tokens),),
                   head + (q_norm, k_norm, float(eps), T, qkv.stride(0)), dict(cx, QK_NORM=QK_NORMS[qk_norm]),
                   aot=aot)
        else:
            launch(rope_kv_write_kernel, (triton.cdiv(T, tokens),), head + (T, qkv.stride(0)), cx, aot=aot)
    return qkv[:, :num_heads * D].view(T, num_heads, D)


def _constexprs(hq: int, hkv: int, head_dim: int, fp8: bool, tokens: int) -> dict:
    return dict(NUM_Q_HEADS=hq, NUM_KV_HEADS=hkv, Q_PAD=next_pow2(hq), KV_PAD=next_pow2(hkv), HALF=head_dim // 2,
                TOKENS=tokens, KV_FP8=fp8)


def aot_variants(e) -> list[Variant]:
    """The kernel an engine launches: with its q/k norms fused when the model has them."""
    types = dict(qkv_ptr=f"*{e.act}", k_cache_ptr=f"*{e.kv}", v_cache_ptr=f"*{e.kv}", pos_ptr="*i64",
                 slot_ptr="*i64", cos_sin_ptr="*fp32", k_scale_ptr="*fp32", v_scale_ptr="*fp32",
                 num_tokens="i32", stride_t="i32")
    cx = _constexprs(e.num_heads, e.num_kv_heads, e.head_dim, e.kv == "fp8e4nv", GPU_TOKENS)
    if e.qk_norm == "none":
        return [Variant(rope_kv_write_kernel, types, cx)]
    # the norm weights are the model's (activation dtype)
    types.update(q_norm_ptr=f"*{e.act}", k_norm_ptr=f"*{e.act}", eps="fp32")
    return [Variant(rope_kv_norm_write_kernel, types, dict(cx, QK_NORM=QK_NORMS[e.qk_norm]))]
