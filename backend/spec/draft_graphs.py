"""The chain draft as one CUDA graph: k draft tokens for a batch of sequences in a single replay.

Why: growing a chain eagerly costs a host round trip per depth (the next token must be read back
before the next draft step can be fed) plus the launches of one decoder layer and the draft head:
measured on an H200 with an 8B-shaped EAGLE-3 head, ~1 ms per depth against ~0.2 ms of GPU work.
In a chain every next token is the draft's top-1, so the whole loop can stay on the device:

    for d in 1..k:  logits = head(h); token_d = argmax; logp_d = its log-probability
                    h = draft_step(h, token_d, position root + d - 1)   (writes KV row length + d - 1)

The caches live in a ``DraftKVPool`` (fixed addresses, read through the paged-decode kernel), the
inputs in static buffers sized for the largest bucket; batches are padded to a bucket (padding
rows write to the pool's scratch slot). One graph per bucket, captured when first needed.
``capture=False`` runs the same padded static-buffer code eagerly (the CPU tests).

The host gets ``tokens [n, k]`` and ``logp [n, k]`` back in one copy and applies the chain's
confidence cut (``min_draft_prob``) itself: the same rule as the eager grower.
"""
from __future__ import annotations

import torch

from backend.cuda_graphs import buckets
from backend.spec.draft_model import DraftKVPool, Eagle3Draft


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
        self.graphs: dict[int, tuple[object, torch.Tensor]] = {}
        self._mempool = None
        self.runs = 0
        self.failed: str | None = None

    def usable(self, requests) -> bool:
        return (self.failed is None and 0 < len(requests) <= self.sizes[-1]
                and all(r.cache.slot >= 0 for r in requests))

    def _forward(self, b: int) -> torch.Tensor:
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
        return torch.stack([torch.stack(toks, 1).float(), torch.stack(logps, 1)], 1)

    def _capture(self, b: int) -> None:
        if self._mempool is None:
            self._mempool = torch.cuda.graph_pool_handle()
        dev = self.draft.device
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):       # warm-up: kernel compiles, cuBLAS workspaces
            self._forward(b)
        torch.cuda.current_stream(dev).wait_stream(side)
        torch.cuda.synchronize(dev)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self._mempool):
            out = self._forward(b)
        self.graphs[b] = (g, out)

    @torch.inference_mode()
    def run(self, requests) -> tuple[list[list[int]], list[list[float]]]:
        """Per request (``GrowRequest`` with a pooled cache): its k chain tokens and their draft
        log-probabilities (``usable`` was true). Writes tentative KV rows past each ``cache.length``."""
        n = len(requests)
        b = next(s for s in self.sizes if s >= n)
        dev = self.draft.device
        self.h[:n].copy_(torch.cat([r.last_out for r in requests]))
        host = torch.tensor([[r.root_pos, r.cache.slot, r.cache.length] for r in requests], dtype=torch.int64)
        host = host.to(dev, non_blocking=True)
        self.root_pos[:n].copy_(host[:, 0])
        self.slots[:n].copy_(host[:, 1])
        self.lengths[:n].copy_(host[:, 2])
        self.slots[n:].fill_(self.pool.scratch)   # padding rows: scratch slot, row 0 onwards
        self.lengths[n:].zero_()
        self.root_pos[n:].zero_()
        self.runs += 1
        if not self.capture:
            out = self._forward(b)
        else:
            if b not in self.graphs:
                try:
                    self._capture(b)
                except Exception as exc:  # noqa: BLE001 - a speed-up, never the engine's failure
                    import warnings
                    self.graphs.clear()
                    self.failed = f"{type(exc).__name__}: {exc}"
                    warnings.warn(f"CUDA graph capture of the chain draft failed ({self.failed}); "
                                  f"drafting eagerly", RuntimeWarning)
                    torch.cuda.synchronize(dev)
                    out = self._forward(b)
                    return _lists(out[:n])
            g, out = self.graphs[b]
            g.replay()
        return _lists(out[:n])


def _lists(out: torch.Tensor) -> tuple[list[list[int]], list[list[float]]]:
    both = out.cpu()     # one device -> host copy for the whole batch
    return [[int(t) for t in row] for row in both[:, 0].tolist()], both[:, 1].tolist()


__all__ = ["ChainDraftGraphs"]
