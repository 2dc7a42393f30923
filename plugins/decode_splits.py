"""Split-K of the paged decode (plugins/paged_decode.py): how a sequence is shared out among programs
(host side), how each program writes its partial result, and the small kernel that merges the splits.

A split writes its unnormalized output and its running max and sum; paged_decode_reduce_kernel walks
the splits REDUCE_CHUNK at a time, so up to MAX_SPLITS splits (batch 1 at long context can fill every
SM) merge with a bounded register footprint.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .common import round_to_e4m3

MAX_SPLITS = 128   # bounds the partial buffers (fp32 [B, Hq, splits, D + 2]) and the split choice
REDUCE_CHUNK = 32  # splits the reduction kernel holds at once; it loops over more
TILE_N = 64       # default tokens per inner iteration (the launch uses plugins.tuning "paged_decode")


@triton.jit
def _decode_store(acc, m_i, l_i, cols, q_ptr, out_ptr, part_acc_ptr, part_ml_ptr, out_scale_ptr, b, qh, gmask,
                  sp, num_splits, stride_ob, stride_oh, WRITE_ML: tl.constexpr,
                  NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, SPLIT: tl.constexpr, OUT_FP8: tl.constexpr):
    """Write output columns `cols` of the program's heads: the split's partials (acc, and m/l once:
    WRITE_ML) or the normalized output, as fp8 codes of the O projection's input with OUT_FP8."""
    if SPLIT:
        base = (b * NUM_HEADS + qh) * num_splits + sp
        tl.store(part_acc_ptr + base[:, None] * HEAD_DIM + cols[None, :], acc, mask=gmask[:, None])
        if WRITE_ML:
            tl.store(part_ml_ptr + base * 2, m_i, mask=gmask)
            tl.store(part_ml_ptr + base * 2 + 1, l_i, mask=gmask)
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]   # an empty sequence yields zeros
        if OUT_FP8:   # the O projection's input: rounded to the activation dtype first, as the unfused model does
            out = round_to_e4m3(tl.math.div_rn(out.to(q_ptr.dtype.element_ty).to(tl.float32), tl.load(out_scale_ptr)))
        tl.store(out_ptr + b * stride_ob + qh[:, None] * stride_oh + cols[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=gmask[:, None])


@triton.jit
def paged_decode_reduce_kernel(out_ptr, part_acc_ptr, part_ml_ptr, act_ptr, out_scale_ptr, stride_ob, stride_oh,
                               num_splits, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                               SPLITS_PAD: tl.constexpr, OUT_FP8: tl.constexpr):
    """Merge the splits of one (sequence, head), SPLITS_PAD (= REDUCE_CHUNK) at a time: a first pass over
    the running maxima (2 floats per split) finds the global max, a second weights and sums the partial
    outputs. One chunk (num_splits <= SPLITS_PAD) is the single-pass merge of before."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, HEAD_DIM)
    row = (b * NUM_HEADS + h) * num_splits
    m_max = tl.max(tl.full([SPLITS_PAD], float("-inf"), tl.float32), 0)
    for s0 in range(0, num_splits, SPLITS_PAD):
        s = s0 + tl.arange(0, SPLITS_PAD)
        m = tl.load(part_ml_ptr + (row + s) * 2, mask=s < num_splits, other=float("-inf"))
        m_max = tl.maximum(m_max, tl.max(m, 0))
    # splits past the end of the sequence carry m = -inf; an empty sequence has no finite m at all
    m_ref = tl.where(m_max > float("-inf"), m_max, 0.0)
    num = tl.zeros([HEAD_DIM], tl.float32)
    den = tl.sum(tl.zeros([SPLITS_PAD], tl.float32), 0)
    for s0 in range(0, num_splits, SPLITS_PAD):
        s = s0 + tl.arange(0, SPLITS_PAD)
        smask = s < num_splits
        base = row + s
        m = tl.load(part_ml_ptr + base * 2, mask=smask, other=float("-inf"))
        l = tl.load(part_ml_ptr + base * 2 + 1, mask=smask, other=0.0)
        w = tl.where(m > float("-inf"), tl.exp2(m - m_ref), 0.0)   # maxima are in log2 units
        acc = tl.load(part_acc_ptr + base[:, None] * HEAD_DIM + d[None, :], mask=smask[:, None], other=0.0)
        num += tl.sum(acc * w[:, None], 0)
        den += tl.sum(l * w, 0)
    out = num / tl.where(den > 0, den, 1.0)
    if OUT_FP8:   # act_ptr (q) only gives the activation dtype the unfused model rounds to first
        out = round_to_e4m3(tl.math.div_rn(out.to(act_ptr.dtype.element_ty).to(tl.float32), tl.load(out_scale_ptr)))
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty))


def choose_splits(batch: int, num_kv_heads: int, max_seq_len: int, target_programs: int,
                  tile: int = TILE_N, split_target: int | None = None) -> tuple[int, int]:
    """-> (num_splits, tokens_per_split), each split at least one tile, at most MAX_SPLITS.

    `target_programs` (programs_per_sm x SMs) is what the batch alone must reach to go unsplit; below
    it the sequence is split to reach `split_target` programs (default: target_programs; the wrapper
    passes split_programs_per_sm x SMs). Batch 1 at ctx 8192 on Llama-3-8B heads (Hkv = 8, tile 128,
    132 SMs, 4 per SM): 64 splits of one tile = 512 programs, where the old cap of 32 splits left 256,
    two 4-warp programs per SM: too few loads in flight to cover HBM latency. Batch 64 (512 (b, head)
    programs >= 264) stays unsplit, as measured best. Expected, not measured: the bench-kernels decode
    rows at b1 ctx8192 and the sweep's split_programs_per_sm candidates decide."""
    groups = max(1, batch * num_kv_heads)
    if split_target is None:
        split_target = target_programs
    want = 1 if groups >= target_programs else max(1, -(-split_target // groups))
    splits = max(1, min(want, MAX_SPLITS, -(-max_seq_len // tile)))
    return split_sequence(max_seq_len, splits, tile)


def split_sequence(max_seq_len: int, splits: int, tile: int = TILE_N) -> tuple[int, int]:
    """-> (num_splits, tokens_per_split) with whole tiles per split; rounding up to tiles may leave
    fewer splits than asked (never an empty trailing one)."""
    n = max(1, max_seq_len)
    per = -(-n // splits)                 # ceil
    per = -(-per // tile) * tile          # whole tiles
    return -(-n // per), per


def _reduce_constexprs(heads, head_dim, out_fp8=False) -> dict:
    return dict(NUM_HEADS=heads, HEAD_DIM=head_dim, SPLITS_PAD=REDUCE_CHUNK, OUT_FP8=out_fp8)


REDUCE_DIVISIBLE = ("stride_ob", "stride_oh")   # integer arguments compiled as multiples of 16 (plugins/aot.py)
