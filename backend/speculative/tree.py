"""EAGLE token trees: shapes, attention masks, positions and the accepted path. No torch.

A tree holds the candidates verified for ONE sequence in one target pass. Node 0 is the root: the
last committed token (sampled by the previous step, its KV not yet written). Every other node is a
draft token whose parent is the token before it. Nodes are stored in topological order
(``parents[i] < i``) so the attention backends' causal rule (a query never sees a later slot of its
own step) is compatible with the tree rule (a query sees exactly its ancestors and itself).

Three shapes, one representation:
- chain: each node has one child (``parents = (-1, 0, 1, 2, ...)``);
- static: fixed topology from ``tree_choices`` (paths of child ranks, e.g. ``[[0], [1], [0, 0]]``:
  root's best and second-best child, and the best child of the best child), filled by the draft's
  top-k at each depth;
- dynamic: EAGLE-2 style, grown by the draft's cumulative log-probabilities (``grow_dynamic``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence


@dataclass(frozen=True)
class TreeShape:
    """A topology without tokens: ``parents[i]`` is node i's parent (-1 for the root) and
    ``ranks[i]`` says node i is its parent's ``ranks[i]``-th most likely draft child."""

    parents: tuple[int, ...]
    ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        assert len(self.parents) == len(self.ranks) >= 1
        assert self.parents[0] == -1
        assert all(0 <= p < i for i, p in enumerate(self.parents) if i), "not topologically ordered"

    @property
    def num_nodes(self) -> int:
        return len(self.parents)

    @property
    def depth(self) -> int:
        return max(_depths(self.parents))

    def nodes_at_depth(self, d: int) -> list[int]:
        return [i for i, dd in enumerate(_depths(self.parents)) if dd == d]

    def children(self, node: int) -> list[int]:
        """Children of ``node`` ordered by rank."""
        kids = [i for i, p in enumerate(self.parents) if p == node]
        return sorted(kids, key=lambda i: self.ranks[i])


def chain_shape(length: int) -> TreeShape:
    """Root plus ``length`` draft tokens in a line."""
    assert length >= 0
    return TreeShape(parents=tuple(range(-1, length)), ranks=(0,) * (length + 1))


def static_shape(choices: Sequence[Sequence[int]]) -> TreeShape:
    """Topology from EAGLE/Medusa-style choices; each choice is a path of child ranks from the root.

    Raises ValueError (naming the path) when a path's parent path is missing or a path repeats.
    """
    paths = [tuple(int(r) for r in c) for c in choices]
    if len(set(paths)) != len(paths):
        raise ValueError("speculative.tree_choices: a path is listed twice")
    for p in paths:
        if not p or min(p) < 0:
            raise ValueError(f"speculative.tree_choices: path {list(p)} must be a non-empty list "
                             f"of child ranks >= 0")
        if len(p) > 1 and p[:-1] not in set(paths):
            raise ValueError(f"speculative.tree_choices: path {list(p)} has no parent path "
                             f"{list(p[:-1])}")
    # Breadth-first, then by rank: parents precede children and shallow nodes come first.
    ordered = sorted(paths, key=lambda p: (len(p), p))
    index = {(): 0}
    parents, ranks = [-1], [0]
    for p in ordered:
        index[p] = len(parents)
        parents.append(index[p[:-1]])
        ranks.append(p[-1])
    return TreeShape(tuple(parents), tuple(ranks))


def max_rank(shape: TreeShape) -> int:
    """How many top-k children the draft must produce per expanded node (1 for a chain)."""
    return max(shape.ranks[1:], default=-1) + 1


@dataclass(frozen=True)
class TokenTree:
    """A filled tree: ``tokens[i]`` is node i's token (root = last committed token)."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    _depths: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        assert len(self.tokens) == len(self.parents) >= 1
        assert self.parents[0] == -1
        assert all(0 <= p < i for i, p in enumerate(self.parents) if i), "not topologically ordered"
        object.__setattr__(self, "_depths", tuple(_depths(self.parents)))

    @property
    def num_nodes(self) -> int:
        return len(self.tokens)

    @property
    def num_draft_tokens(self) -> int:
        return len(self.tokens) - 1

    @property
    def depths(self) -> tuple[int, ...]:
        return self._depths

    def positions(self, start: int) -> list[int]:
        """Sequence position of each node when the root sits at ``start``."""
        return [start + d for d in self._depths]

    def ancestors(self, node: int) -> list[int]:
        """Path from the root to ``node`` inclusive."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def attention_mask(self) -> list[list[bool]]:
        """``mask[i][j]``: node i may attend to node j (j is i or one of its ancestors)."""
        n = self.num_nodes
        mask = [[False] * n for _ in range(n)]
        for i in range(n):
            for j in self.ancestors(i):
                mask[i][j] = True
        return mask

    def children(self, node: int) -> list[int]:
        """Children of ``node`` in node order (which is draft-rank order for built trees)."""
        return [i for i, p in enumerate(self.parents) if p == node]

    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))


def fill_shape(shape: TreeShape, root_token: int, child_tokens: dict[int, Sequence[int]]) -> TokenTree:
    """Tokens for a static shape: ``child_tokens[node]`` is the draft's ranked top-k after ``node``."""
    tokens = [root_token]
    for i in range(1, shape.num_nodes):
        tokens.append(int(child_tokens[shape.parents[i]][shape.ranks[i]]))
    return TokenTree(tuple(tokens), shape.parents)


def greedy_accept(tree: TokenTree, target_tokens: Sequence[int]) -> tuple[list[int], int]:
    """Longest path the target agrees with, by exact match.

    ``target_tokens[i]`` is the target's greedy choice after node i (argmax of its logits there).
    Returns (accepted node indices starting with the root, bonus token = the target's choice after
    the last accepted node). The output is exactly what greedy decoding without speculation emits.
    """
    assert len(target_tokens) == tree.num_nodes
    path = [0]
    node = 0
    while True:
        want = int(target_tokens[node])
        nxt = next((c for c in tree.children(node) if tree.tokens[c] == want), None)
        if nxt is None:
            return path, want
        path.append(nxt)
        node = nxt


def accepted_draft_count(path: Sequence[int]) -> int:
    """Draft tokens kept on ``path`` (the root is not a draft token)."""
    return len(path) - 1


@dataclass
class DynamicCandidate:
    """A node proposed while growing a dynamic tree (EAGLE-2): ``score`` is the cumulative draft
    log-probability of the path from the root, so a child never outscores its parent."""

    token: int
    parent: int          # index into the candidate list, -1 = child of the root
    score: float
    depth: int


def select_dynamic(cands: Sequence[DynamicCandidate], root_token: int, budget: int) -> tuple[TokenTree, list[int]]:
    """Keep the ``budget`` best-scoring candidates (plus any ancestors they need) as a tree.

    Returns the tree and, for each non-root node, the candidate index it came from. Ties keep the
    shallower, earlier candidate, which keeps the chosen set closed under taking parents.
    """
    order = sorted(range(len(cands)), key=lambda i: (-cands[i].score, cands[i].depth, i))
    keep: set[int] = set()
    for i in order:
        if len(keep) >= budget:
            break
        j = i
        chain = []
        while j >= 0 and j not in keep:
            chain.append(j)
            j = cands[j].parent
        if len(keep) + len(chain) > budget:
            continue
        keep.update(chain)
    # Topological order: by depth, then by score so better siblings get lower node numbers.
    kept = sorted(keep, key=lambda i: (cands[i].depth, -cands[i].score, i))
    node_of = {c: n + 1 for n, c in enumerate(kept)}
    tokens = [root_token] + [cands[c].token for c in kept]
    parents = [-1] + [0 if cands[c].parent < 0 else node_of[cands[c].parent] for c in kept]
    return TokenTree(tuple(tokens), tuple(parents)), kept


def _depths(parents: Sequence[int]) -> list[int]:
    depths = [0] * len(parents)
    for i in range(1, len(parents)):
        depths[i] = depths[parents[i]] + 1
    return depths


__all__ = ["DynamicCandidate", "TokenTree", "TreeShape", "accepted_draft_count", "chain_shape",
           "fill_shape", "greedy_accept", "max_rank", "select_dynamic", "static_shape"]
