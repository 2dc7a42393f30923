"""Triton kernel: paged attention for prefill and chunked prefill (also speculative verification).

Variable-length batch: each program takes BLOCK new tokens of one sequence and all GROUP query heads
that share one KV head (rows = token x head, so K/V tiles are loaded once per GQA group), and runs
causal flash attention over that sequence's cache, which already holds both the earlier context
(prefix cache hits, earlier chunks) and this step's tokens. An optional tree mask (EAGLE token trees)
restricts which of the new tokens each query sees. With a sliding window (paged_prefill_window_kernel)
a program's key loop starts in the block of the lowest key its queries see.
Reference: plugins/reference/attention.py (paged_prefill_ref).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import tuning
from .common import Variant, check, launch, next_pow2, scale_tensor

# (query rows = tokens x padded GQA group, key tile) per program: large tiles on a GPU; smaller in
# the interpreter, where each program costs Python time
CPU_TILES = (32, 32)


def gpu_tiles(head_dim: int = 128) -> tuple[int, int]:
    """(rows, tile_n) on a GPU: the tuned ones up to head dim 128. Above it (Gemma 3's 256) the rows
    shrink so the fp32 accumulator (rows x head_dim) keeps the registers it has at 128: 128 rows at 256
    would need 256 per thread for it alone (spilled), and the bf16 tree variant's sm_90 compile took
    224 KB of the 227 KB of shared memory a block may have (176 KB at 64 rows). Speed not measured yet."""
    cfg = tuning.get("paged_prefill")
    rows = cfg["rows"] * 128 // head_dim if head_dim > 128 else cfg["rows"]
    return max(16, rows), cfg["tile_n"]


def _launch_opts() -> tuple[int, int]:
    cfg = tuning.get("paged_prefill")
    return cfg["num_warps"], cfg["num_stages"]     # the interpreter ignores both (they name the variant)


@triton.jit
def _prefill_program(out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_ptr,
                     context_lens_ptr, tree_mask_ptr, k_scale_ptr, v_scale_ptr, sm_scale,
                     stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_tm, window,
                     NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                     HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK: tl.constexpr,
                     TILE: tl.constexpr, KV_FP8: tl.constexpr, HAS_TREE: tl.constexpr, WINDOW: tl.constexpr):
    """One (query block, sequence, KV head) program; the entry kernels below differ only in WINDOW (a
    constexpr: the full-attention kernel compiles to the code it had before windows)."""
    mb = tl.program_id(0)
    b = tl.program_id(1)
    kvh = tl.program_id(2)
    q_start = tl.load(query_start_ptr + b)
    q_len = tl.load(query_start_ptr + b + 1) - q_start
    if mb * BLOCK < q_len:
        ctx = tl.load(context_lens_ptr + b)
        seq_len = ctx + q_len
        r = tl.arange(0, BLOCK * GROUP_PAD)   # row = token-major, head-minor
        i = mb * BLOCK + r // GROUP_PAD
        h = kvh * GROUP + r % GROUP_PAD
        d = tl.arange(0, HEAD_DIM)
        imask = (i < q_len) & (r % GROUP_PAD < GROUP)
        q = tl.load(q_ptr + (q_start + i)[:, None] * stride_qt + h[:, None] * stride_qh + d[None, :],
                    mask=imask[:, None], other=0.0)
        qpos = ctx + i
        qk_scale = sm_scale * tl.load(k_scale_ptr)
        ALIGN: tl.constexpr = TILE if TILE < BLOCK_SIZE else BLOCK_SIZE

        m_i = tl.full([BLOCK * GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK * GROUP_PAD], tl.float32)
        acc = tl.zeros([BLOCK * GROUP_PAD, HEAD_DIM], tl.float32)
        row = NUM_KV_HEADS * HEAD_DIM
        # causality: no query of this block sees past its last row's position
        kv_end = tl.minimum(seq_len, ctx + (mb + 1) * BLOCK)
        if WINDOW:
            # a query at position p sees keys in (p - window, p]; a tree node's position is ctx + its
            # depth (its ancestors among the new tokens, itself included, less one), where EAGLE puts it
            if HAS_TREE:
                seen = tl.zeros([BLOCK * GROUP_PAD], tl.int32)
                for j0 in range(0, q_len, TILE):
                    jj = j0 + tl.arange(0, TILE)
                    tm = tl.load(tree_mask_ptr + (q_start + i)[:, None] * stride_tm + jj[None, :],
                                 mask=imask[:, None] & (jj < q_len)[None, :], other=0)
                    seen += tl.sum((tm != 0).to(tl.int32), 1)
                wpos = ctx + seen - 1
            else:
                wpos = qpos
            w_lo = wpos - window + 1
            # the loop starts in the block of the lowest key any row sees, at a whole tile (so blocks
            # wholly before every row's window, maybe freed, are never read)
            lo = tl.maximum(tl.min(tl.where(imask, w_lo, seq_len), 0), 0)
            kv_start = lo - lo % ALIGN
        else:
            kv_start = 0
        for t0 in range(kv_start, kv_end, TILE):
            tok = t0 + tl.arange(0, TILE)
            tmask = tok < kv_end
            if WINDOW:
                tmask = tmask & (tok >= lo)
            page = tl.load(block_tables_ptr + b * stride_bt + tok // BLOCK_SIZE, mask=tmask, other=0)
            slot = page.to(tl.int64) * BLOCK_SIZE + tok % BLOCK_SIZE
            off = slot[:, None] * row + kvh * HEAD_DIM + d[None, :]
            k = tl.load(k_cache_ptr + off, mask=tmask[:, None], other=0.0)
            v = tl.load(v_cache_ptr + off, mask=tmask[:, None], other=0.0)
            if KV_FP8:
                k = k.to(q.dtype)
                v = v.to(q.dtype)
            # fp32 engines (used to check against references) keep IEEE fp32 dots instead of tf32
            if q.dtype == tl.float32:
                s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
            else:
                s = tl.dot(q, tl.trans(k)) * qk_scale
            allowed = (tok[None, :] <= qpos[:, None]) & tmask[None, :]
            if WINDOW:
                allowed = allowed & (tok[None, :] >= w_lo[:, None])
            if HAS_TREE:
                j = tok - ctx   # index among this step's tokens; < 0 for context, always visible
                tm = tl.load(tree_mask_ptr + (q_start + i)[:, None] * stride_tm + j[None, :],
                             mask=imask[:, None] & (j >= 0)[None, :] & tmask[None, :], other=1)
                allowed = allowed & (tm != 0)
            s = tl.where(allowed, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # a row can have nothing visible yet in this tile (tree masks): keep exp() away from inf-inf
            m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if v.dtype == tl.float32:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        out = acc * tl.load(v_scale_ptr) / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + (q_start + i)[:, None] * stride_ot + h[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=imask[:, None])


@triton.jit
def paged_prefill_kernel(out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_ptr,
                         context_lens_ptr, tree_mask_ptr, k_scale_ptr, v_scale_ptr, sm_scale,
                         stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_tm,
                         NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                         HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK: tl.constexpr,
                         TILE: tl.constexpr, KV_FP8: tl.constexpr, HAS_TREE: tl.constexpr):
    _prefill_program(out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_ptr, context_lens_ptr,
                     tree_mask_ptr, k_scale_ptr, v_scale_ptr, sm_scale, stride_qt, stride_qh, stride_ot, stride_oh,
                     stride_bt, stride_tm, 0, NUM_KV_HEADS, GROUP, GROUP_PAD, HEAD_DIM, BLOCK_SIZE, BLOCK, TILE,
                     KV_FP8, HAS_TREE, False)


@triton.jit
def paged_prefill_window_kernel(out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_ptr,
                                context_lens_ptr, tree_mask_ptr, k_scale_ptr, v_scale_ptr, sm_scale,
                                stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_tm, window,
                                NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                                HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK: tl.constexpr,
                                TILE: tl.constexpr, KV_FP8: tl.constexpr, HAS_TREE: tl.constexpr):
    """Sliding-window prefill: `window` (a runtime int > 0: one compiled variant serves every window)."""
    _prefill_program(out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_ptr, context_lens_ptr,
                     tree_mask_ptr, k_scale_ptr, v_scale_ptr, sm_scale, stride_qt, stride_qh, stride_ot, stride_oh,
                     stride_bt, stride_tm, window, NUM_KV_HEADS, GROUP, GROUP_PAD, HEAD_DIM, BLOCK_SIZE, BLOCK,
                     TILE, KV_FP8, HAS_TREE, True)


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  query_start_loc: torch.Tensor, context_lens: torch.Tensor, scale: float,
                  k_scale=None, v_scale=None, tree_mask: torch.Tensor | None = None,
                  max_query_len: int | None = None, aot=None, window: int | None = None) -> torch.Tensor:
    """q: [T, Hq, D] (last dim contiguous); caches: contiguous [num_blocks, block_size, Hkv, D]
    holding the context AND this step's K/V; block_tables: [B, max_blocks] int32; query_start_loc:
    [B+1] int32; context_lens: [B] int32; tree_mask: optional [T, max_q] bool (column j = j-th new
    token of the same sequence). max_query_len: host-side bound (avoids a device sync).
    window: sliding window (None or 0 = full attention): a query sees the keys in (p - window, p] only and
    no block before its window is read (its table entry may be stale).
    -> [T, Hq, D] in q.dtype. Same semantics as reference.attention.paged_prefill_ref."""
    T, Hq, D = q.shape
    _, bs, Hkv, Dc = k_cache.shape
    B = query_start_loc.shape[0] - 1
    check(Dc == D and v_cache.shape == k_cache.shape, f"paged_prefill: cache {tuple(k_cache.shape)} vs q {tuple(q.shape)}")
    check(Hq % Hkv == 0, f"paged_prefill: num_heads {Hq} is not a multiple of num_kv_heads {Hkv}")
    check(D == next_pow2(D) and D >= 16, f"paged_prefill: head_dim {D} must be a power of two >= 16")
    check(bs == next_pow2(bs), f"paged_prefill: block_size {bs} must be a power of two")
    check(k_cache.is_contiguous() and v_cache.is_contiguous() and q.stride(-1) == 1,
          "paged_prefill: caches must be contiguous and q's head_dim contiguous")
    check(context_lens.shape == (B,) and block_tables.shape[0] == B,
          f"paged_prefill: {B} sequences in query_start_loc but context_lens {tuple(context_lens.shape)}, "
          f"block_tables {tuple(block_tables.shape)}")
    check(window is None or (isinstance(window, int) and window >= 0),
          f"paged_prefill: window {window!r} must be None or an integer >= 0 (0 = full attention)")
    out = torch.empty_like(q)
    if T == 0 or B == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    if tree_mask is not None:
        check(tree_mask.dim() == 2 and tree_mask.shape[0] == T,
              f"paged_prefill: tree_mask shape {tuple(tree_mask.shape)} must be [{T}, max_q]")
        tm = tree_mask.to(torch.uint8).contiguous()
    else:
        tm = out  # unused by the HAS_TREE=False variant
    rows, tile_n = gpu_tiles(D) if q.is_cuda else CPU_TILES
    group = Hq // Hkv
    group_pad = next_pow2(group)
    block_m = max(1, rows // group_pad)   # tokens per program
    grid = (triton.cdiv(max(1, max_query_len), block_m), B, Hkv)
    args = (out, q, k_cache, v_cache, block_tables, query_start_loc, context_lens, tm,
            scale_tensor(k_scale, q.device), scale_tensor(v_scale, q.device), float(scale),
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
            tm.stride(0) if tree_mask is not None else 0)
    warps, stages = _launch_opts()
    kernel = paged_prefill_window_kernel if window else paged_prefill_kernel
    if window:
        args += (window,)
    launch(kernel, grid, args,
           _constexprs(Hkv, group, D, bs, block_m, tile_n, k_cache.dtype == torch.float8_e4m3fn,
                       tree_mask is not None), num_warps=warps, num_stages=stages, aot=aot)
    return out


def _constexprs(hkv, group, head_dim, block_size, block_m, tile_n, fp8, tree) -> dict:
    return dict(NUM_KV_HEADS=hkv, GROUP=group, GROUP_PAD=next_pow2(group), HEAD_DIM=head_dim,
                BLOCK_SIZE=block_size, BLOCK=block_m, TILE=tile_n, KV_FP8=fp8, HAS_TREE=tree)


def aot_variants(e) -> list[Variant]:
    """GPU variants an engine with shapes `e` launches; the tree-mask one only with speculation."""
    out = []
    group = e.num_heads // e.num_kv_heads
    (rows, tile_n), cfg = gpu_tiles(e.head_dim), tuning.get("paged_prefill")
    for tree in ((False, True) if e.speculative else (False,)):
        types = dict(out_ptr=f"*{e.act}", q_ptr=f"*{e.act}", k_cache_ptr=f"*{e.kv}", v_cache_ptr=f"*{e.kv}",
                     block_tables_ptr="*i32", query_start_ptr="*i32", context_lens_ptr="*i32",
                     tree_mask_ptr="*u8" if tree else f"*{e.act}", k_scale_ptr="*fp32", v_scale_ptr="*fp32",
                     sm_scale="fp32", stride_qt="i32", stride_qh="i32", stride_ot="i32", stride_oh="i32",
                     stride_bt="i32", stride_tm="i32")
        cx = _constexprs(e.num_kv_heads, group, e.head_dim, e.block_size, max(1, rows // next_pow2(group)), tile_n,
                         e.kv == "fp8e4nv", tree)
        # sliding-window layers: the window kernel as well (the window is a runtime argument)
        for kernel, extra in ((paged_prefill_kernel, {}), (paged_prefill_window_kernel, {"window": "i32"}))[
                :2 if e.sliding_window else 1]:
            out.append(Variant(kernel, dict(types, **extra), cx, num_warps=cfg["num_warps"],
                               num_stages=cfg["num_stages"]))
    return out
