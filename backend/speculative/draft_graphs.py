"""The chain draft as one CUDA graph: k draft tokens for a batch of sequences in a single replay.

Why: growing a chain eagerly costs a host round trip per depth (the next token must be read back
before the next draft step can be fed) plus the launches of one decoder layer and the draft head.
Measured on an H200 with an 8B-shaped EAGLE-3 head, the draft's share of a step drafting 1 / 4 tokens:
2.2 / 5.5 ms eager, 0.8 / 2.0 ms as one replay (docs/perf/eagle3-cost-h200.json).
In a chain every next token is the draft's top-1, so the whole loop can stay on the device:

    for d in 1..k:  logits = head(h); token_d = argmax; logp_d = its log-probability
                    h = draft_step(h, token_d, position root + d - 1)   (writes KV row length + d - 1)

The caches live in a ``DraftKVPool`` (fixed addresses, read through the paged-decode kernel), the
inputs in static buffers sized for the largest bucket; batches are padded to a bucket (padding
rows write to the pool's scratch slot). One graph per bucket, captured when first needed.
``capture=False`` runs the same padded static-buffer code eagerly (the CPU tests).

The host gets ``tokens [n, k]`` and ``logp [n, k]`` back in one copy and applies the chain's
confidence cut (``min_draft_prob``) itself: the same rule as the eager grower.

``run_commit`` puts the step before the chain into the same replay: feeding the draft the rows the
target just committed (the verify pass's accepted path, at most k + 1 per sequence, from the target's
captured aux layers). Each such row is a one-token decode of its sequence's pooled cache of length
``committed + i + 1``, so the same pooled step serves it; the rows are packed as the step had them
and padded to ``k + 1`` per sequence of the bucket. Prompt chunks (many rows) stay eager.
"""
from __future__ import annotations

import torch

from backend.logs import get_logger
from backend.ops.cuda_graphs import buckets, capture_graphs
from backend.speculative.draft_model import DraftKVPool, Eagle3Draft

_LOG = get_logger("speculative.draft_graphs")


class ChainDraftGraphs:
    def __init__(self, draft: Eagle3Draft, pool: DraftKVPool, k: int, max_batch: int, capture: bool) -> None:
        self.draft, self.pool, self.k = draft, pool, k
        self.sizes = buckets(max_batch)
        self.capture = capture
        n, dev = self.sizes[-1], draft.device
        self.h = torch.zeros(n, draft.cfg.hidden_size, dtype=draft.dtype, device=dev)
        self.root_pos = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slots = torch.full((n,), pool.scratch, dtype=torch.int64, device=dev)
        self.lengths = torch.zeros(n, dtype=torch.int64, device=dev)
        # run_commit's inputs: up to q = k + 1 committed rows per sequence
        self.q = k + 1
        rows = n * self.q
        self.aux = torch.zeros(rows, draft.cfg.hidden_size * len(draft.cfg.aux_layers), dtype=draft.dtype, device=dev)
        self.row_tokens = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.row_pos = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.row_slot = torch.full((rows,), pool.scratch, dtype=torch.int64, device=dev)
        self.row_at = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.last_row = torch.zeros(n, dtype=torch.int64, device=dev)
        # ("grow" | "commit", bucket) -> (graph, outputs)
        self.graphs: dict[tuple[str, int], tuple[object, tuple[torch.Tensor, ...]]] = {}
        self._mempool = None
        self.runs = 0        # replays (or eager runs of the static-buffer code), both kinds
        self.commits = 0     # of which run_commit
        self.failed: str | None = None

    @classmethod
    def shared(cls, draft: Eagle3Draft, pool: DraftKVPool, k: int, max_batch: int, capture: bool) -> "ChainDraftGraphs":
        """One instance per (draft, pool, k, batch): speculators made again for the same draft (a
        benchmark switching k, a restart of speculation) reuse the captured graphs instead of
        capturing again in the middle of serving."""
        cache = draft.__dict__.setdefault("_chain_graphs", {})
        key = (id(pool), k, max_batch, capture)
        if key not in cache:
            cache[key] = cls(draft, pool, k, max_batch, capture)
        return cache[key]

    def usable(self, requests) -> bool:
        cap = self.pool.capacity - (self.k - 1)   # the chain writes k - 1 rows past the committed ones
        return (self.failed is None and 0 < len(requests) <= self.sizes[-1]
                and all(r.cache.slot >= 0 and r.cache.length <= cap for r in requests))

    def _forward_commit(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The committed rows through the draft, then the chain from each sequence's last one."""
        r = b * self.q
        d = self.draft
        feats = d.fuse(self.aux[:r])
        h = d.step_pooled(feats, self.row_tokens[:r], self.row_pos[:r], self.pool, self.row_slot[:r], self.row_at[:r])
        self.h[:b].copy_(h.index_select(0, self.last_row[:b]))
        return self._forward(b)[0], self.h[:b]

    def _forward(self, b: int) -> tuple[torch.Tensor]:
        """-> ``[b, 2, k]`` float: the k target-vocabulary tokens, then their log-probabilities."""
        d = self.draft
        h, slots, lengths = self.h[:b], self.slots[:b], self.lengths[:b]
        toks, logps = [], []
        for depth in range(1, self.k + 1):
            logits = d.logits(h)
            top, arg = logits.max(-1)
            tok = d.to_target_ids(arg)
            toks.append(tok)
            logps.append(top - logits.logsumexp(-1))
            if depth < self.k:   # the last node has no children: its entry would be wasted
                h = d.step_pooled(h, tok, self.root_pos[:b] + depth - 1, self.pool, slots, lengths + depth - 1)
        return (torch.stack([torch.stack(toks, 1).float(), torch.stack(logps, 1)], 1),)

    def _set_chain_inputs(self, n: int, root_pos: list[int], slots: list[int], lengths: list[int]) -> None:
        host = torch.tensor([root_pos, slots, lengths], dtype=torch.int64).to(self.draft.device, non_blocking=True)
        self.root_pos[:n].copy_(host[0])
        self.slots[:n].copy_(host[1])
        self.lengths[:n].copy_(host[2])
        self.slots[n:].fill_(self.pool.scratch)   # padding rows: scratch slot, row 0 onwards
        self.lengths[n:].zero_()
        self.root_pos[n:].zero_()

    @torch.inference_mode()
    def run(self, requests) -> tuple[list[list[int]], list[list[float]]]:
        """Per request (``GrowRequest`` with a pooled cache): its k chain tokens and their draft
        log-probabilities (``usable`` was true). Writes tentative KV rows past each ``cache.length``."""
        n = len(requests)
        self.h[:n].copy_(torch.cat([r.last_out for r in requests]))
        self._set_chain_inputs(n, [r.root_pos for r in requests], [r.cache.slot for r in requests],
                               [r.cache.length for r in requests])
        out = self._replay("grow", n)
        return _lists(out[0][:n])

    def commit_usable(self, counts: list[int], caches) -> bool:
        cap = self.pool.capacity - (self.k - 1)   # the committed rows, then the chain's
        return (self.failed is None and 0 < len(counts) <= self.sizes[-1] and max(counts) <= self.q
                and all(c.slot >= 0 and c.length + m <= cap for c, m in zip(caches, counts)))

    @torch.inference_mode()
    def run_commit(self, aux: torch.Tensor, counts: list[int], tokens: list[int], positions: list[int],
                   caches) -> tuple[list[list[int]], list[list[float]], torch.Tensor]:
        """Feed each sequence's ``counts[i]`` newly committed rows (``aux [N, A*H]`` the target's
        captured layers, ``tokens``/``positions`` per row, rows of a sequence consecutive) into its
        pooled cache after ``cache.length``, then grow its chain from the last one (``commit_usable``
        was true). Returns the chains' tokens and log-probabilities and the draft's output for each
        sequence's last committed row ``[n, H]`` (a copy). Does not change ``cache.length``."""
        n, rows = len(counts), int(aux.shape[0])
        self.commits += 1
        self.aux[:rows].copy_(aux)
        slot_rows, at_rows, last, lengths, end = [], [], [], [], 0
        for c, m in zip(caches, counts):
            slot_rows += [c.slot] * m
            at_rows += range(c.length, c.length + m)
            end += m
            last.append(end - 1)
            lengths.append(c.length + m)
        pad = [0] * (self.sizes[-1] * self.q - rows)
        host = torch.tensor([tokens + pad, positions + pad, slot_rows + [self.pool.scratch] * len(pad), at_rows + pad],
                            dtype=torch.int64).to(self.draft.device, non_blocking=True)
        self.row_tokens.copy_(host[0])
        self.row_pos.copy_(host[1])
        self.row_slot.copy_(host[2])
        self.row_at.copy_(host[3])
        self.last_row[:n].copy_(torch.tensor(last, dtype=torch.int64))
        self.last_row[n:].zero_()     # padding sequences: any row inside the smallest bucket
        self._set_chain_inputs(n, [positions[i] + 1 for i in last], [c.slot for c in caches], lengths)
        out, h = self._replay("commit", n)
        toks, logps = _lists(out[:n])
        return toks, logps, h[:n].clone()

    def _replay(self, kind: str, n: int) -> tuple[torch.Tensor, ...]:
        b = next(s for s in self.sizes if s >= n)
        fn = self._forward_commit if kind == "commit" else self._forward
        self.runs += 1
        if not self.capture:
            return fn(b)
        key = (kind, b)
        if key not in self.graphs:
            try:
                if self._mempool is None:
                    self._mempool = torch.cuda.graph_pool_handle()
                self.graphs[key] = capture_graphs([lambda: fn(b)], self.draft.device, self._mempool)[0]
            except Exception as exc:  # noqa: BLE001 - a speed-up, never the engine's failure
                self.graphs.clear()
                self.failed = f"{type(exc).__name__}: {exc}"
                _LOG.warning("CUDA graph capture of the chain draft failed (%s); drafting eagerly", self.failed)
                torch.cuda.synchronize(self.draft.device)
                return fn(b)
        g, out = self.graphs[key]
        g.replay()
        return out


def _lists(out: torch.Tensor) -> tuple[list[list[int]], list[list[float]]]:
    both = out.cpu()     # one device -> host copy for the whole batch
    return [[int(t) for t in row] for row in both[:, 0].tolist()], both[:, 1].tolist()


__all__ = ["ChainDraftGraphs"]
