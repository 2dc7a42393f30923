"""Paged prefill / chunked-prefill attention vs reference: causal over cached context + new tokens,
mixed prefill and decode rows in one batch, empty and single-token sequences, EAGLE tree masks, fp8 KV,
head dims 64/128/256."""
import pytest
import torch

from plugins.paged_prefill import paged_prefill
from plugins.reference.attention import paged_prefill_ref
from tests.kernels.kernel_utils import assert_close, make_paged, to_fp8_cache


def _batch(ctx, qlens, device):
    lens = [c + q for c, q in zip(ctx, qlens)]
    qsl = torch.tensor([0] + list(torch.tensor(qlens).cumsum(0)), dtype=torch.int32, device=device)
    return lens, qsl, torch.tensor(ctx, dtype=torch.int32, device=device)


CASES = [  # (num_kv_heads, gqa, head_dim, block_size, context lens, query lens)
    (2, 1, 64, 16, [0, 0], [20, 1]),             # plain prefills, one single-token
    (1, 4, 64, 32, [33, 0, 7], [17, 40, 1]),      # chunked prefill after 33 cached tokens + a decode row
    (1, 8, 128, 64, [65, 3], [3, 1]),             # prefix-cache hit crossing a block boundary
    (3, 3, 64, 16, [0, 5, 9], [0, 18, 1]),        # an empty sequence in the middle; SmolLM2's head shape
    (1, 4, 256, 16, [20, 0], [9, 5]),             # Gemma 3's head dim
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("hkv,group,head_dim,block_size,ctx,qlens", CASES)
def test_prefill_matches_reference(device, fresh_seed, dtype, hkv, group, head_dim, block_size, ctx, qlens):
    lens, qsl, ctx_t = _batch(ctx, qlens, device)
    k, v, tables = make_paged(lens, block_size, hkv, head_dim, dtype, device)
    q = torch.randn(sum(qlens), hkv * group, head_dim, device=device).to(dtype)
    out = paged_prefill(q, k, v, tables, qsl, ctx_t, head_dim ** -0.5)
    ref = paged_prefill_ref(q, k, v, tables, qsl, ctx_t, head_dim ** -0.5)
    assert_close(out, ref, dtype, f"prefill ctx={ctx} q={qlens}", fresh_seed)


def _tree_mask(parents: list[int]) -> torch.Tensor:
    """Ancestor mask of a token tree given each node's parent index (-1 = root's parent: the context)."""
    n = len(parents)
    m = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            m[i, j] = True
            j = parents[j]
    return m


def test_prefill_tree_mask(device, fresh_seed):
    # sequence 0: a tree of 6 draft tokens after 21 cached ones; sequence 1: a 3-token chain after 4
    tree = _tree_mask([-1, 0, 0, 1, 2, 2])
    chain = _tree_mask([-1, 0, 1])
    ctx, qlens = [21, 4], [6, 3]
    lens, qsl, ctx_t = _batch(ctx, qlens, device)
    k, v, tables = make_paged(lens, 16, 2, 64, torch.float16, device)
    q = torch.randn(9, 8, 64, device=device).half()
    mask = torch.zeros(9, 6, dtype=torch.bool)
    mask[:6, :6] = tree
    mask[6:, :3] = chain
    mask = mask.to(device)
    out = paged_prefill(q, k, v, tables, qsl, ctx_t, 0.125, tree_mask=mask)
    ref = paged_prefill_ref(q, k, v, tables, qsl, ctx_t, 0.125, tree_mask=mask)
    assert_close(out, ref, torch.float16, "prefill tree", fresh_seed)
    causal = paged_prefill_ref(q, k, v, tables, qsl, ctx_t, 0.125)
    # node 2 (sibling of node 1) must not see node 1: the tree changes the result vs plain causal
    assert (ref[2].float() - causal[2].float()).abs().max() > 1e-3


def test_prefill_fp8_kv(device, fresh_seed):
    ctx, qlens = [19, 0], [5, 12]
    lens, qsl, ctx_t = _batch(ctx, qlens, device)
    k, v, tables = make_paged(lens, 16, 1, 64, torch.float32, device)
    k8, v8 = to_fp8_cache(k, 0.02), to_fp8_cache(v, 0.03)
    q = torch.randn(17, 4, 64, device=device).half()
    ks, vs = torch.tensor(0.02), torch.tensor(0.03)
    out = paged_prefill(q, k8, v8, tables, qsl, ctx_t, 0.125, ks, vs)
    ref = paged_prefill_ref(q, k8, v8, tables, qsl, ctx_t, 0.125, ks, vs)
    assert_close(out, ref, torch.float16, "prefill fp8", fresh_seed)


def test_prefill_rejects_bad_inputs(device):
    lens, qsl, ctx_t = _batch([0], [4], device)
    k, v, tables = make_paged(lens, 16, 1, 64, torch.float16, device)
    q = torch.zeros(4, 2, 64, dtype=torch.float16, device=device)
    with pytest.raises(ValueError, match="tree_mask shape"):
        paged_prefill(q, k, v, tables, qsl, ctx_t, 1.0, tree_mask=torch.ones(3, 4, dtype=torch.bool, device=device))
    with pytest.raises(ValueError, match="context_lens"):
        paged_prefill(q, k, v, tables, qsl, ctx_t.repeat(2), 1.0)
