"""Growing the next draft tree of one sequence with the EAGLE-3 head (chain, static, dynamic).

Expanding a tree node u (token ``x_u`` at position ``root_pos + depth(u)``) is one draft entry:
feature = the draft output that proposed u, token = ``x_u``, position = ``root_pos + depth(u) - 1``;
its output proposes u's children. Entries of one tree live in the draft cache past the committed
rows and see the committed rows plus their own ancestors' entries (a tree mask inside the draft).
All entries of one depth run as one batched draft call. Nothing here changes ``cache.length``: the
tentative rows are simply overwritten next time.

The shapes come from a registry (``GROWERS``) keyed by ``speculative.tree``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from backend.spec.draft_model import DraftKV, Eagle3Draft
from backend.spec.tree import (DynamicCandidate, TokenTree, TreeShape, chain_shape, max_rank,
                               select_dynamic, static_shape)


@dataclass
class _Entry:
    feat: torch.Tensor     # [1, H] the draft output that proposed this node
    token: int
    depth: int             # depth of the node being expanded (>= 1)
    ancestors: list[int]   # indices (into the entry list) of ancestor entries, self last


class _Scratch:
    """Tentative draft entries of one tree, written after the committed rows."""

    def __init__(self, draft: Eagle3Draft, cache: DraftKV, root_pos: int) -> None:
        self.draft, self.cache, self.root_pos = draft, cache, root_pos
        self.entries: list[_Entry] = []

    def run(self, new: list[_Entry]) -> tuple[torch.Tensor, torch.Tensor]:
        """Expand ``new`` (one depth) in one draft call: returns (draft-vocab logits [n, Vd], outputs [n, H])."""
        base = len(self.entries)
        self.entries.extend(new)
        n, total = len(new), len(self.entries)
        mask = torch.zeros(n, total, dtype=torch.bool)
        for i, e in enumerate(new):
            mask[i, e.ancestors] = True
        dev = self.draft.device
        out = self.draft.step(torch.cat([e.feat for e in new]),
                              torch.tensor([e.token for e in new], device=dev),
                              torch.tensor([self.root_pos + e.depth - 1 for e in new], device=dev),
                              self.cache, self.cache.length + base, mask.to(dev))
        return self.draft.logits(out), out


class TreeGrower:
    """``grow(cache, last_out [1, H], root_token, root_pos) -> TokenTree``."""

    def __init__(self, draft: Eagle3Draft) -> None:
        self.draft = draft

    @staticmethod
    def from_settings(draft: Eagle3Draft, tree: str, max_draft_len: int, top_k: int, depth: int,
                      tree_choices) -> "TreeGrower":
        if tree not in GROWERS:
            raise ValueError(f"speculative.tree: {tree!r}; allowed: {', '.join(GROWERS)}")
        return GROWERS[tree](draft, max_draft_len=max_draft_len, top_k=top_k, depth=depth,
                             tree_choices=tree_choices)

    def grow(self, cache: DraftKV, last_out: torch.Tensor, root_token: int, root_pos: int) -> TokenTree:
        raise NotImplementedError


class ShapeGrower(TreeGrower):
    """A fixed topology (chain or static tree) filled with the draft's ranked top-k per node."""

    def __init__(self, draft: Eagle3Draft, shape: TreeShape) -> None:
        super().__init__(draft)
        self.shape = shape
        self.k = max(1, max_rank(shape))
        self.has_children = [bool(shape.children(i)) for i in range(shape.num_nodes)]
        self.by_depth = [shape.nodes_at_depth(d) for d in range(shape.depth + 1)]

    def grow(self, cache, last_out, root_token, root_pos) -> TokenTree:
        d = self.draft
        s = self.shape
        tokens = [root_token] + [0] * (s.num_nodes - 1)
        entry_of: dict[int, int] = {}   # node -> its entry index
        out_of = {0: last_out}          # node -> the draft output that proposes its children
        scratch = _Scratch(d, cache, root_pos)
        top = d.to_target_ids(d.logits(last_out).topk(self.k, dim=-1).indices[0]).tolist()
        children = {0: top}
        for depth in range(1, s.depth + 1):
            for node in self.by_depth[depth]:
                tokens[node] = int(children[s.parents[node]][s.ranks[node]])
            expand = [nd for nd in self.by_depth[depth] if self.has_children[nd]]
            if not expand:
                continue
            new = []
            for nd in expand:
                anc = [entry_of[a] for a in _ancestors(s.parents, nd) if a in entry_of]
                entry_of[nd] = len(scratch.entries) + len(new)
                new.append(_Entry(out_of[s.parents[nd]], tokens[nd], depth, anc + [entry_of[nd]]))
            logits, outs = scratch.run(new)
            top = d.to_target_ids(logits.topk(self.k, dim=-1).indices).tolist()
            for i, nd in enumerate(expand):
                out_of[nd] = outs[i:i + 1]
                children[nd] = top[i]
        return TokenTree(tuple(tokens), s.parents)


class DynamicGrower(TreeGrower):
    """EAGLE-2: expand the ``top_k`` best nodes of each depth by cumulative draft log-probability,
    ``top_k`` children each, for ``depth`` levels; verify the ``top_k * depth`` best candidates."""

    def __init__(self, draft: Eagle3Draft, top_k: int, depth: int) -> None:
        super().__init__(draft)
        self.top_k, self.depth = top_k, depth
        self.budget = top_k * depth

    def grow(self, cache, last_out, root_token, root_pos) -> TokenTree:
        d = self.draft
        scratch = _Scratch(d, cache, root_pos)
        cands: list[DynamicCandidate] = []
        outs: dict[int, torch.Tensor] = {}     # candidate -> output proposing its children
        entry_of: dict[int, int] = {}
        lp = d.logits(last_out).log_softmax(-1)[0]
        vals, idx = lp.topk(self.top_k)
        ids = d.to_target_ids(idx).tolist()
        frontier = []
        for v, t in zip(vals.tolist(), ids):
            cands.append(DynamicCandidate(int(t), -1, float(v), 1))
            frontier.append(len(cands) - 1)
            outs[len(cands) - 1] = last_out
        for depth in range(1, self.depth):
            expand = sorted(frontier, key=lambda c: -cands[c].score)[:self.top_k]
            new = []
            for c in expand:
                anc = []
                p = cands[c].parent
                while p >= 0:
                    anc.append(entry_of[p])
                    p = cands[p].parent
                entry_of[c] = len(scratch.entries) + len(new)
                new.append(_Entry(outs[c], cands[c].token, depth, anc[::-1] + [entry_of[c]]))
            logits, out = scratch.run(new)
            vals, idx = logits.log_softmax(-1).topk(self.top_k, dim=-1)
            ids = d.to_target_ids(idx).tolist()
            frontier = []
            for i, c in enumerate(expand):
                for v, t in zip(vals[i].tolist(), ids[i]):
                    cands.append(DynamicCandidate(int(t), c, cands[c].score + float(v), depth + 1))
                    frontier.append(len(cands) - 1)
                    outs[len(cands) - 1] = out[i:i + 1]
        tree, _ = select_dynamic(cands, root_token, self.budget)
        return tree


def _ancestors(parents, node: int) -> list[int]:
    out = []
    while node > 0:
        out.append(node)
        node = parents[node]
    return out[::-1]


GROWERS = {
    "chain": lambda draft, max_draft_len, **_: ShapeGrower(draft, chain_shape(max_draft_len)),
    "static": lambda draft, tree_choices, **_: ShapeGrower(draft, static_shape(tree_choices)),
    "dynamic": lambda draft, top_k, depth, **_: DynamicGrower(draft, top_k, depth),
}

__all__ = ["GROWERS", "DynamicGrower", "ShapeGrower", "TreeGrower"]
