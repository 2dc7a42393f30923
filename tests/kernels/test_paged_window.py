"""Sliding-window paged decode and prefill vs the references: windows smaller than, equal to and larger
than the context, windows not a multiple of the block size, GQA groups, split-K decode, fp8 KV, tree
(speculative verification) prefill, head dim 256. Every block-table entry of a block wholly before the
window is poisoned (-1, an id past the pool, or a block full of NaN) to prove the kernels never read it:
a read of the first two faults or lands on garbage, of the third puts NaN in the output."""
import pytest
import torch

from plugins import tuning
from plugins.paged_decode import paged_decode
from plugins.paged_prefill import paged_prefill
from plugins.reference.attention import paged_decode_ref, paged_prefill_ref
from tests.kernels.kernel_utils import assert_close, make_paged, to_fp8_cache


def _poison_before(k, v, tables, first_needed):
    """Entries of blocks wholly before token first_needed[b] -> -1, past the pool, or a NaN block (in turn).
    -> (k, v, tables) with one block appended to the pool: the NaN one. Returns how many entries it changed."""
    bs = k.shape[1]
    nan_block = k.shape[0]
    k = torch.cat([k, torch.full_like(k[:1], float("nan"))])
    v = torch.cat([v, torch.full_like(v[:1], float("nan"))])
    tables = tables.clone()
    bad = (-1, nan_block + 1000, nan_block)
    changed = 0
    for b, first in enumerate(first_needed):
        for blk in range(max(0, first) // bs):
            tables[b, blk] = bad[changed % 3]
            changed += 1
    return k, v, tables, changed


DECODE_CASES = [  # (num_kv_heads, gqa, head_dim, block_size, seq lens, window, num_splits)
    (2, 1, 64, 16, [100, 37, 1, 0], 20, 1),   # window smaller than the context, not a multiple of 16
    (1, 4, 64, 16, [48, 16], 48, 1),          # window equal to the (longest) context
    (1, 4, 64, 32, [30, 70], 200, 1),         # window larger than every context
    (2, 4, 64, 16, [150, 23, 90], 37, 3),     # split-K over the window
    (1, 8, 256, 16, [70, 5], 33, 2),          # Gemma 3's head dim
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("hkv,group,head_dim,block_size,lens,window,splits", DECODE_CASES)
def test_decode_window_matches_reference(device, fresh_seed, dtype, hkv, group, head_dim, block_size, lens, window,
                                         splits):
    k, v, tables = make_paged(lens, block_size, hkv, head_dim, dtype, device)
    k, v, tables, _ = _poison_before(k, v, tables, [n - window for n in lens])
    q = torch.randn(len(lens), hkv * group, head_dim, device=device).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    out = paged_decode(q, k, v, tables, seq_lens, head_dim ** -0.5, num_splits=splits, window=window)
    ref = paged_decode_ref(q, k, v, tables, seq_lens, head_dim ** -0.5, window=window)
    assert_close(out, ref, dtype, f"decode window={window} lens={lens}", fresh_seed)
    assert out[torch.tensor(lens) == 0].abs().sum() == 0, "an empty sequence must attend to nothing"


def test_decode_window_poison_is_really_outside(device, fresh_seed):
    """The poisoned table changes the full-attention answer (so the window tests exercise the poison)
    and the window changes the reference's answer where the context is longer than the window."""
    lens, window = [100], 20
    k, v, tables = make_paged(lens, 16, 1, 64, torch.float32, device)
    q = torch.randn(1, 4, 64, device=device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    full = paged_decode_ref(q, k, v, tables, seq_lens, 0.125)
    win = paged_decode_ref(q, k, v, tables, seq_lens, 0.125, window=window)
    assert (full - win).abs().max() > 1e-3
    kp, vp, tp, changed = _poison_before(k, v, tables, [lens[0] - window])
    assert changed == 5   # blocks 0-4 (tokens 0-79) lie before token 80, the window's first
    assert paged_decode(q, kp, vp, tp, seq_lens, 0.125, window=window).isfinite().all()


@pytest.mark.parametrize("tile,block_size", [(16, 64), (64, 16)])
def test_decode_window_tiles_and_blocks_of_other_sizes(device, fresh_seed, tile, block_size):
    """The window's first key inside a block larger than the tile (the loop starts at the tile holding
    it, never at a wholly masked one) and inside a block smaller than the tile."""
    lens, window = [200, 130], 45
    k, v, tables = make_paged(lens, block_size, 1, 64, torch.float16, device)
    k, v, tables, _ = _poison_before(k, v, tables, [n - window for n in lens])
    q = torch.randn(2, 2, 64, device=device).half()
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    with tuning.override("paged_decode", tile=tile):
        out = paged_decode(q, k, v, tables, seq_lens, 0.125, num_splits=2, window=window)
    ref = paged_decode_ref(q, k, v, tables, seq_lens, 0.125, window=window)
    assert_close(out, ref, torch.float16, f"decode tile={tile} bs={block_size}", fresh_seed)


@pytest.mark.parametrize("splits", [1, 2])
def test_decode_window_fp8_kv(device, fresh_seed, splits):
    lens, hkv, group, d, bs, window = [90, 9, 61], 2, 4, 64, 16, 29
    k, v, tables = make_paged(lens, bs, hkv, d, torch.float32, device)
    k8, v8 = to_fp8_cache(k, 0.013), to_fp8_cache(v, 0.021)
    ks, vs = torch.tensor(0.013), torch.tensor(0.021)
    q = torch.randn(len(lens), hkv * group, d, device=device).half()
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    ref = paged_decode_ref(q, k8, v8, tables, seq_lens, 0.125, ks, vs, window=window)
    k8, v8, tables, _ = _poison_before(k8.float(), v8.float(), tables, [n - window for n in lens])
    k8, v8 = k8.to(torch.float8_e4m3fn), v8.to(torch.float8_e4m3fn)   # NaN survives as e4m3's NaN code
    with tuning.override("paged_decode_fp8", tile=16):
        out = paged_decode(q, k8, v8, tables, seq_lens, 0.125, ks, vs, num_splits=splits, window=window)
    assert_close(out, ref, torch.float16, "decode window fp8", fresh_seed)


def _batch(ctx, qlens, device):
    qsl = torch.tensor([0] + list(torch.tensor(qlens).cumsum(0)), dtype=torch.int32, device=device)
    return [c + q for c, q in zip(ctx, qlens)], qsl, torch.tensor(ctx, dtype=torch.int32, device=device)


PREFILL_CASES = [  # (num_kv_heads, gqa, head_dim, block_size, context lens, query lens, window)
    (2, 1, 64, 16, [0, 0], [40, 1], 11),       # window shorter than a prefill: rows of one program differ
    (1, 4, 64, 16, [50, 0, 7], [20, 33, 1], 24),   # chunked prefill after a window's worth and more
    (1, 4, 64, 32, [33, 3], [17, 1], 50),      # window equal to the longest sequence
    (3, 3, 64, 16, [20, 5], [9, 18], 100),     # window larger than every sequence
    (1, 2, 256, 16, [30], [6], 17),            # Gemma 3's head dim
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("hkv,group,head_dim,block_size,ctx,qlens,window", PREFILL_CASES)
def test_prefill_window_matches_reference(device, fresh_seed, dtype, hkv, group, head_dim, block_size, ctx, qlens,
                                          window):
    lens, qsl, ctx_t = _batch(ctx, qlens, device)
    k, v, tables = make_paged(lens, block_size, hkv, head_dim, dtype, device)
    # the first query of a sequence (position ctx) needs keys from ctx - window + 1 on
    k, v, tables, _ = _poison_before(k, v, tables, [c - window + 1 for c in ctx])
    q = torch.randn(sum(qlens), hkv * group, head_dim, device=device).to(dtype)
    out = paged_prefill(q, k, v, tables, qsl, ctx_t, head_dim ** -0.5, window=window)
    ref = paged_prefill_ref(q, k, v, tables, qsl, ctx_t, head_dim ** -0.5, window=window)
    assert_close(out, ref, dtype, f"prefill window={window} ctx={ctx} q={qlens}", fresh_seed)


def test_prefill_window_differs_from_full_attention(device, fresh_seed):
    """The window case above is not trivially full attention: the reference's answers differ."""
    lens, qsl, ctx_t = _batch([50], [20], device)
    k, v, tables = make_paged(lens, 16, 1, 64, torch.float32, device)
    q = torch.randn(20, 4, 64, device=device)
    full = paged_prefill_ref(q, k, v, tables, qsl, ctx_t, 0.125)
    win = paged_prefill_ref(q, k, v, tables, qsl, ctx_t, 0.125, window=24)
    assert (full - win).abs().amax(dim=(1, 2)).min() > 1e-3   # every query lost some keys


def test_prefill_window_fp8_kv(device, fresh_seed):
    ctx, qlens, window = [45, 0], [5, 30], 19
    lens, qsl, ctx_t = _batch(ctx, qlens, device)
    k, v, tables = make_paged(lens, 16, 1, 64, torch.float32, device)
    k8, v8 = to_fp8_cache(k, 0.02), to_fp8_cache(v, 0.03)
    ks, vs = torch.tensor(0.02), torch.tensor(0.03)
    q = torch.randn(sum(qlens), 4, 64, device=device).half()
    ref = paged_prefill_ref(q, k8, v8, tables, qsl, ctx_t, 0.125, ks, vs, window=window)
    k8, v8, tables, _ = _poison_before(k8.float(), v8.float(), tables, [c - window + 1 for c in ctx])
    out = paged_prefill(q, k8.to(torch.float8_e4m3fn), v8.to(torch.float8_e4m3fn), tables, qsl, ctx_t, 0.125,
                        ks, vs, window=window)
    assert_close(out, ref, torch.float16, "prefill window fp8", fresh_seed)


def _tree_mask(parents):
    n = len(parents)
    m = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            m[i, j] = True
            j = parents[j]
    return m


def test_prefill_window_tree_mask(device, fresh_seed):
    """Speculative verification with a window: a tree node sits at position ctx + depth, so its window
    reaches further back into the context than its slot (ctx + index) would; a chain alongside."""
    tree = _tree_mask([-1, 0, 0, 1, 2, 2, 0])      # depths 0 1 1 2 2 2 1
    chain = _tree_mask([-1, 0, 1])
    ctx, qlens, window = [50, 37], [7, 3], 10
    lens, qsl, ctx_t = _batch(ctx, qlens, device)
    k0, v0, tables0 = make_paged(lens, 16, 2, 64, torch.float16, device)
    k, v, tables, changed = _poison_before(k0, v0, tables0, [c - window + 1 for c in ctx])
    assert changed == 3   # sequence 0: blocks 0, 1 (tokens < 41); sequence 1: block 0 (tokens < 28)
    q = torch.randn(10, 8, 64, device=device).half()
    mask = torch.zeros(10, 7, dtype=torch.bool)
    mask[:7, :7] = tree
    mask[7:, :3] = chain
    mask = mask.to(device)
    out = paged_prefill(q, k, v, tables, qsl, ctx_t, 0.125, tree_mask=mask, window=window)
    ref = paged_prefill_ref(q, k, v, tables, qsl, ctx_t, 0.125, tree_mask=mask, window=window)
    assert_close(out, ref, torch.float16, "prefill window tree", fresh_seed)
    # the window hides context from every node (the tree's window case is not full attention)
    full = paged_prefill_ref(q, k0, v0, tables0, qsl, ctx_t, 0.125, tree_mask=mask)
    assert (full.float() - ref.float()).abs().amax(dim=(1, 2))[:7].min() > 1e-3


def test_window_rejects_bad_values(device):
    k, v, tables = make_paged([4], 16, 1, 64, torch.float16, device)
    q = torch.zeros(1, 2, 64, dtype=torch.float16, device=device)
    with pytest.raises(ValueError, match="window -3 must be None or an integer >= 0"):
        paged_decode(q, k, v, tables, torch.tensor([4], dtype=torch.int32, device=device), 1.0, window=-3)
    lens, qsl, ctx_t = _batch([0], [4], device)
    with pytest.raises(ValueError, match="window 2.5"):
        paged_prefill(q.expand(4, 2, 64).contiguous(), k, v, tables, qsl, ctx_t, 1.0, window=2.5)


class _Grids:
    """Stands in for a KernelSet: records each launch's grid and arguments, then lets it JIT."""
    def __init__(self):
        self.calls = []

    def launch(self, key, grid, args):
        self.calls.append((key, grid, args))
        return False


def test_decode_window_splits_share_out_the_window_not_the_sequence(monkeypatch, device, fresh_seed):
    """A long sequence with a short window is split as the window is (one 64-token tile here, where the
    full sequence would take 32 splits): the window's work does not grow with the context. With one
    split covering only the window's tiles, a right answer also shows the key loop starts there."""
    monkeypatch.setattr("plugins.paged_decode._target_programs", lambda dev, fp8=False: 1000)
    lens, window = [2000], 40
    k, v, tables = make_paged(lens, 16, 1, 64, torch.float16, device)
    k, v, tables, _ = _poison_before(k, v, tables, [lens[0] - window])
    q = torch.randn(1, 2, 64, device=device).half()
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    rec = _Grids()
    out = paged_decode(q, k, v, tables, seq_lens, 0.125, window=window, aot=rec)
    (key, grid, args), = rec.calls          # no reduction launch: a single split
    assert key.startswith("paged_decode_window_kernel") and grid[2] == 1 and args[-1] == window
    assert_close(out, paged_decode_ref(q, k, v, tables, seq_lens, 0.125, window=window), torch.float16,
                 "decode window, one split", fresh_seed)
    full = _Grids()
    k2, v2, t2 = make_paged(lens, 16, 1, 64, torch.float16, device)
    paged_decode(q, k2, v2, t2, seq_lens, 0.125, aot=full)
    assert full.calls[0][1][2] == 32         # the same context unwindowed: 2000 tokens in 64-token splits
