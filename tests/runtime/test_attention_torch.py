"""The PyTorch paged attention backend against a naive per-token reference (no model).

On CPU in float32 the backend hands every row to the C attention kernel (plugins/cpu/attention.c);
elsewhere, or without the kernels, it attends in tiles. ``path`` runs a test both ways; ``tiles``
pins what only the tiles do (their block slicing, the fp8-byte cache they share numbers with)."""
from __future__ import annotations

import math

import pytest
import torch

from backend.ops.attention import get_backend, resolve_backend_name
from backend.ops.attention.metadata import AttentionMetadata

BS, HKV, HQ, D = 4, 2, 6, 16


@pytest.fixture
def tiles():
    """The tile path on this CPU: the C attention kernel set apart (the elementwise kernels stay)."""
    from plugins.cpu import ops
    with ops.using(ops.library(), attention=None):
        yield


@pytest.fixture(params=["kernel", "tiles"])
def path(request):
    from plugins.cpu import ops
    if request.param == "kernel":
        assert ops.library() is not None, "plugins/cpu: the CPU kernels did not build or load"
        yield request.param
    else:
        with ops.using(ops.library(), attention=None):
            yield request.param


def _setup(ctx, qlens, num_prefills, kv_dtype=torch.float32, scale=None, tree=None, seed=0, fp8_as_float=False,
           hq=HQ, hkv=HKV, d=D):
    g = torch.Generator().manual_seed(seed)
    nb_per = [-(-(c + n) // BS) for c, n in zip(ctx, qlens)]
    tables, nxt = [], 1  # block 0 stays unused: padding in tables points at it
    for n in nb_per:
        tables.append(list(range(nxt + n - 1, nxt - 1, -1)))  # reversed: tables really matter
        nxt += n
    width = max(nb_per)
    kc = torch.zeros(nxt, BS, hkv, d, dtype=kv_dtype)
    vc = torch.zeros_like(kc)
    full_k = [torch.randn(c + n, hkv, d, generator=g) for c, n in zip(ctx, qlens)]
    full_v = [torch.randn(c + n, hkv, d, generator=g) for c, n in zip(ctx, qlens)]
    be = get_backend("torch")
    be.fp8_as_float = fp8_as_float

    def slot(b, p):
        return tables[b][p // BS] * BS + p % BS

    # Context tokens written through the backend too (one "earlier step").
    pre = [(b, p) for b in range(len(ctx)) for p in range(ctx[b])]
    if pre:
        be.write_kv(torch.stack([full_k[b][p] for b, p in pre]), torch.stack([full_v[b][p] for b, p in pre]),
                    kc, vc, torch.tensor([slot(b, p) for b, p in pre]), scale, scale)
    new = [(b, p) for b in range(len(ctx)) for p in range(ctx[b], ctx[b] + qlens[b])]
    slots = [slot(b, p) for b, p in new] + [-1]  # plus one padding token that must be skipped
    k_new = torch.stack([full_k[b][p] for b, p in new] + [torch.full((hkv, d), 99.0)])
    v_new = torch.stack([full_v[b][p] for b, p in new] + [torch.full((hkv, d), 99.0)])
    be.write_kv(k_new, v_new, kc, vc, torch.tensor(slots), scale, scale)
    qsl = [0]
    for n in qlens:
        qsl.append(qsl[-1] + n)
    i32 = torch.int32
    meta = AttentionMetadata(
        positions=torch.tensor([p for _, p in new]), slot_mapping=torch.tensor(slots[:-1]),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=i32),
        seq_lens=torch.tensor([c + n for c, n in zip(ctx, qlens)], dtype=i32),
        query_start_loc=torch.tensor(qsl, dtype=i32), context_lens=torch.tensor(ctx, dtype=i32),
        num_prefills=num_prefills, num_prefill_tokens=qsl[num_prefills],
        num_decode_tokens=qsl[-1] - qsl[num_prefills], max_query_len=max(qlens),
        max_seq_len=max(c + n for c, n in zip(ctx, qlens)), tree_mask=tree)
    q = torch.randn(qsl[-1], hq, d, generator=g)
    return be, q, kc, vc, meta, full_k, full_v


def _reference(q, full_k, full_v, ctx, qlens, tree=None, window=None):
    outs, t = [], 0
    for b, (c, n) in enumerate(zip(ctx, qlens)):
        k = full_k[b].repeat_interleave(HQ // HKV, 1)
        v = full_v[b].repeat_interleave(HQ // HKV, 1)
        for i in range(n):
            visible = torch.zeros(c + n, dtype=torch.bool)
            visible[:c + i + 1] = True
            if window is not None:   # transformers' sliding_window_overlay: key > query position - window
                visible[:max(0, c + i + 1 - window)] = False
            if tree is not None:
                visible[c:c + n] &= tree[t, :n]
            s = torch.einsum("hd,khd->hk", q[t], k) / math.sqrt(D)
            s[:, ~visible] = float("-inf")
            outs.append(torch.einsum("hk,khd->hd", s.softmax(-1), v))
            t += 1
    return torch.stack(outs)


@pytest.mark.parametrize("ctx, qlens, num_prefills", [
    ([0], [9], 1),                       # plain prefill
    ([5, 0], [7, 3], 2),                 # chunked prefill continuing after cached context
    ([5, 11, 3, 0], [6, 1, 1, 1], 1),    # prefill mixed with decodes (ragged contexts)
    ([2, 7], [3, 2], 0),                 # ragged decode-like queries (speculative verification)
])
def test_matches_reference(ctx, qlens, num_prefills, path):
    be, q, kc, vc, meta, fk, fv = _setup(ctx, qlens, num_prefills)
    out = be.forward(q, kc, vc, meta, 1 / math.sqrt(D))
    torch.testing.assert_close(out, _reference(q, fk, fv, ctx, qlens), atol=1e-5, rtol=1e-5)
    assert not (kc == 99.0).any(), "slot -1 must be skipped, not written"


@pytest.mark.parametrize("ctx, qlens, num_prefills", [
    ([0], [21], 1),                      # a prefill longer than the window
    ([13, 0], [9, 3], 2),                # chunked prefill: the window reaches back into cached blocks
    ([17, 6, 2], [4, 1, 1], 1),          # a prefill with decodes, contexts past and within the window
    ([30, 9], [1, 1], 0),                # plain decode rows (the folded tiles)
])
def test_a_sliding_window_sees_the_last_window_positions(ctx, qlens, num_prefills, path):
    window = 5
    be, q, kc, vc, meta, fk, fv = _setup(ctx, qlens, num_prefills)
    out = be.forward(q, kc, vc, meta, 1 / math.sqrt(D), window=window)
    torch.testing.assert_close(out, _reference(q, fk, fv, ctx, qlens, window=window), atol=1e-5, rtol=1e-5)
    # the same step's full-attention layer (its plan cached beside the window's) is unchanged
    torch.testing.assert_close(be.forward(q, kc, vc, meta, 1 / math.sqrt(D)), _reference(q, fk, fv, ctx, qlens),
                               atol=1e-5, rtol=1e-5)


def test_tree_mask_restricts_same_step_tokens(path):
    ctx, qlens = [6, 4], [4, 3]
    # Seq 0: tokens 1 and 2 are siblings (both children of 0), token 3 is a child of 2.
    tree = torch.zeros(7, 4, dtype=torch.bool)
    for t, allowed in enumerate([[0], [0, 1], [0, 2], [0, 2, 3]]):
        tree[t, allowed] = True
    for t, allowed in enumerate([[0], [0, 1], [0, 1, 2]]):  # seq 1: a chain
        tree[4 + t, allowed] = True
    be, q, kc, vc, meta, fk, fv = _setup(ctx, qlens, 0, tree=tree)
    out = be.forward(q, kc, vc, meta, 1 / math.sqrt(D))
    ref = _reference(q, fk, fv, ctx, qlens, tree)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    plain = _reference(q, fk, fv, ctx, qlens)
    assert not torch.allclose(out[3], plain[3]), "the tree must change token 3's attention"


def test_fp8_cache_stores_scaled_values_and_dequantizes():
    ctx, qlens = [5, 3], [3, 1]
    scale = torch.tensor(0.05)
    be, q, kc, vc, meta, fk, fv = _setup(ctx, qlens, 1, kv_dtype=torch.float8_e4m3fn, scale=scale)
    assert kc.dtype == torch.float8_e4m3fn
    out = be.forward(q, kc, vc, meta, 1 / math.sqrt(D), scale, scale)
    # Exactly what the cache holds: values rounded to e4m3 at x / scale, times scale.
    def rounded(xs):
        return [(x / scale).to(torch.float8_e4m3fn).float() * scale for x in xs]
    ref = _reference(q, rounded(fk), rounded(fv), ctx, qlens)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # ... and e4m3 keeps about two significant digits of the original.
    assert (out - _reference(q, fk, fv, ctx, qlens)).abs().mean() < 0.03


def test_fp8_values_kept_in_float_storage_attend_exactly_like_the_fp8_cache(tiles):
    """The runner's CPU layout for fp8 KV: float tensors holding the dequantized fp8 values. Same
    numbers in, same numbers out, bit for bit, as storing fp8 bytes and dequantizing at read time
    (on the tiles, which take both; the C kernel reads float32 caches only)."""
    ctx, qlens = [9, 0, 30], [4, 6, 1]
    scale = torch.tensor(0.07)
    be8, q, kc8, vc8, meta, _, _ = _setup(ctx, qlens, 1, kv_dtype=torch.float8_e4m3fn, scale=scale)
    bef, _, kcf, vcf, _, _, _ = _setup(ctx, qlens, 1, kv_dtype=torch.float32, scale=scale, fp8_as_float=True)
    assert kcf.dtype == torch.float32
    from backend.ops.attention.torch_backend import dequantize_kv
    assert torch.equal(kcf, dequantize_kv(kc8, scale, torch.float32))
    assert torch.equal(vcf, dequantize_kv(vc8, scale, torch.float32))
    out8 = be8.forward(q, kc8, vc8, meta, 1 / math.sqrt(D), scale, scale)
    outf = bef.forward(q, kcf, vcf, meta, 1 / math.sqrt(D), scale, scale)
    assert torch.equal(out8, outf)
    # without the flag a float cache keeps full precision: the flag is what rounds
    _, _, kc32, _, _, _, _ = _setup(ctx, qlens, 1, kv_dtype=torch.float32, scale=scale)
    assert not torch.equal(kc32, kcf)


def test_runner_stores_an_fp8_cache_as_float_on_cpu(tmp_path):
    from harness.perf.lib import models
    from backend.runtime.native import ModelRunner
    from backend.runtime.spec import load_engine_spec
    m = dict(models.LLAMA31_8B, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
             num_kv_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=256)
    engine = {"max_batch_size": 2, "max_seq_len": 64, "kv_block_size": 16, "kv_cache_dtype": "fp8_e4m3",
              "max_kv_tokens": 256}
    path = models.manifest_bundle(m, engine, tmp_path / "engine")
    w = models.synthetic_fp8_weights(m, device="cpu")
    runner = ModelRunner(load_engine_spec(path), "cpu", torch.float32, weights=w)
    assert runner.kv_dtype == torch.float8_e4m3fn and runner.kv_storage_dtype == torch.float32
    assert runner.kv_caches[0][0].dtype == torch.float32 and runner.attention.fp8_as_float
    # a float32 override of the same bundle is a plain float cache: nothing rounded to fp8
    plain = ModelRunner(load_engine_spec(path, {"kv_cache_dtype": "float32"}), "cpu", torch.float32, weights=w)
    assert plain.kv_storage_dtype == torch.float32 and not plain.attention.fp8_as_float


def test_registry_resolves_and_rejects():
    assert resolve_backend_name("auto", "cpu") == "torch"
    assert resolve_backend_name("auto", "cuda") == "triton"
    with pytest.raises(ValueError, match="engine.attention_backend: unknown backend 'flash'"):
        resolve_backend_name("flash", "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_dequantization_table_gives_the_conversions_bits(dtype):
    """The CPU path gathers scaled values by byte; it must equal fp8 -> float32 -> x scale -> dtype
    for every code (NaN codes stay NaN) and keep the tensor's shape."""
    from backend.ops.attention.torch_backend import FP8_KV_DTYPE, dequantize_kv
    codes = torch.arange(256, dtype=torch.uint8).repeat(3).view(2, 3, 8, 16).view(FP8_KV_DTYPE)
    scale = torch.tensor(0.0371)
    got = dequantize_kv(codes, scale, dtype)
    want = (codes.float() * scale).to(dtype)
    assert got.shape == codes.shape and got.dtype == dtype
    assert torch.equal(got.isnan(), want.isnan()) and int(got.isnan().sum()) == 2 * 3  # 0x7f, 0xff in each repeat
    assert torch.equal(got.nan_to_num(), want.nan_to_num())


@pytest.mark.parametrize("hq,hkv,d", [(HQ, HKV, D), (9, 3, 64), (32, 8, 128)])
def test_folded_decode_rows_equal_their_prefill_rows_bit_for_bit(hq, hkv, d, path):
    """On CPU a plain decode step attends each KV head's query heads as the rows of one tile (the
    module docstring): its outputs are those of the same rows attended as prefill tokens (8-row position
    tiles, GQA), bit for bit, at key lengths across several KEY_BUCKETs. The batch-invariance contract
    rests on it; a torch whose CPU kernel computes a 4-row tile differently fails here."""
    import dataclasses

    from backend.ops.attention import torch_backend as tb
    ctx = [3, 130, 257, 40, 700]
    be, q, kc, vc, meta, _, _ = _setup(ctx, [1] * len(ctx), 0, seed=7, hq=hq, hkv=hkv, d=d)
    assert [grp.folded for grp in tb.TorchAttentionBackend._make_plan(meta, BS, kc.shape[0], q.device)] == [True]
    decode = be.forward(q, kc, vc, meta, 0.125)
    # the same rows as one-token prefills: each in its own 8-row position tile, unfolded
    as_prefill = dataclasses.replace(meta, num_prefills=len(ctx), num_prefill_tokens=len(ctx), num_decode_tokens=0)
    assert not any(grp.folded for grp in tb.TorchAttentionBackend._make_plan(as_prefill, BS, kc.shape[0], q.device))
    assert torch.equal(decode, be.forward(q, kc, vc, as_prefill, 0.125))


@pytest.mark.parametrize("ctx,qlen,num_prefills", [(0, 37, 1), (21, 5, 1), (40, 1, 0), (3, 1, 0)])
def test_a_lone_sequences_consecutive_blocks_are_read_in_place_with_the_same_bits(ctx, qlen, num_prefills, monkeypatch,
                                                                                 tiles):
    """A prefill, or a lone decode row, whose blocks are consecutive reads them as a slice of the
    cache instead of copying them; the blocks past its own (where a copy reads padding block 0) then
    hold whatever the cache holds there, here other data: masked, so bit for bit the copy's numbers."""
    import backend.ops.attention.torch_backend as tb
    g = torch.Generator().manual_seed(5)
    n_blocks = -(-(ctx + qlen) // BS)
    num_blocks = 1 + n_blocks + 40          # room for the slice's padding blocks after the sequence's
    kc = torch.randn(num_blocks, BS, HKV, D, generator=g)   # stale data everywhere, finite
    vc = torch.randn(num_blocks, BS, HKV, D, generator=g)
    i32 = torch.int32
    width = 64
    table = list(range(1, 1 + n_blocks)) + [0] * (width - n_blocks)
    meta = AttentionMetadata(
        positions=torch.arange(ctx, ctx + qlen), slot_mapping=torch.arange(ctx, ctx + qlen) + BS,
        block_tables=torch.tensor([table], dtype=i32), seq_lens=torch.tensor([ctx + qlen], dtype=i32),
        query_start_loc=torch.tensor([0, qlen], dtype=i32), context_lens=torch.tensor([ctx], dtype=i32),
        num_prefills=num_prefills, num_prefill_tokens=qlen if num_prefills else 0,
        num_decode_tokens=0 if num_prefills else qlen, max_query_len=qlen, max_seq_len=ctx + qlen)
    q = torch.randn(qlen, HQ, D, generator=g)
    kinds = []
    real = tb._gather
    monkeypatch.setattr(tb, "_gather", lambda c, b, run=None: kinds.append(run is not None) or real(c, b, run))
    sliced = get_backend("torch").forward(q, kc, vc, meta, 1 / math.sqrt(D))
    assert kinds and all(kinds)
    kinds.clear()
    monkeypatch.setattr(tb, "_slice_of_cache", lambda *a: None)
    copied = get_backend("torch").forward(q, kc, vc, meta, 1 / math.sqrt(D))
    assert kinds and not any(kinds)
    assert torch.equal(sliced, copied)


def test_blocks_that_are_not_a_run_or_run_past_the_cache_are_copied():
    import backend.ops.attention.torch_backend as tb
    t = torch.tensor
    assert tb._slice_of_cache(t([4, 5, 6, 0, 0]), 3, 16) == (4, 5)
    assert tb._slice_of_cache(t([4, 6, 7, 0]), 3, 16) is None       # not consecutive
    assert tb._slice_of_cache(t([4, 5, 6, 0, 0]), 3, 8) is None      # 4 + 5 blocks > the cache's 8
    assert tb._slice_of_cache(t([9]), 1, 10) == (9, 1)
