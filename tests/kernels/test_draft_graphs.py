"""The CUDA-graphed chain draft (backend/speculative/draft_graphs.py) proposes exactly the eager grower's
chains: same tokens, same confidence cut, from pooled caches read through the paged-decode kernel.

On CPU the graph's padded static-buffer code runs eagerly with the kernel under Triton's interpreter;
on a GPU it is captured and replayed."""
from __future__ import annotations

import pytest
import torch

from harness.perf.lib import models
from backend.speculative.draft_graphs import ChainDraftGraphs
from backend.speculative.draft_model import DraftKVPool, DraftSlice, Eagle3Draft
from backend.speculative.grow import GrowRequest, TreeGrower

SHAPE = dict(hidden_size=128, intermediate_size=256, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32,
             vocab_size=512, rms_norm_eps=1e-5, rope_theta=500000.0)
K = 4


@pytest.fixture(scope="module")
def draft(device):
    cfg, t = models.random_draft(SHAPE, 256, device="cpu", seed=2, std=0.3)   # peaky: real cuts
    embed = torch.randn(SHAPE["vocab_size"], SHAPE["hidden_size"], generator=torch.Generator().manual_seed(3))
    return Eagle3Draft(cfg, t, embed, None, 1024, device, torch.float32)


def _requests(draft, pool, lens, seed):
    """Sequences with committed draft history of different lengths (one batched committed step)."""
    g = torch.Generator().manual_seed(seed)
    dev, h = draft.device, draft.cfg.hidden_size
    reqs, slices, n = [], [], sum(lens)
    caches = [pool.acquire() if pool is not None else draft.new_cache() for _ in lens]
    for c, m in zip(caches, lens):
        slices.append(DraftSlice(m, c, c.length))
    feats = torch.randn(n, h, generator=g).to(dev)
    toks = torch.randint(0, SHAPE["vocab_size"], (n,), generator=g).to(dev)
    pos = torch.cat([torch.arange(m) for m in lens]).to(dev)
    out = draft.step_many(feats, toks, pos, slices)
    end = 0
    for c, m in zip(caches, lens):
        end += m
        c.length = m
        reqs.append(GrowRequest(c, out[end - 1:end], int(toks[end - 1]), m))
    return reqs


@pytest.mark.parametrize("min_prob", [0.0, 0.2])
def test_graphed_chain_equals_eager(draft, device, min_prob):
    lens = [5, 12, 1, 30, 7]
    eager = TreeGrower.from_settings(draft, "chain", K, 1, K, None, min_prob)
    want = eager.grow_many(_requests(draft, None, lens, seed=4))

    pool = DraftKVPool(8, 128, draft.cfg.num_kv_heads, draft.cfg.head_dim, draft.dtype, draft.device)
    pool.k.normal_(0, 10)     # garbage where nothing was written: reading a wrong row must show
    pool.v.normal_(0, 10)
    graphed = TreeGrower.from_settings(draft, "chain", K, 1, K, None, min_prob)
    graphed.graphs = ChainDraftGraphs(draft, pool, K, 8, capture=device == "cuda")
    reqs = _requests(draft, pool, lens, seed=4)
    got = graphed.grow_many(reqs)
    assert graphed.graphs.runs == 1 and graphed.graphs.failed is None
    assert [t.tokens for t in got] == [t.tokens for t in want]
    assert [t.parents for t in got] == [t.parents for t in want]
    if min_prob:
        assert len({t.num_nodes for t in want}) > 1, "the threshold must cut chains at different depths"
    else:
        assert all(t.num_nodes == K + 1 for t in want)
    # a second, smaller batch on the same graphs (another bucket, padded rows in the scratch slot)
    # still matches, and the committed rows of the first batch's caches were left alone
    before = [r.cache.k[:r.cache.length].clone() for r in reqs]
    got2 = graphed.grow_many(reqs[:3])
    assert [t.tokens for t in got2] == [t.tokens for t in want[:3]]
    for r, b in zip(reqs, before):
        assert torch.equal(r.cache.k[:r.cache.length], b)
    assert bool(graphed.graphs.graphs) == (device == "cuda")


def test_pool_slots_are_reused_and_exhaustion_falls_back():
    pool2 = DraftKVPool(2, 40, 2, 32, torch.float32, torch.device("cpu"))
    a, b = pool2.acquire(), pool2.acquire()
    assert pool2.capacity == 48 and {a.slot, b.slot} == {0, 1} and pool2.acquire() is None
    pool2.release(a)
    pool2.release(a)            # twice: ignored
    c = pool2.acquire()
    assert c.slot == 0 and pool2.acquire() is None
    with pytest.raises(ValueError, match="exceed the pool's 48"):
        c.ensure(49)


def test_speculators_of_one_draft_share_its_chain_graphs(draft):
    pool = draft.kv_pool(4, 64)
    a = ChainDraftGraphs.shared(draft, pool, K, 4, capture=False)
    assert ChainDraftGraphs.shared(draft, pool, K, 4, capture=False) is a
    assert ChainDraftGraphs.shared(draft, pool, K + 1, 4, capture=False) is not a


def test_a_cache_too_full_for_the_chain_takes_the_eager_path(draft):
    pool = DraftKVPool(2, 40, draft.cfg.num_kv_heads, draft.cfg.head_dim, draft.dtype, draft.device)
    graphs = ChainDraftGraphs(draft, pool, K, 2, capture=False)
    # capacity 48: a chain of K writes K - 1 rows past the committed ones, a commit step 1 more first
    (req,) = _requests(draft, pool, [48 - (K - 1) - 1], seed=5)
    assert graphs.usable([req]) and graphs.commit_usable([1], [req.cache])
    req.cache.length += 1
    assert graphs.usable([req]) and not graphs.commit_usable([1], [req.cache])
    req.cache.length += 1
    assert not graphs.usable([req])
