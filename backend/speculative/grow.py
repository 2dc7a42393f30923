"""Growing the next draft trees of the speculating sequences with the EAGLE-3 head (chain, static, dynamic).

Expanding a tree node u (token ``x_u`` at position ``root_pos + depth(u)``) is one draft entry:
feature = the draft output that proposed u, token = ``x_u``, position = ``root_pos + depth(u) - 1``;
its output proposes u's children. Entries of one tree live in the draft cache past the committed
rows and see the committed rows plus their own ancestors' entries (a tree mask inside the draft).
All entries of one depth, of every sequence in the step, run as ONE batched draft call (so a batch
of 8 pays the draft's matmuls once per depth, not 8 times). Nothing here changes ``cache.length``:
the tentative rows are simply overwritten next time.

The shapes come from a registry (``GROWERS``) keyed by ``speculative.tree``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from backend.speculative.draft_model import DraftKV, DraftSlice, Eagle3Draft
from backend.speculative.tree import (DynamicCandidate, TokenTree, TreeShape, chain_shape, max_rank,
                               select_dynamic, static_shape)


@dataclass
class _Entry:
    feat: torch.Tensor     # [1, H] the draft output that proposed this node
    token: int
    depth: int             # depth of the node being expanded (>= 1)
    ancestors: list[int]   # indices (into the entry list) of ancestor entries, self last


@dataclass
class GrowRequest:
    """One sequence to grow a tree for: its draft cache (committed rows), the draft's pre-norm
    output for its newest committed entry ``[1, H]``, the root token and the root's position."""
    cache: DraftKV
    last_out: torch.Tensor
    root_token: int
    root_pos: int


class _Scratch:
    """Tentative draft entries of one tree, written after the committed rows."""

    def __init__(self, cache: DraftKV, root_pos: int) -> None:
        self.cache, self.root_pos = cache, root_pos
        self.entries: list[_Entry] = []

    def add(self, new: list[_Entry]) -> DraftSlice:
        """Append one depth's entries; -> their slice of the batched draft call (tree mask: each
        entry sees its ancestors' tentative rows only)."""
        base = len(self.entries)
        self.entries.extend(new)
        mask = torch.zeros(len(new), len(self.entries), dtype=torch.bool)
        for i, e in enumerate(new):
            mask[i, e.ancestors] = True
        return DraftSlice(len(new), self.cache, self.cache.length + base, mask)


def _expand(draft: Eagle3Draft, jobs: list[tuple[_Scratch, list[_Entry]]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Expand one depth of every tree in ONE draft call: -> (draft-vocab logits [N, Vd], pre-norm
    outputs [N, H]), rows in job order."""
    slices = [sc.add(new) for sc, new in jobs]
    entries = [(sc, e) for sc, new in jobs for e in new]
    dev = draft.device
    out = draft.step_many(torch.cat([e.feat for _, e in entries]),
                          torch.tensor([e.token for _, e in entries], device=dev),
                          torch.tensor([sc.root_pos + e.depth - 1 for sc, e in entries], device=dev),
                          slices)
    return draft.logits(out), out


class TreeGrower:
    """``grow_many(requests) -> [TokenTree]``: one tree per sequence, every depth of every tree in
    one batched draft call. ``grow(cache, last_out, root_token, root_pos)`` is the one-sequence form."""
    graphs = None   # a ChainDraftGraphs: set on a chain ShapeGrower only

    def __init__(self, draft: Eagle3Draft) -> None:
        self.draft = draft

    @staticmethod
    def from_settings(draft: Eagle3Draft, tree: str, max_draft_len: int, top_k: int, depth: int,
                      tree_choices, min_draft_prob: float = 0.0) -> "TreeGrower":
        if tree not in GROWERS:
            raise ValueError(f"speculative.tree: {tree!r}; allowed: {', '.join(GROWERS)}")
        if min_draft_prob > 0 and tree != "chain":
            raise ValueError(f"speculative.min_draft_prob: only for tree: chain (tree is {tree}); allowed: 0")
        return GROWERS[tree](draft, max_draft_len=max_draft_len, top_k=top_k, depth=depth,
                             tree_choices=tree_choices, min_prob=min_draft_prob)

    def grow(self, cache: DraftKV, last_out: torch.Tensor, root_token: int, root_pos: int) -> TokenTree:
        return self.grow_many([GrowRequest(cache, last_out, root_token, root_pos)])[0]

    def grow_many(self, requests: list[GrowRequest]) -> list[TokenTree]:
        raise NotImplementedError


class ShapeGrower(TreeGrower):
    """A fixed topology (chain or static tree) filled with the draft's ranked top-k per node.

    ``min_prob`` (chains only): the chain stops before the first token whose cumulative draft
    probability is below it, and drafting stops once every chain of the step has stopped. Each
    verified draft token costs a row of the target's pass whether or not it is accepted; where
    that row is not nearly free (a CPU, a busy GPU) a token the draft itself doubts costs more
    than it is expected to save (EAGLE-2's observation: the draft's confidence predicts
    acceptance). A chain cut to nothing makes the step an ordinary decode."""

    def __init__(self, draft: Eagle3Draft, shape: TreeShape, min_prob: float = 0.0) -> None:
        super().__init__(draft)
        assert min_prob == 0 or all(p == i - 1 for i, p in enumerate(shape.parents) if i), "chains only"
        self.min_prob = min_prob
        self.shape = shape
        self.k = max(1, max_rank(shape))
        self.has_children = [bool(shape.children(i)) for i in range(shape.num_nodes)]
        self.by_depth = [shape.nodes_at_depth(d) for d in range(shape.depth + 1)]
        self.is_chain = all(p == i - 1 for i, p in enumerate(shape.parents))
        self.graphs = None   # a ChainDraftGraphs (backend/speculative/draft_graphs.py) when set: chains only

    def grow_many(self, requests: list[GrowRequest]) -> list[TokenTree]:
        d, s = self.draft, self.shape
        if not requests:
            return []
        if self.graphs is not None and self.graphs.usable(requests):
            return self._grow_graphed(requests)
        tokens = [[r.root_token] + [0] * (s.num_nodes - 1) for r in requests]
        entry_of: list[dict[int, int]] = [{} for _ in requests]     # node -> its entry index
        out_of = [{0: r.last_out} for r in requests]               # node -> output proposing its children
        scratch = [_Scratch(r.cache, r.root_pos) for r in requests]
        logits = d.logits(torch.cat([r.last_out for r in requests]))
        vals, idx = logits.topk(self.k, dim=-1)
        children = [{0: row} for row in d.to_target_ids(idx).tolist()]
        # Chains only (checked at construction): length kept so far and its cumulative probability.
        keep = [s.num_nodes] * len(requests)
        cum = [1.0] * len(requests)
        self._cut(keep, cum, logits, vals, 1)
        for depth in range(1, s.depth + 1):
            if self.min_prob > 0 and all(n <= depth for n in keep):
                break  # every chain already stopped above this depth: no more draft calls
            for b in range(len(requests)):
                for node in self.by_depth[depth]:
                    tokens[b][node] = int(children[b][s.parents[node]][s.ranks[node]])
            expand = [nd for nd in self.by_depth[depth] if self.has_children[nd]]
            if not expand:
                continue
            jobs = []
            for b in range(len(requests)):
                new = []
                for nd in expand:
                    anc = [entry_of[b][a] for a in _ancestors(s.parents, nd) if a in entry_of[b]]
                    entry_of[b][nd] = len(scratch[b].entries) + len(new)
                    new.append(_Entry(out_of[b][s.parents[nd]], tokens[b][nd], depth, anc + [entry_of[b][nd]]))
                jobs.append((scratch[b], new))
            logits, outs = _expand(d, jobs)
            vals, idx = logits.topk(self.k, dim=-1)
            self._cut(keep, cum, logits, vals, depth + 1)
            top = d.to_target_ids(idx).tolist()
            r = 0
            for b in range(len(requests)):
                for nd in expand:
                    out_of[b][nd] = outs[r:r + 1]
                    children[b][nd] = top[r]
                    r += 1
        if self.min_prob > 0:
            return [TokenTree(tuple(t[:n]), s.parents[:n]) for t, n in zip(tokens, keep)]
        return [TokenTree(tuple(t), s.parents) for t in tokens]

    def _grow_graphed(self, requests: list[GrowRequest]) -> list[TokenTree]:
        """The whole chain in one graph replay."""
        tokens, logps = self.graphs.run(requests)
        return [self.chain_tree(r.root_token, t, lp) for r, t, lp in zip(requests, tokens, logps)]

    def chain_tree(self, root_token: int, tokens: list[int], logps: list[float]) -> TokenTree:
        """A chain from a graph's top-1 tokens and their log-probabilities, cut by ``_cut``'s rule."""
        n, cum = self.shape.num_nodes, 1.0
        for node, lp in enumerate(logps[:n - 1] if self.min_prob > 0 else (), 1):
            cum *= math.exp(lp)
            if cum < self.min_prob:
                n = node
                break
        return TokenTree((root_token, *tokens[:n - 1]), self.shape.parents[:n])

    def _cut(self, keep: list[int], cum: list[float], logits: torch.Tensor, top: torch.Tensor, node: int) -> None:
        """Chain node ``node`` was just proposed for each sequence (logit ``top[b, 0]`` of the draft's
        ``logits[b]``): stop a chain there if its cumulative probability falls below ``min_prob``."""
        if self.min_prob <= 0 or node >= self.shape.num_nodes:
            return  # without a threshold no softmax is computed at all
        for b, p in enumerate((top[:, 0] - logits.logsumexp(-1)).exp().tolist()):
            if keep[b] > node:
                cum[b] *= p
                if cum[b] < self.min_prob:
                    keep[b] = node


class DynamicGrower(TreeGrower):
    """EAGLE-2: expand the ``top_k`` best nodes of each depth by cumulative draft log-probability,
    ``top_k`` children each, for ``depth`` levels; verify the ``top_k * depth`` best candidates."""

    def __init__(self, draft: Eagle3Draft, top_k: int, depth: int) -> None:
        super().__init__(draft)
        self.top_k, self.depth = top_k, depth
        self.budget = top_k * depth

    def grow_many(self, requests: list[GrowRequest]) -> list[TokenTree]:
        d = self.draft
        if not requests:
            return []
        nb = len(requests)
        scratch = [_Scratch(r.cache, r.root_pos) for r in requests]
        cands: list[list[DynamicCandidate]] = [[] for _ in requests]
        outs: list[dict[int, torch.Tensor]] = [{} for _ in requests]   # candidate -> output proposing its children
        entry_of: list[dict[int, int]] = [{} for _ in requests]
        frontier: list[list[int]] = [[] for _ in requests]
        vals, idx = d.logits(torch.cat([r.last_out for r in requests])).log_softmax(-1).topk(self.top_k, dim=-1)
        ids = d.to_target_ids(idx).tolist()
        for b, r in enumerate(requests):
            for v, t in zip(vals[b].tolist(), ids[b]):
                cands[b].append(DynamicCandidate(int(t), -1, float(v), 1))
                frontier[b].append(len(cands[b]) - 1)
                outs[b][len(cands[b]) - 1] = r.last_out
        for depth in range(1, self.depth):
            jobs, expand = [], []
            for b in range(nb):
                cb = cands[b]
                ex = sorted(frontier[b], key=lambda c: -cb[c].score)[:self.top_k]
                new = []
                for c in ex:
                    anc = []
                    p = cb[c].parent
                    while p >= 0:
                        anc.append(entry_of[b][p])
                        p = cb[p].parent
                    entry_of[b][c] = len(scratch[b].entries) + len(new)
                    new.append(_Entry(outs[b][c], cb[c].token, depth, anc[::-1] + [entry_of[b][c]]))
                jobs.append((scratch[b], new))
                expand.append(ex)
            logits, out = _expand(d, jobs)
            vals, idx = logits.log_softmax(-1).topk(self.top_k, dim=-1)
            vals, ids = vals.tolist(), d.to_target_ids(idx).tolist()
            r = 0
            for b in range(nb):
                frontier[b] = []
                for c in expand[b]:
                    for v, t in zip(vals[r], ids[r]):
                        cands[b].append(DynamicCandidate(int(t), c, cands[b][c].score + float(v), depth + 1))
                        frontier[b].append(len(cands[b]) - 1)
                        outs[b][len(cands[b]) - 1] = out[r:r + 1]
                    r += 1
        return [select_dynamic(cands[b], requests[b].root_token, self.budget)[0] for b in range(nb)]


def _ancestors(parents, node: int) -> list[int]:
    out = []
    while node > 0:
        out.append(node)
        node = parents[node]
    return out[::-1]


GROWERS = {
    "chain": lambda draft, max_draft_len, min_prob=0.0, **_: ShapeGrower(draft, chain_shape(max_draft_len),
                                                                         min_prob),
    "static": lambda draft, tree_choices, **_: ShapeGrower(draft, static_shape(tree_choices)),
    "dynamic": lambda draft, top_k, depth, **_: DynamicGrower(draft, top_k, depth),
}

__all__ = ["GROWERS", "DynamicGrower", "GrowRequest", "ShapeGrower", "TreeGrower"]
