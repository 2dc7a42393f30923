"""EAGLE tree logic (pure Python): shapes, masks, positions, accepted paths, dynamic selection."""
import importlib
import sys

import pytest

from backend.speculative.tree import (DynamicCandidate, TokenTree, chain_shape, fill_shape, greedy_accept,
                               max_rank, select_dynamic, static_shape)


def test_tree_module_imports_no_torch():
    # The tree logic is part of the pure core: it must load where torch is unavailable.
    saved = {k: sys.modules.pop(k) for k in list(sys.modules) if k == "torch" or k.startswith("torch.")}
    sys.modules["torch"] = None  # any "import torch" now raises ImportError
    try:
        sys.modules.pop("backend.speculative.tree", None)
        importlib.import_module("backend.speculative.tree")
    finally:
        del sys.modules["torch"]
        sys.modules.update(saved)


def test_static_shape_orders_breadth_first_and_links_parents():
    s = static_shape([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    assert s.parents == (-1, 0, 0, 1, 1, 2, 3)
    assert s.ranks == (0, 0, 1, 0, 1, 0, 0)
    assert s.depth == 3
    assert max_rank(s) == 2
    assert s.children(1) == [3, 4]


@pytest.mark.parametrize("choices, msg", [
    ([[0], [0]], "listed twice"),
    ([[0, 1]], "no parent path"),
    ([[]], "non-empty"),
    ([[-1]], "non-empty"),
])
def test_static_shape_rejects_bad_choices(choices, msg):
    with pytest.raises(ValueError, match=msg):
        static_shape(choices)


def test_mask_and_positions_follow_ancestry():
    # root -> a(1) -> c(3); root -> b(2)
    t = TokenTree(tokens=(10, 11, 12, 13), parents=(-1, 0, 0, 1))
    m = t.attention_mask()
    assert m[3] == [True, True, False, True]   # c sees root, a, itself; not its uncle b
    assert m[2] == [True, False, True, False]
    assert t.positions(100) == [100, 101, 101, 102]
    assert t.ancestors(3) == [0, 1, 3]


def test_greedy_accept_longest_matching_path():
    t = TokenTree(tokens=(10, 11, 12, 13, 14), parents=(-1, 0, 0, 1, 2))
    # target after root says 12 (second child), after node 2 says 14, after node 4 says 99
    path, bonus = greedy_accept(t, [12, 0, 14, 0, 99])
    assert path == [0, 2, 4] and bonus == 99
    path, bonus = greedy_accept(t, [7, 0, 0, 0, 0])  # nothing accepted: bonus is the target's token
    assert path == [0] and bonus == 7


def test_single_path_tree_is_a_chain():
    chain = fill_shape(chain_shape(3), 5, {0: [6], 1: [7], 2: [8]})
    single = fill_shape(static_shape([[0], [0, 0], [0, 0, 0]]), 5, {0: [6], 1: [7], 2: [8]})
    assert chain == single and chain.is_chain()
    assert chain.attention_mask() == [[j <= i for j in range(4)] for i in range(4)]
    for target in ([6, 7, 8, 9], [6, 7, 1, 1], [2, 2, 2, 2]):
        assert greedy_accept(chain, target) == greedy_accept(single, target)


def test_select_dynamic_keeps_best_and_their_ancestors():
    c = [DynamicCandidate(1, -1, -0.1, 1), DynamicCandidate(2, -1, -2.0, 1),
         DynamicCandidate(3, 0, -0.3, 2), DynamicCandidate(4, 0, -3.0, 2),
         DynamicCandidate(5, 2, -0.5, 3)]
    tree, kept = select_dynamic(c, 0, budget=3)
    assert tree.tokens == (0, 1, 3, 5) and tree.parents == (-1, 0, 1, 2)
    tree, _ = select_dynamic(c, 0, budget=10)
    assert tree.num_nodes == 6
    for i in range(1, tree.num_nodes):  # topological order holds
        assert tree.parents[i] < i


def test_truncated_topological_prefix_is_still_a_tree():
    t = fill_shape(static_shape([[0], [1], [0, 0], [1, 0]]), 1, {0: [2, 3], 1: [4], 2: [5]})
    for n in range(1, t.num_nodes + 1):
        sub = TokenTree(t.tokens[:n], t.parents[:n])   # would assert if a parent were missing
        assert sub.num_nodes == n
