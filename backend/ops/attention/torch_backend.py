"""PyTorch reference attention over the paged KV cache (CPU and GPU).

Layout and semantics: see ``backend.ops.attention.AttentionBackend``.

Batch invariance (docs/contracts.md): a query row's output depends only on its sequence's tokens up
to its own position, never on the other sequences of the step, on how its prompt was split into
prefill chunks, or on whether it is a prefill or a decode row. PyTorch's CPU SDPA kernel does not
give that by itself: with one query row per sequence its numbers change with the batch it is called
on (which thread, with which scratch buffer, gets a head; measured with 2 threads), and they change
with the key length it is given (its MKL GEMMs block by the matrix sizes). The padded decode batch
this backend used to run made every sequence's logits depend on its batchmates.

On CPU in float32 with Kiln's CPU kernels loaded (plugins/cpu), every row of every step goes to the
attention kernel instead (plugins/cpu/attention.c): one row at a time over the paged cache, its
numbers following from its own keys alone by construction, so none of the tiling below is needed
(and no padded key, no gathered copy of the cache). A bf16 compute dtype, an fp8-byte cache, a GPU
or a machine without a C compiler take the tiles, every step alike. Both paths are batch invariant;
they differ from each other in the last bits (tests/kernels/test_cpu_kernels.py).

Hence every SDPA call here has a shape that follows from each row's position alone. Queries are
attended in tiles of ``QUERY_TILE`` positions aligned to multiples of it (a decode row is its tile's
only real row; the other rows are zeros); a tile ending at position ``e`` attends keys
``[0, e rounded up to KEY_BUCKET)``, those past each row's position masked. Tiles with the same key
length share one call (a step's decode rows, a prefill's tiles): at two query rows or more the kernel
gives each (tile, head) the same numbers whatever the batch around it (measured and tested,
tests/runtime/test_batch_invariance.py). The rows of a tile do not interact (each is its own softmax
over the keys its mask shows), so a tile's other rows, real or not, do not change a row; nor do the
masked keys, whatever stale (finite: fp8 saturates) values the cache holds there: weight exactly 0.
The plan (which tiles, masks, blocks) is the same for every layer of a step and made once.
Cost: a decode row computes ``QUERY_TILE`` query rows and up to ``KEY_BUCKET`` masked keys; in
exchange no sequence is padded to the step's longest.

Plain decode rows on CPU (one query row per sequence, no draft tokens) are cheaper still: the query
heads sharing a KV head become the rows of one tile of ``max(FOLD_MIN_ROWS, group)`` rows, attended
with that KV head alone. A tile has at least ``QUERY_TILE`` rows, as a prefill tile has: the CPU kernel's
GEMMs block by the row count, and a row's numbers do not depend on the tile's other rows, their values,
its place in the tile or which head it belongs to only among tiles of one row count. (Tiles of 4 rows
were enough on an AMD EPYC; on an Intel Xeon with AVX-512 a 4- or 5-row tile of 128-wide heads gave
other bits than the 8-row tile.) So a folded row equals the same row in an 8-row tile of its head:
tested bit for bit over head shapes and key lengths (tests/runtime/test_attention_torch.py) and end to
end (tests/runtime/test_batch_invariance.py). SmolLM2's 9 query heads over 3 KV heads then compute 24
rows per sequence instead of 72, and no query head is expanded for GQA.
"""
from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from backend.ops import fp8
from backend.ops.attention import AttentionBackend
from plugins import registry
from plugins.cpu import ops as cpu_ops   # the attention kernel's library and row layout

FP8_KV_DTYPE = fp8.FP8
# The CPU kernels this backend calls where they apply (float32 on CPU): rows of the kernel table.
_cpu_write_kv_fp8 = registry.load("write_kv_fp8", "cpu")
_cpu_paged_attention = registry.load("paged_attention", "cpu")
# Query positions per tile and key-length granularity (see the module docstring): a smaller tile
# makes decode cheaper and long prefills dearer; a coarser bucket means fewer calls, more masked keys.
QUERY_TILE = 8
KEY_BUCKET = 128
# The fewest rows of a folded tile: a prefill tile's, so that both run the same GEMM shapes (module docstring)
FOLD_MIN_ROWS = QUERY_TILE


def quantize_kv(x: torch.Tensor, scale: torch.Tensor | None, cache_dtype: torch.dtype) -> torch.Tensor:
    """Convert new keys/values to the cache dtype (fp8: stored = x / scale, saturated)."""
    if cache_dtype == FP8_KV_DTYPE:
        assert scale is not None, "fp8 KV cache needs a per-layer scale"
        return fp8.quantize(x, scale)   # saturated: above the calibrated range clips, never NaN
    return x.to(cache_dtype)


def dequantize_kv(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    if x.dtype == FP8_KV_DTYPE:
        assert scale is not None, "fp8 KV cache needs a per-layer scale"
        # a decode step dequantizes every sequence's whole context in every layer: the CPU table
        # lookup (backend/ops/fp8.py) is 4x faster than PyTorch's conversion, same bits
        return fp8.dequantize(x, scale, dtype)
    return x if x.dtype == dtype else x.to(dtype)


def _gather(cache: torch.Tensor, block_table: torch.Tensor, run: tuple[int, int] | None = None) -> torch.Tensor:
    """``cache[block_table]`` as one ``index_select`` over the flattened table: the same copy, 4x
    faster on CPU than advanced indexing with a 2-D index (measured: 2.0 vs 8.0 ms for 64 sequences
    x 41 blocks of SmolLM2). fp8 is gathered as bytes (no fp8 CPU kernel).

    ``run = (first, count)`` when one sequence's blocks holding its keys are consecutive ids from
    ``first`` (``_TileGroup`` finds out once per step, ``_slice_of_cache``): ``count`` blocks from
    there are read as a slice of the cache, nothing copied; past the sequence's own blocks the slice
    holds masked keys only, where the copy holds padding block 0. A lone sequence's blocks usually
    are consecutive (a prompt's come off the free list in order): at batch 1 the 60 copies of a
    SmolLM2 step cost 4-5 ms, each a cold read of the layer's cache."""
    if run is not None:
        return cache[run[0]:run[0] + run[1]]
    raw = cache.view(torch.uint8) if cache.dtype == FP8_KV_DTYPE else cache
    out = raw.index_select(0, block_table.reshape(-1)).view(*block_table.shape, *cache.shape[1:])
    return out.view(FP8_KV_DTYPE) if cache.dtype == FP8_KV_DTYPE else out


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    holds_fp8_as_float = True
    sliding_window = True
    window_tables = True   # the tiles' masks drop every key outside the window before it weighs anything
    # Set by the runner for an fp8 KV cache on CPU: the cache tensors are float and hold what an fp8
    # cache would give back on reading, ``dequantize(quantize(x))``, rounded to the cache dtype once on
    # writing (the same fp32 product and rounding as dequantizing at read time, so the same numbers
    # reach attention), and reading needs no conversion.
    fp8_as_float = False
    _plan = None   # (the step's positions, {(window, id(metadata)): its tile groups}): see forward
    _slots = ()    # ((a slot mapping of the step, whether every slot is >= 0), ...): see _all_slots_valid
    _rows = None   # (the step's metadata, (block tables, query rows) for the CPU kernel, or None)

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
        """Scatter ``k, v [T, Hkv, D]`` into the caches at ``slot_mapping [T]`` (-1 = skip)."""
        num_blocks, block_size, hkv, d = k_cache.shape
        if (self.fp8_as_float and k_scale is not None and k_cache.dtype == torch.float32 and k.dtype == torch.float32
                and _cpu_write_kv_fp8(k, v, k_cache.view(num_blocks * block_size, hkv, d),
                                         v_cache.view(num_blocks * block_size, hkv, d), slot_mapping,
                                         k_scale, v_scale)):
            return   # the CPU kernel: the fake quantization and the scatter below in one call, same bits
        if not self._all_slots_valid(slot_mapping):
            valid = slot_mapping >= 0
            slot_mapping, k, v = slot_mapping[valid], k[valid], v[valid]
        k_flat = k_cache.view(num_blocks * block_size, hkv, d)
        v_flat = v_cache.view(num_blocks * block_size, hkv, d)
        if self.fp8_as_float and k_cache.dtype != FP8_KV_DTYPE:
            # fp8.fake_quant is this round trip (in one CPU kernel call for float32)
            k_new, v_new = (fp8.fake_quant(x, sc) if x.dtype == cache.dtype else
                            dequantize_kv(quantize_kv(x, sc, FP8_KV_DTYPE), sc, cache.dtype)
                            for x, sc, cache in ((k, k_scale, k_cache), (v, v_scale, v_cache)))
        else:
            k_new = quantize_kv(k, k_scale, k_cache.dtype)
            v_new = quantize_kv(v, v_scale, v_cache.dtype)
        if k_cache.dtype == FP8_KV_DTYPE:  # index_copy_ has no fp8 kernel on CPU: copy the bytes
            k_flat, v_flat, k_new, v_new = (t.view(torch.uint8) for t in (k_flat, v_flat, k_new, v_new))
        k_flat.index_copy_(0, slot_mapping, k_new)
        v_flat.index_copy_(0, slot_mapping, v_new)

    def _all_slots_valid(self, slot_mapping) -> bool:
        """Every layer of a step writes at the same slots (the step's metadata, or with a pool for the
        sliding layers one of two): checked once a step, three ops a layer fewer. The two last mappings
        are kept; holding the tensors keeps their identity from being reused."""
        for seen, ok in self._slots:
            if seen is slot_mapping:
                return ok
        ok = bool((slot_mapping >= 0).all())
        self._slots = ((slot_mapping, ok),) + self._slots[:1]
        return ok

    def forward(self, q, k_cache, v_cache, meta, scale, k_scale=None, v_scale=None, window=None) -> torch.Tensor:
        """Causal attention of ``q [T, Hq, D]`` over each sequence's cached keys, in query tiles
        (see the module docstring: what a row's numbers depend on, and why). ``window``: a sliding
        layer's, keys ``p - window < k <= p`` only; the tiles' masks take it (the CPU kernel has none)."""
        if window is None:
            if self._rows is None or self._rows[0] is not meta:
                self._rows = (meta, self._kernel_rows(q, k_cache, meta))
            if self._rows[1] is not None:
                tables, rows = self._rows[1]
                out = _cpu_paged_attention(q, k_cache, v_cache, tables, rows, meta.tree_mask, scale)
                if out is not None:
                    return out
        if self._plan is None or self._plan[0] is not meta.positions:
            # Every layer of a step attends the same tiles: planned once per step (the metadata is a
            # new object every step; holding it keeps its identity from being reused), once per window
            # (sliding layers with a pool of their own read another metadata: the step's ``window``).
            self._plan = (meta.positions, {})
        key = (window, id(meta))   # (the metadata is held beside its plan: its id is not reused meanwhile)
        if key not in self._plan[1]:
            self._plan[1][key] = (meta, self._make_plan(meta, k_cache.shape[1], k_cache.shape[0], q.device, window))
        groups = self._plan[1][key][1]
        if len(groups) == 1 and groups[0].folded and groups[0].all_rows:
            # a plain decode step: its one group is every row in order, the folded output is the output
            return self._forward_folded(q, k_cache, v_cache, groups[0], scale, k_scale, v_scale, None)
        out = torch.empty_like(q)
        bs, hkv, d = k_cache.shape[1:]
        hq = q.shape[1]
        for grp in groups:
            if grp.folded:
                self._forward_folded(q, k_cache, v_cache, grp, scale, k_scale, v_scale, out)
                continue
            g = len(grp.kls)
            qt = q.new_zeros(g * QUERY_TILE, hq, d)
            qt.index_copy_(0, grp.dst, q.index_select(0, grp.src))
            qt = qt.view(g, QUERY_TILE, hq, d).transpose(1, 2)
            mask = grp.mask if grp.mask.dtype == q.dtype else grp.mask.to(q.dtype)
            ks, vs = (dequantize_kv(_gather(cache, grp.blocks, grp.block_run), sc, q.dtype).view(-1, bs, hkv, d)
                      for cache, sc in ((k_cache, k_scale), (v_cache, v_scale)))
            o = q.new_empty(g, QUERY_TILE, hq, d)
            for j0, j1, kl, b0, nb in grp.runs:
                n = 1 if grp.shared_keys else j1 - j0
                k, v = (x[b0:b0 + n * nb].view(n, nb * bs, hkv, d)[:, :kl].transpose(1, 2) for x in (ks, vs))
                if grp.shared_keys:
                    k, v = k.expand(j1 - j0, -1, -1, -1), v.expand(j1 - j0, -1, -1, -1)
                o[j0:j1] = F.scaled_dot_product_attention(qt[j0:j1], k, v, attn_mask=mask[j0:j1, :, :, :kl],
                                                          scale=scale, enable_gqa=hq != hkv).transpose(1, 2)
            out.index_copy_(0, grp.src, o.view(g * QUERY_TILE, hq, d).index_select(0, grp.dst))
        return out

    @staticmethod
    def _kernel_rows(q, k_cache, meta) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The step's block tables and query rows for the CPU attention kernel, or None where it does
        not apply (no kernels; not float32 on CPU: then every step, every layer takes the tiles)."""
        if (cpu_ops.attention_library() is None or q.device.type != "cpu" or q.dtype != torch.float32
                or k_cache.dtype != torch.float32):
            return None
        rows = cpu_ops.attention_rows(meta.query_start_loc.tolist(), meta.context_lens.tolist())
        return meta.block_tables.to(torch.int32).contiguous(), rows

    @staticmethod
    def _forward_folded(q, k_cache, v_cache, grp: "_TileGroup", scale, k_scale, v_scale, out):
        """Plain decode rows, one per tile: each KV head's query heads as the rows of its tile. Writes
        ``out``'s rows of the group, or with ``out`` None (the group is every row) returns them."""
        bs, hkv, d = k_cache.shape[1:]
        g, hq = len(grp.kls), q.shape[1]
        group = hq // hkv
        rows = max(FOLD_MIN_ROWS, group)
        qf = q.new_zeros(g, hkv, rows, d)
        qf[:, :, :group] = (q if grp.all_rows else q.index_select(0, grp.src)).view(g, hkv, group, d)
        mask = grp.mask if grp.mask.dtype == q.dtype else grp.mask.to(q.dtype)
        ks, vs = (dequantize_kv(_gather(cache, grp.blocks, grp.block_run), sc, q.dtype).view(-1, bs, hkv, d)
                  for cache, sc in ((k_cache, k_scale), (v_cache, v_scale)))
        o = q.new_empty(g, hkv, rows, d)
        for j0, j1, kl, b0, nb in grp.runs:
            n = j1 - j0
            k, v = (x[b0:b0 + n * nb].view(n, nb * bs, hkv, d)[:, :kl].transpose(1, 2) for x in (ks, vs))
            o[j0:j1] = F.scaled_dot_product_attention(qf[j0:j1], k, v, scale=scale,
                                                      attn_mask=mask[j0:j1, :, :, :kl].expand(n, 1, rows, kl))
        if out is None:
            return o[:, :, :group].reshape(g, hq, d)
        out.index_copy_(0, grp.src, o[:, :, :group].reshape(g, hq, d))
        return out

    @staticmethod
    def _make_plan(meta, bs: int, num_blocks: int, dev, window: int | None = None) -> list["_TileGroup"]:
        """The step's query tiles, grouped: each prefill's tiles (sharing its keys), then every
        decode-like sequence's (speculative verification included) ordered by key length."""
        tile = QUERY_TILE
        qsl = meta.query_start_loc.tolist()
        ctx = meta.context_lens.tolist()
        tables = meta.block_tables
        groups, shared, single = [], [], []
        # plain decode rows fold (see the module docstring) on the CPU, where that was measured; a step
        # with a token tree (speculative verification) keeps every row in its position tile
        fold = dev.type == "cpu" and meta.tree_mask is None
        for i in range(len(qsl) - 1):
            c, n = ctx[i], qsl[i + 1] - qsl[i]
            if n == 0:
                continue
            tiles = [(i, a) for a in range(c // tile * tile, c + n, tile)]
            if i < meta.num_prefills:
                groups.append(_TileGroup(tiles, qsl, ctx, meta.tree_mask, tables, bs, num_blocks, dev,
                                         shared_keys=True, window=window))
            elif fold and n == 1:
                single.extend(tiles)
            else:
                shared.extend(tiles)
        for items, folded in ((shared, False), (single, True)):
            if items:
                items.sort(key=lambda t: _key_len(t[1] + tile))
                groups.append(_TileGroup(items, qsl, ctx, meta.tree_mask, tables, bs, num_blocks, dev,
                                         shared_keys=False, folded=folded, window=window))
        return groups


def _key_len(end: int) -> int:
    """Keys a tile ending at position ``end`` attends over: ``end`` rounded up to ``KEY_BUCKET``."""
    return -(-end // KEY_BUCKET) * KEY_BUCKET


class _TileGroup:
    """Query tiles attended together, ordered by key length, and the index tensors every layer of the
    step uses for them: ``src``/``dst`` (token rows of q <-> rows of the tiles), ``mask`` (additive,
    ``[g, 1, QUERY_TILE, longest key length]``: causal, plus the step's token tree), ``blocks`` (the KV
    blocks to gather: the one sequence's when ``shared_keys``, else each tile's sequence's) and ``runs``
    ``(j0, j1, key length, first block, blocks per tile)``: tiles j0..j1 share one SDPA call."""

    def __init__(self, items: list[tuple[int, int]], qsl, ctx, tree, tables, bs: int, num_blocks: int, dev,
                 shared_keys: bool,
                 folded: bool = False, window: int | None = None):
        tile = QUERY_TILE
        g = len(items)
        self.shared_keys = shared_keys
        self.folded = folded   # one real row per tile (plain decode): mask holds that row alone
        self.kls = [_key_len(a + tile) for _, a in items]
        src, dst = [], []
        for j, (i, a) in enumerate(items):
            c, t0 = ctx[i], qsl[i]
            lo, hi = max(a, c), min(a + tile, c + qsl[i + 1] - t0)
            src.extend(range(t0 + lo - c, t0 + hi - c))
            dst.extend(range(j * tile + lo - a, j * tile + hi - a))
        self.src, self.dst = torch.tensor(src, device=dev), torch.tensor(dst, device=dev)
        # the group's rows are all of the step's, in order (a plain decode step): no gather or scatter
        self.all_rows = src == list(range(qsl[-1]))
        longest = self.kls[-1]
        keys = torch.arange(longest, device=dev).view(1, 1, -1)
        rows = torch.tensor([a for _, a in items], device=dev).view(g, 1, 1) + torch.arange(tile, device=dev).view(1, tile, 1)
        visible = keys <= rows                                   # [g, tile, L]: causal
        if window is not None:   # a sliding layer: the last ``window`` positions, the row's own included
            visible &= keys > rows - window
        if tree is not None:
            # tree[t, m]: row t may see the m-th token of its own step (position ctx + m); the cached
            # context stays visible.
            for j, (i, a) in enumerate(items):
                c, t0, n = ctx[i], qsl[i], qsl[i + 1] - qsl[i]
                lo, hi = max(a, c), min(a + tile, c + n)
                m = min(n, longest - c)
                visible[j, lo - a:hi - a, c:c + m] &= tree[t0 + lo - c:t0 + hi - c, :m]
        if folded:   # the real row of each tile (one per tile): [g, 1, 1, L], its query heads share it
            visible = visible[torch.arange(g, device=dev), self.dst - torch.arange(g, device=dev) * tile].unsqueeze(1)
        self.mask = torch.zeros(g, 1, visible.shape[1], longest, device=dev).masked_fill_(~visible.unsqueeze(1),
                                                                                            float("-inf"))
        # KV blocks: a tile of key length L reads ceil(L / bs) blocks of its sequence; past the block
        # table (and in its padding) block 0, masked like every key past the sequence's length.
        width = tables.shape[1]

        def table(seqs: list[int], nb: int) -> torch.Tensor:
            bt = tables.index_select(0, torch.tensor(seqs, device=dev))[:, :min(nb, width)].to(torch.long)
            if nb > width:
                bt = torch.cat([bt, bt.new_zeros(len(seqs), nb - width)], dim=1)
            return bt.reshape(-1)

        self.runs, blocks, j0, b0 = [], [], 0, 0
        for kl, run in itertools.groupby(self.kls):
            j1 = j0 + len(list(run))
            nb = -(-kl // bs)
            self.runs.append((j0, j1, kl, b0, nb))
            if not shared_keys:
                blocks.append(table([i for i, _ in items[j0:j1]], nb))
                b0 += (j1 - j0) * nb
            j0 = j1
        # A prefill's tiles all read a prefix of one gather of its keys (as long as its last tile's).
        self.blocks = table([items[0][0]], -(-longest // bs)) if shared_keys else torch.cat(blocks)
        # One sequence (a prefill, or a lone decode row): its blocks may be a slice of the cache.
        seq = items[0][0]
        one = shared_keys or len(items) == 1
        self.block_run = _slice_of_cache(self.blocks, -(-(qsl[seq + 1] - qsl[seq] + ctx[seq]) // bs),
                                         num_blocks) if one else None


def _slice_of_cache(blocks: torch.Tensor, real: int, num_blocks: int) -> tuple[int, int] | None:
    """``(first, len(blocks))`` when the first ``real`` entries of one sequence's ``blocks`` (those
    holding its keys) are ``first, first + 1, ...`` and the cache has ``len(blocks)`` blocks from
    ``first`` on; else None. The entries past ``real`` (padding: block 0) hold only masked keys, so
    any block in their place gives the same numbers (module docstring): the slice's next ones."""
    n = blocks.numel()
    real = min(real, n)
    if n == 0 or real == 0:
        return None
    first = int(blocks[0])
    if first + n > num_blocks:
        return None
    want = torch.arange(first, first + real, dtype=blocks.dtype, device=blocks.device)
    return (first, n) if bool(torch.equal(blocks[:real], want)) else None
