"""Growing draft trees with a (random, tiny) EAGLE-3 head: shapes, and tree attention inside the
draft equals running each path on its own."""
import pytest
import torch

from backend.speculative.checkpoint import DraftConfig
from backend.speculative.draft_model import Eagle3Draft
from backend.speculative.grow import TreeGrower
from backend.speculative.tree import static_shape

H, V = 32, 64


@pytest.fixture(scope="module")
def draft():
    g = torch.Generator().manual_seed(0)
    cfg = DraftConfig(hidden_size=H, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64,
                      vocab_size=V, draft_vocab_size=V, rms_norm_eps=1e-5, rope_theta=10000.0,
                      aux_layers=(0, 1, 2), has_lm_head=True, dtype="float32")
    shapes = {"fc.weight": (H, 3 * H), "norm.weight": (H,), "lm_head.weight": (V, H),
              "layers.0.input_layernorm.weight": (H,), "layers.0.hidden_norm.weight": (H,),
              "layers.0.post_attention_layernorm.weight": (H,),
              "layers.0.self_attn.q_proj.weight": (32, 2 * H), "layers.0.self_attn.k_proj.weight": (16, 2 * H),
              "layers.0.self_attn.v_proj.weight": (16, 2 * H), "layers.0.self_attn.o_proj.weight": (H, 32),
              "layers.0.mlp.gate_proj.weight": (64, H), "layers.0.mlp.up_proj.weight": (64, H),
              "layers.0.mlp.down_proj.weight": (H, 64)}
    t = {k: (1 + 0.1 * torch.randn(s, generator=g)) if len(s) == 1 else torch.randn(s, generator=g) * 0.3
         for k, s in shapes.items()}
    return Eagle3Draft(cfg, t, torch.randn(V, H, generator=g), None, 256, "cpu", torch.float32)


def committed(draft, n=6):
    g = torch.Generator().manual_seed(1)
    cache = draft.new_cache(4)
    feats = draft.fuse(torch.randn(n, 3 * H, generator=g))
    h = draft.step(feats, torch.randint(0, V, (n,), generator=g), torch.arange(n), cache, 0)
    cache.length = n
    return cache, h[-1:]


def chain_by_hand(draft, cache, last, root_pos, k):
    """Greedy chain with one draft call per token and default (causal) masks."""
    toks, h, written = [], last, 0
    for d in range(1, k + 1):
        t = int(draft.logits(h).argmax(-1))
        toks.append(t)
        if d == k:
            break
        h = draft.step(h, torch.tensor([t]), torch.tensor([root_pos + d - 1]), cache, cache.length + written)
        written += 1
    return toks


def test_chain_matches_step_by_step(draft):
    cache, last = committed(draft)
    tree = TreeGrower.from_settings(draft, "chain", 4, 0, 0, None).grow(cache, last, 5, 6)
    assert tree.is_chain() and tree.num_nodes == 5 and cache.length == 6
    assert list(tree.tokens[1:]) == chain_by_hand(draft, cache, last, 6, 4)


def test_static_tree_paths_equal_their_own_chains(draft):
    # Every root-to-leaf path of a tree grown with tree attention must equal the same path grown
    # alone: siblings must not see each other inside the draft.
    cache, last = committed(draft)
    choices = [[0], [1], [0, 0], [1, 0], [0, 0, 0], [1, 0, 0]]
    tree = TreeGrower.from_settings(draft, "static", 0, 0, 0, choices).grow(cache, last, 5, 6)
    assert tree.num_nodes == 1 + len(choices)
    assert tree.parents == static_shape(choices).parents
    # Best-child path == the greedy chain.
    best = [tree.tokens[i] for i in tree.ancestors(5)[1:]]
    assert best == chain_by_hand(draft, cache, last, 6, 3)
    # The rank-1 branch: force its first token, then greedy.
    t1 = tree.tokens[2]
    h = draft.step(last, torch.tensor([t1]), torch.tensor([6]), cache, cache.length)
    t2 = int(draft.logits(h).argmax(-1))
    h = draft.step(h, torch.tensor([t2]), torch.tensor([7]), cache, cache.length + 1)
    t3 = int(draft.logits(h).argmax(-1))
    assert [tree.tokens[i] for i in tree.ancestors(6)] == [5, t1, t2, t3]


def test_dynamic_tree_is_within_budget_and_well_formed(draft):
    cache, last = committed(draft)
    tree = TreeGrower.from_settings(draft, "dynamic", 0, 3, 3, None).grow(cache, last, 5, 6)
    assert 1 < tree.num_nodes <= 1 + 3 * 3
    assert max(tree.depths) <= 3
    for node in range(tree.num_nodes):   # siblings are distinct tokens
        kids = [tree.tokens[c] for c in tree.children(node)]
        assert len(kids) == len(set(kids))


def test_unknown_tree_kind_is_refused(draft):
    with pytest.raises(ValueError, match="speculative.tree: 'bush'"):
        TreeGrower.from_settings(draft, "bush", 4, 4, 4, None)


@pytest.mark.parametrize("kind, settings", [
    ("chain", (4, 0, 0, None)),
    ("static", (0, 0, 0, [[0], [1], [0, 0], [1, 0], [0, 0, 0]])),
    ("dynamic", (0, 3, 3, None)),
], ids=["chain", "static", "dynamic"])
def test_batched_growth_equals_one_sequence_at_a_time(draft, kind, settings):
    # Sequences of different lengths in one batched call: each tree must be exactly the tree grown
    # alone (nothing leaks between the sequences' caches or masks).
    from backend.speculative.grow import GrowRequest

    grower = TreeGrower.from_settings(draft, kind, *settings)
    reqs = []
    for n, root in ((6, 5), (3, 7), (9, 1)):
        cache, last = committed(draft, n)
        reqs.append(GrowRequest(cache, last, root, n))
    alone = [grower.grow(r.cache, r.last_out, r.root_token, r.root_pos) for r in reqs]
    together = grower.grow_many(reqs)
    assert together == alone
    assert all(r.cache.length == n for r, n in zip(reqs, (6, 3, 9)))   # nothing committed


def test_batched_step_equals_per_sequence_steps(draft):
    from backend.speculative.draft_model import DraftSlice

    g = torch.Generator().manual_seed(3)
    caches = [committed(draft, n)[0] for n in (4, 7)]
    feats = torch.randn(5, H, generator=g)
    toks = torch.randint(0, V, (5,), generator=g)
    pos = torch.tensor([4, 5, 7, 8, 9])
    alone = torch.cat([draft.step(feats[:2], toks[:2], pos[:2], caches[0], 4),
                       draft.step(feats[2:], toks[2:], pos[2:], caches[1], 7)])
    together = draft.step_many(feats, toks, pos, [DraftSlice(2, caches[0], 4), DraftSlice(3, caches[1], 7)])
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-5)


def chain_probs(draft, cache, last, root_pos, k):
    """The draft's probability of each token of the greedy chain, step by step."""
    probs, h, written = [], last, 0
    for d in range(1, k + 1):
        p = draft.logits(h).softmax(-1)
        t = int(p.argmax(-1))
        probs.append(float(p[0, t]))
        if d == k:
            break
        h = draft.step(h, torch.tensor([t]), torch.tensor([root_pos + d - 1]), cache, cache.length + written)
        written += 1
    return probs


@pytest.mark.parametrize("n, root", [(6, 5), (3, 7), (9, 1)])
def test_min_draft_prob_cuts_the_chain_where_its_confidence_falls(draft, n, root):
    from backend.speculative.grow import GrowRequest

    cache, last = committed(draft, n)
    full = TreeGrower.from_settings(draft, "chain", 4, 0, 0, None).grow(cache, last, root, n)
    probs = chain_probs(draft, cache, last, n, 4)
    cum = torch.tensor(probs).cumprod(0).tolist()
    for threshold in (0.0, cum[1] - 1e-6, cum[1] + 1e-6, 0.999):
        want = next((i for i, c in enumerate(cum) if c < threshold), 4)   # tokens kept
        got = TreeGrower.from_settings(draft, "chain", 4, 0, 0, None, threshold).grow_many(
            [GrowRequest(cache, last, root, n)])[0]
        assert got.is_chain() and got.tokens == full.tokens[:1 + want], (threshold, cum)
    with pytest.raises(ValueError, match="min_draft_prob: only for tree: chain"):
        TreeGrower.from_settings(draft, "dynamic", 0, 3, 3, None, 0.5)
