"""Triton kernels: paged attention for decode (one query token per sequence), flash-decoding style.

Each program takes one (sequence, KV head, split) and all the query heads that share that KV head
(GQA), so K/V are read once per group; the group is padded to 16 rows for tl.dot. Long contexts are
split along the sequence into `num_splits` programs whose partial results (unnormalized output,
running max, running sum) are merged by a second, small reduction kernel, which walks the splits
REDUCE_CHUNK at a time (so up to MAX_SPLITS splits: batch 1 at long context can fill every SM). The
split choice, the partials' store and the reduction live in plugins/decode_splits.py.

FP8 KV: the codes are converted to q's dtype in registers (e4m3 is exact in bf16/fp16; no fp32 copy of
the tile unless q itself is fp32), and each scale is applied once: K's folded into the softmax scale
(one multiply per score), V's to the accumulator after the loop (one multiply per output element of
the program, not per cached element).

Sliding windows (paged_decode_window_kernel): the key loop starts in the block of the window's first key,
so the work is bounded by the window and freed blocks before it are never read.
Reference: plugins/reference/attention.py (paged_decode_ref).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import tuning
from .common import Variant, check, launch, next_pow2, scale_tensor
# the split-K half lives beside it; re-exported, as callers (tests, benches, TensorRT wrappers) import it here
from .decode_splits import (MAX_SPLITS, REDUCE_CHUNK, REDUCE_DIVISIBLE, TILE_N, _decode_store,  # noqa: F401
                            _reduce_constexprs, choose_splits, paged_decode_reduce_kernel, split_sequence)


def _cfg(fp8: bool) -> dict:
    """The launch configuration (plugins.tuning); the interpreter runs the GPU's too, so the CPU tests
    exercise the variants a bundle compiles."""
    return tuning.get("paged_decode_fp8" if fp8 else "paged_decode")


@triton.jit
def _decode_program(out_ptr, part_acc_ptr, part_ml_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr,
                    seq_lens_ptr, k_scale_ptr, v_scale_ptr, out_scale_ptr, sm_scale, stride_qb, stride_qh, stride_ob,
                    stride_oh, stride_bt, tokens_per_split, num_splits, window,
                    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
                    KV_FP8: tl.constexpr, SPLIT: tl.constexpr, OUT_FP8: tl.constexpr,
                    DOT_F16: tl.constexpr, HEADS_FIRST: tl.constexpr, V_U16: tl.constexpr, WINDOW: tl.constexpr):
    """One (sequence, KV head, split) program; the two entry kernels below differ only in WINDOW (a
    constexpr, so the full-attention kernel compiles to exactly the code it had before windows)."""
    # HEADS_FIRST: the KV heads of one sequence are neighbours in launch order, so the programs running
    # together read adjacent 128-byte pieces of the same cache rows (one row = all heads of a token)
    if HEADS_FIRST:
        kvh = tl.program_id(0)
        b = tl.program_id(1)
    else:
        b = tl.program_id(0)
        kvh = tl.program_id(1)
    sp = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    ALIGN: tl.constexpr = TILE if TILE < BLOCK_SIZE else BLOCK_SIZE
    if WINDOW:
        # the query (position seq_len - 1) sees keys in (seq_len - 1 - window, seq_len - 1]: from lo on.
        # The splits start at `base`, lo rounded down to a multiple of min(TILE, BLOCK_SIZE): inside lo's
        # block, so the loop never touches a block wholly before the window (freed blocks: stale or -1
        # table entries), and inside the first tile, so no tile is wholly masked (its max would be -inf)
        lo = tl.maximum(seq_len - window, 0)
        base = lo - lo % ALIGN
    else:
        base = 0
    start = base + sp * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    qh = kvh * GROUP + g
    gmask = g < GROUP
    q = tl.load(q_ptr + b * stride_qb + qh[:, None] * stride_qh + d[None, :], mask=gmask[:, None], other=0.0)
    # fold the fp8 K scale into the softmax scale: one multiply per score instead of per element, and
    # log2(e) too, so the softmax runs on exp2 (what the hardware computes; exp is exp2 of a product)
    qk_scale = sm_scale * tl.load(k_scale_ptr) * 1.4426950408889634
    if DOT_F16:
        # e4m3 -> fp16 is one instruction per two codes; e4m3 -> bf16 goes through fp16 and adds one
        # conversion per code (the kernel's largest instruction count in its sm_90 SASS). The dots
        # then run in fp16: q is scaled by sm_scale first (|q| * sm_scale stays far inside fp16's range),
        # K and V codes are exact in fp16, and P in [0, 1] is finer in fp16 than in bf16.
        q = (q.to(tl.float32) * sm_scale).to(tl.float16)
        qk_scale = tl.load(k_scale_ptr) * 1.4426950408889634

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    row = NUM_KV_HEADS * HEAD_DIM
    HALF: tl.constexpr = HEAD_DIM // 2
    if V_U16:
        # V read as 16-bit words (two e4m3 codes: dims 2j and 2j+1) and multiplied as two halves, even and
        # odd dims: the P.V product contracts over tokens, the strided axis, and Triton transposes 8-bit
        # tiles in shared memory one byte per load (LDS.U8, one per element); 16-bit words transpose with
        # ldmatrix. Each code c becomes the fp16 with bits (c & 0x80) << 8 | (c & 0x7f) << 7, which is
        # exactly c / 256 (e4m3's exponent bias is 7, fp16's 15; subnormals land on fp16 subnormals), so
        # the 256 joins V's scale after the loop.
        vw_ptr = v_cache_ptr.to(tl.pointer_type(tl.uint16))
        j = tl.arange(0, HALF)
        acc_e = tl.zeros([GROUP_PAD, HALF], tl.float32)
        acc_o = tl.zeros([GROUP_PAD, HALF], tl.float32)
    else:
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for t0 in range(start, end, TILE):
        tok = t0 + tl.arange(0, TILE)
        tmask = tok < end
        if WINDOW:
            tmask = tmask & (tok >= lo)
        page = tl.load(block_tables_ptr + b * stride_bt + tok // BLOCK_SIZE, mask=tmask, other=0)
        slot = page.to(tl.int64) * BLOCK_SIZE + tok % BLOCK_SIZE
        off = slot[:, None] * row + kvh * HEAD_DIM + d[None, :]
        k = tl.load(k_cache_ptr + off, mask=tmask[:, None], other=0.0)
        if KV_FP8:   # e4m3 -> the dot's dtype in registers (exact); the scales come once, outside this loop
            k = k.to(q.dtype)
        # fp32 engines (used to check against references) keep IEEE fp32 dots instead of tf32
        if q.dtype == tl.float32:
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        else:
            s = tl.dot(q, tl.trans(k)) * qk_scale
        s = tl.where(tmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)   # scores are in log2 units (qk_scale holds log2(e))
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if V_U16:
            w = tl.load(vw_ptr + slot[:, None] * (row // 2) + kvh * HALF + j[None, :], mask=tmask[:, None], other=0)
            v_even = (((w << 7) & 0x3F80) | ((w << 8) & 0x8000)).to(tl.float16, bitcast=True)
            v_odd = (((w >> 1) & 0x3F80) | (w & 0x8000)).to(tl.float16, bitcast=True)
            p16 = p.to(tl.float16)
            acc_e = acc_e * alpha[:, None] + tl.dot(p16, v_even)
            acc_o = acc_o * alpha[:, None] + tl.dot(p16, v_odd)
        else:
            v = tl.load(v_cache_ptr + off, mask=tmask[:, None], other=0.0)
            if KV_FP8:
                v = v.to(q.dtype)
            if v.dtype == tl.float32:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    # V's scale: once per output element (sum_t p_t * vs * v_t = vs * sum_t p_t * v_t)
    if V_U16:
        vs = tl.load(v_scale_ptr) * 256.0
        _decode_store(acc_e * vs, m_i, l_i, 2 * j, q_ptr, out_ptr, part_acc_ptr, part_ml_ptr, out_scale_ptr, b, qh,
                      gmask, sp, num_splits, stride_ob, stride_oh, True, NUM_KV_HEADS * GROUP, HEAD_DIM, SPLIT, OUT_FP8)
        _decode_store(acc_o * vs, m_i, l_i, 2 * j + 1, q_ptr, out_ptr, part_acc_ptr, part_ml_ptr, out_scale_ptr, b,
                      qh, gmask, sp, num_splits, stride_ob, stride_oh, False, NUM_KV_HEADS * GROUP, HEAD_DIM, SPLIT,
                      OUT_FP8)
    else:
        _decode_store(acc * tl.load(v_scale_ptr), m_i, l_i, d, q_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
                      out_scale_ptr, b, qh, gmask, sp, num_splits, stride_ob, stride_oh, True,
                      NUM_KV_HEADS * GROUP, HEAD_DIM, SPLIT, OUT_FP8)


@triton.jit
def paged_decode_kernel(out_ptr, part_acc_ptr, part_ml_ptr,
                        q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
                        k_scale_ptr, v_scale_ptr, out_scale_ptr, sm_scale,
                        stride_qb, stride_qh, stride_ob, stride_oh, stride_bt,
                        tokens_per_split, num_splits,
                        NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                        HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
                        KV_FP8: tl.constexpr, SPLIT: tl.constexpr, OUT_FP8: tl.constexpr,
                        DOT_F16: tl.constexpr = False, HEADS_FIRST: tl.constexpr = False,
                        V_U16: tl.constexpr = False):
    _decode_program(out_ptr, part_acc_ptr, part_ml_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr,
                    seq_lens_ptr, k_scale_ptr, v_scale_ptr, out_scale_ptr, sm_scale, stride_qb, stride_qh, stride_ob,
                    stride_oh, stride_bt, tokens_per_split, num_splits, 0, NUM_KV_HEADS, GROUP, GROUP_PAD, HEAD_DIM,
                    BLOCK_SIZE, TILE, KV_FP8, SPLIT, OUT_FP8, DOT_F16, HEADS_FIRST, V_U16, False)


@triton.jit
def paged_decode_window_kernel(out_ptr, part_acc_ptr, part_ml_ptr,
                               q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
                               k_scale_ptr, v_scale_ptr, out_scale_ptr, sm_scale,
                               stride_qb, stride_qh, stride_ob, stride_oh, stride_bt,
                               tokens_per_split, num_splits, window,
                               NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                               HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
                               KV_FP8: tl.constexpr, SPLIT: tl.constexpr, OUT_FP8: tl.constexpr,
                               DOT_F16: tl.constexpr, HEADS_FIRST: tl.constexpr, V_U16: tl.constexpr):
    """Sliding-window decode: the query sees its last `window` keys (a runtime int > 0: one compiled
    variant serves every window); the splits share out the window, not the whole sequence."""
    _decode_program(out_ptr, part_acc_ptr, part_ml_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr,
                    seq_lens_ptr, k_scale_ptr, v_scale_ptr, out_scale_ptr, sm_scale, stride_qb, stride_qh, stride_ob,
                    stride_oh, stride_bt, tokens_per_split, num_splits, window, NUM_KV_HEADS, GROUP, GROUP_PAD,
                    HEAD_DIM, BLOCK_SIZE, TILE, KV_FP8, SPLIT, OUT_FP8, DOT_F16, HEADS_FIRST, V_U16, True)


def _target_programs(device: torch.device, fp8: bool = False) -> int:
    """Programs the batch alone must reach to run unsplit (programs_per_sm x SMs)."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return _cfg(fp8)["programs_per_sm"] * sms
    return 1  # interpreter: every program costs Python time, fewer is faster


def _split_target(target_programs: int, cfg: dict) -> int:
    """Programs a split launch aims at: split_programs_per_sm per SM (scaled from the fill target, so a
    test or bench that replaces _target_programs moves both)."""
    return max(target_programs, target_programs * cfg["split_programs_per_sm"] // cfg["programs_per_sm"])


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, k_scale=None, v_scale=None,
                 max_seq_len: int | None = None, num_splits: int | None = None, aot=None,
                 out_scale: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """q: [B, Hq, D] (last dim contiguous); caches: contiguous [num_blocks, block_size, Hkv, D]
    (q's dtype or float8_e4m3fn with per-layer scales); block_tables: [B, max_blocks] int32;
    seq_lens: [B] int32 (tokens in cache including the query's own). -> [B, Hq, D] in q.dtype, or with
    ``out_scale`` (fp32, one element: the O projection's static input scale) its float8_e4m3fn codes of
    out / out_scale (the output's quantization folded into the kernel: no launch of its own).
    max_seq_len: host-side upper bound of seq_lens (avoids a device sync); num_splits forces the split.
    window: sliding window (None or 0 = full attention): the query sees its last `window` tokens only, as
    reference.attention defines, and no block before the window is read (its table entry may be stale)."""
    B, Hq, D = q.shape
    _, bs, Hkv, Dc = k_cache.shape
    check(Dc == D and v_cache.shape == k_cache.shape, f"paged_decode: cache {tuple(k_cache.shape)} vs q {tuple(q.shape)}")
    check(Hq % Hkv == 0, f"paged_decode: num_heads {Hq} is not a multiple of num_kv_heads {Hkv}")
    check(D == next_pow2(D) and D >= 16, f"paged_decode: head_dim {D} must be a power of two >= 16")
    check(bs == next_pow2(bs), f"paged_decode: block_size {bs} must be a power of two")
    check(k_cache.is_contiguous() and v_cache.is_contiguous() and q.stride(-1) == 1,
          "paged_decode: caches must be contiguous and q's head_dim contiguous")
    out_fp8 = out_scale is not None
    out = torch.empty(q.shape, dtype=torch.float8_e4m3fn if out_fp8 else q.dtype, device=q.device)
    check(window is None or (isinstance(window, int) and window >= 0),
          f"paged_decode: window {window!r} must be None or an integer >= 0 (0 = full attention)")
    if B == 0:
        return out
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    cfg = _cfg(fp8)
    tile = cfg["tile"]
    if window:
        # the splits share out the window (plus the start's rounding down to its tile), not the sequence
        max_seq_len = min(max_seq_len, window + min(tile, bs) - 1)
    if num_splits is None:
        target = _target_programs(q.device, fp8)
        num_splits, per = choose_splits(B, Hkv, max_seq_len, target, tile, _split_target(target, cfg))
    else:
        check(1 <= num_splits <= MAX_SPLITS, f"paged_decode: num_splits {num_splits} not in [1, {MAX_SPLITS}]")
        num_splits, per = split_sequence(max_seq_len, num_splits, tile)
    group = Hq // Hkv
    split = num_splits > 1
    if split:
        part_acc = torch.empty(B, Hq, num_splits, D, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(B, Hq, num_splits, 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused by the SPLIT=False variant
    ks = scale_tensor(k_scale, q.device)
    os_ = out_scale.reshape(1) if out_fp8 else ks
    args = (out, part_acc, part_ml, q, k_cache, v_cache, block_tables, seq_lens,
            ks, scale_tensor(v_scale, q.device), os_, float(scale),
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0), per, num_splits)
    cx = _constexprs(Hkv, group, D, bs, fp8, split, tile, out_fp8, _dot_f16(cfg, fp8, q.dtype), cfg["heads_first"],
                     _v_u16(cfg, fp8, q.dtype, D))
    grid = (Hkv, B, num_splits) if cfg["heads_first"] else (B, Hkv, num_splits)
    kernel = paged_decode_window_kernel if window else paged_decode_kernel
    if window:
        args += (window,)
    launch(kernel, grid, args, cx, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], aot=aot)
    if split:
        launch(paged_decode_reduce_kernel, (B, Hq),
               (out, part_acc, part_ml, q, os_, out.stride(0), out.stride(1), num_splits),
               _reduce_constexprs(Hq, D, out_fp8), aot=aot)
    return out


def _dot_f16(cfg: dict, fp8: bool, act) -> bool:
    """fp16 dots for an FP8 cache under bf16 activations (tuning "dot_f16"); fp16 activations already
    dot in fp16 and fp32 engines keep their IEEE fp32 dots (they check against references)."""
    return bool(cfg.get("dot_f16", 0)) and fp8 and act in (torch.bfloat16, "bf16")


def _v_u16(cfg: dict, fp8: bool, act, head_dim: int) -> bool:
    """V read as 16-bit words (tuning "v_u16"): where the dots run in fp16 (its codes become fp16: fp16
    activations, or bf16 ones with dot_f16), and a half head of at least 16 dims (tl.dot's smallest N)."""
    f16 = act in (torch.float16, "fp16") or _dot_f16(cfg, fp8, act)
    return bool(cfg.get("v_u16", 0)) and fp8 and f16 and head_dim >= 32


def _constexprs(hkv, group, head_dim, block_size, fp8, split, tile, out_fp8=False, dot_f16=False,
                heads_first=False, v_u16=False) -> dict:
    return dict(NUM_KV_HEADS=hkv, GROUP=group, GROUP_PAD=max(16, next_pow2(group)), HEAD_DIM=head_dim,
                BLOCK_SIZE=block_size, TILE=tile, KV_FP8=fp8, SPLIT=split, OUT_FP8=out_fp8,
                DOT_F16=bool(dot_f16), HEADS_FIRST=bool(heads_first), V_U16=bool(v_u16))


# integer arguments compiled as multiples of 16 (plugins/aot.py): q's and the output's strides are
# multiples of head_dim (a power of two >= 16, checked by the wrapper) for q a view of the fused qkv or
# a tensor of its own, and tokens_per_split is whole tiles. The launcher sends a call that breaks it to
# JIT. Not stride_bt: the block-table width is whatever the runtime allocated.
DIVISIBLE = ("stride_qb", "stride_qh", "stride_ob", "stride_oh", "tokens_per_split")


def aot_variants(e) -> list[Variant]:
    """The variants an engine with shapes `e` (common.EngineShapes) launches: with and without split, and
    for FP8 engines also writing the O projection's fp8 input. The split count is a runtime argument
    (one split variant and one reduction serve every count up to MAX_SPLITS)."""
    group = e.num_heads // e.num_kv_heads
    out = []
    cfg = _cfg(e.kv == "fp8e4nv")
    for out_fp8 in ((False, True) if e.quant_format == "fp8" else (False,)):
        o = "*fp8e4nv" if out_fp8 else f"*{e.act}"
        types = dict(out_ptr=o, part_acc_ptr="*fp32", part_ml_ptr="*fp32", q_ptr=f"*{e.act}",
                     k_cache_ptr=f"*{e.kv}", v_cache_ptr=f"*{e.kv}", block_tables_ptr="*i32", seq_lens_ptr="*i32",
                     k_scale_ptr="*fp32", v_scale_ptr="*fp32", out_scale_ptr="*fp32", sm_scale="fp32",
                     stride_qb="i32", stride_qh="i32", stride_ob="i32", stride_oh="i32", stride_bt="i32",
                     tokens_per_split="i32", num_splits="i32")
        for split in (False, True):
            t = dict(types)
            if not split:   # the unused partial buffers are the output tensor itself
                t.update(part_acc_ptr=o, part_ml_ptr=o)
            fp8 = e.kv == "fp8e4nv"
            cx = _constexprs(e.num_kv_heads, group, e.head_dim, e.block_size, fp8, split, cfg["tile"],
                             out_fp8, _dot_f16(cfg, fp8, e.act), cfg["heads_first"],
                             _v_u16(cfg, fp8, e.act, e.head_dim))
            # sliding-window layers: the window kernel as well (the window is a runtime argument)
            for kernel, extra in ((paged_decode_kernel, {}), (paged_decode_window_kernel, {"window": "i32"}))[
                    :2 if e.sliding_window else 1]:
                out.append(Variant(kernel, dict(t, **extra), cx, num_warps=cfg["num_warps"],
                                   num_stages=cfg["num_stages"], divisible=DIVISIBLE))
        rtypes = dict(out_ptr=o, part_acc_ptr="*fp32", part_ml_ptr="*fp32", act_ptr=f"*{e.act}",
                      out_scale_ptr="*fp32", stride_ob="i32", stride_oh="i32", num_splits="i32")
        out.append(Variant(paged_decode_reduce_kernel, rtypes, _reduce_constexprs(e.num_heads, e.head_dim, out_fp8),
                           divisible=REDUCE_DIVISIBLE))
    return out
