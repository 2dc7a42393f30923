"""Reference: paged attention for decode (one query token per sequence) and for prefill / chunked
prefill (new tokens attending to the cached context and causally to each other, optionally restricted
by an EAGLE tree mask). Everything is computed in fp32 from the paged cache.

Sliding window (`window`, None or 0 = full attention): a query at position p sees the keys at positions
in (p - window, p], i.e. p - k < window. This is transformers' own rule (masking_utils'
sliding_window_overlay keeps kv_idx > q_idx - sliding_window, for Mistral, Gemma 2/3 and Qwen2 alike).
The references gather only the keys inside the window, so they never read a block-table entry outside
it either (such entries may name freed blocks)."""
from __future__ import annotations

import torch


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, n: int, scale=None, start: int = 0) -> torch.Tensor:
    """Tokens start .. n-1 of one sequence from a paged cache (block-table entries before start's block
    are not read).

    cache: [num_blocks, block_size, Hkv, D]; block_table: [max_blocks] int32 -> [n - start, Hkv, D] fp32.
    """
    bs = cache.shape[1]
    pos = torch.arange(start, n, device=cache.device)
    blocks = block_table.long()[pos // bs]
    out = cache[blocks, pos % bs].float()
    if cache.dtype == torch.float8_e4m3fn:
        out = out * (float(scale) if scale is not None else 1.0)
    return out


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float) -> torch.Tensor:
    """q [Q,Hq,D], k/v [S,Hkv,D] fp32, allowed [Q,S] bool -> [Q,Hq,D] fp32; rows with nothing allowed -> 0."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,shd->hqs", q.float(), k) * scale
    s = s.masked_fill(~allowed[None], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # fully masked rows give NaN: define them as 0
    return torch.einsum("hqs,shd->qhd", p, v)


def _window_start(pos: int, window: int | None) -> int:
    """The first key position a query at `pos` sees: pos - window + 1 (keys in (pos - window, pos])."""
    return max(0, pos - window + 1) if window else 0


def paged_decode_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                     k_scale=None, v_scale=None, window: int | None = None) -> torch.Tensor:
    """One query token per sequence. q: [B, Hq, D]; block_tables: [B, max_blocks] int32;
    seq_lens: [B] int32 (tokens in cache, the query's own token included) -> [B, Hq, D] in q.dtype.
    The query sits at position seq_len - 1; with `window` it sees the last `window` tokens only.
    A sequence of length 0 yields zeros."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for b in range(q.shape[0]):
        n = int(seq_lens[b])
        if n == 0:
            continue
        lo = _window_start(n - 1, window)
        k = gather_kv(k_cache, block_tables[b], n, k_scale, lo)
        v = gather_kv(v_cache, block_tables[b], n, v_scale, lo)
        allowed = torch.ones(1, n - lo, dtype=torch.bool, device=q.device)
        out[b] = _attend(q[b:b + 1], k, v, allowed, scale)[0]
    return out.to(q.dtype)


def paged_prefill_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                      context_lens: torch.Tensor, scale: float, k_scale=None, v_scale=None,
                      tree_mask: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """Variable-length causal attention over this step's tokens, whose K/V (context and new) are
    already in the paged cache.

    q: [T, Hq, D]; query_start_loc: [B+1] int32; context_lens: [B] int32 (tokens cached before this
    step); query i of sequence b sits at position context_lens[b] + i and sees cache positions <= it.
    tree_mask: optional [T, max_q] bool; row = token of this step, column j = j-th new token of the same
    sequence; it further restricts which new tokens a query sees (context tokens stay visible).
    window: keys a query sees are those in (p - window, p], p its position: context_lens[b] + i, or with a
    tree mask context_lens[b] + depth (its ancestors among the new tokens), where EAGLE places a node.
    -> [T, Hq, D] in q.dtype.
    """
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for b in range(len(query_start_loc) - 1):
        s0, s1 = int(query_start_loc[b]), int(query_start_loc[b + 1])
        ql, ctx = s1 - s0, int(context_lens[b])
        if ql == 0:
            continue
        n = ctx + ql
        qpos = ctx + torch.arange(ql, device=q.device)
        if tree_mask is not None and window:
            qpos = ctx + tree_mask[s0:s1, :ql].bool().sum(1) - 1   # a node counts itself among its ancestors
        lo = _window_start(int(qpos.min()), window)
        k = gather_kv(k_cache, block_tables[b], n, k_scale, lo)
        v = gather_kv(v_cache, block_tables[b], n, v_scale, lo)
        kpos = torch.arange(lo, n, device=q.device)
        slot = ctx + torch.arange(ql, device=q.device)     # where each new token's own K/V sits
        allowed = kpos[None, :] <= slot[:, None]
        if window:
            allowed &= kpos[None, :] > qpos[:, None] - window
        if tree_mask is not None:
            among_new = torch.ones(ql, n, dtype=torch.bool, device=q.device)
            among_new[:, ctx:] = tree_mask[s0:s1, :ql].bool()
            allowed &= among_new[:, lo:]
        out[s0:s1] = _attend(q[s0:s1], k, v, allowed, scale)
    return out.to(q.dtype)
