"""EAGLE-3 speculative decoding inside the executor's continuous batching (the ``Speculator`` seam
of ``backend/engine/executor.py``).

Per step, for each request with drafts (chain or tree, see ``tree.py``):

1. ``prepare``: the target will score the root (the last sampled token) plus every draft node in
   one pass. Node i sits in KV slot ``start + i`` but at position ``start + depth(i)``; for a real
   tree the step's ``tree_mask`` lets each node see only its ancestors (a chain needs neither: its
   positions and mask are the ordinary causal ones).
2. ``verify``: accept the longest path (exact match for greedy, rejection sampling otherwise,
   ``accept.py``), move the accepted nodes' KV into consecutive slots (trees only), and return the
   accepted tokens + one bonus token; the scheduler rolls back the rest (``BlockManager.rollback``).
3. ``propose``: feed the draft the target's captured hidden states for every position that became
   committed this step (prompt chunks included, so the draft sees the whole context), then grow the
   next tree from the draft's last output and put its tokens in ``request.spec_token_ids``. Both
   are batched over the step's sequences: one draft call for the committed rows, then one per
   tree depth for all trees together.

Requests that opt out (``SamplingParams.speculative = False``) or whose sampling depends on the
tokens being decided (``accept.speculation_allowed``) get no drafts and run exactly as without a
speculator, in the same batch.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from backend.engine.speculator_seam import Speculator
from backend.speculative.accept import accept_tree, emitted_tokens, speculation_allowed
from backend.speculative.checkpoint import read_bundle_draft
from backend.speculative.draft_model import DraftKV, DraftSlice, Eagle3Draft
from backend.speculative.grow import GrowRequest, ShapeGrower, TreeGrower
from backend.speculative.tree import TokenTree


_PER_REQUEST_KEEP = 4096


@dataclass
class _SeqState:
    cache: DraftKV
    next_pos: int                     # first target position the draft has not consumed
    last_out: torch.Tensor | None = None   # draft pre-norm output of the newest committed entry


@dataclass
class SpecStats:
    verify_steps: int = 0             # (request, step) pairs that verified drafts
    proposed: int = 0                 # draft tokens scored by the target
    accepted: int = 0                 # draft tokens kept
    emitted: int = 0                  # tokens produced by verifying steps (accepted + bonus)
    # (request, step) pairs of speculating requests that had no drafts that step (min_draft_prob
    # cut the chain to nothing): ordinary decodes, one token each.
    undrafted_steps: int = 0
    accept_hist: dict[int, int] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"spec_verify_steps": self.verify_steps, "draft_tokens_proposed": self.proposed,
                "draft_tokens_accepted": self.accepted,
                "acceptance_rate": self.accepted / self.proposed if self.proposed else 0.0,
                "mean_acceptance_length": self.emitted / self.verify_steps if self.verify_steps else 0.0,
                "spec_undrafted_steps": self.undrafted_steps,
                # Per target pass of a speculating request, counting its undrafted steps too.
                "tokens_per_target_pass": ((self.emitted + self.undrafted_steps)
                                           / (self.verify_steps + self.undrafted_steps)
                                           if self.verify_steps + self.undrafted_steps else 0.0),
                "accepted_per_step_histogram": dict(sorted(self.accept_hist.items()))}


class EagleSpeculator(Speculator):
    def __init__(self, draft: Eagle3Draft, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 grower: TreeGrower, runner=None) -> None:
        """``runner``: the target's ModelRunner; when it replays CUDA graphs (or runs their static
        buffers eagerly, CPU tests) a chain grower gets its own graph and the draft caches a pool."""
        self.draft = draft
        self.kv_caches = kv_caches
        self.grower = grower
        self.pool = None
        graphs = runner.graphs if runner is not None else None
        from backend.ops.cuda_graphs import MAX_QUERY
        if (graphs is not None and isinstance(grower, ShapeGrower) and grower.is_chain
                and 0 < grower.shape.depth < MAX_QUERY):
            from backend.speculative.draft_graphs import ChainDraftGraphs
            max_batch = graphs.sizes[-1]
            # entries reach max_seq_len + the drafts being verified; one slot per running sequence
            self.pool = draft.kv_pool(max_batch, graphs.max_seq_len + MAX_QUERY)
            grower.graphs = ChainDraftGraphs.shared(draft, self.pool, grower.shape.depth, max_batch, graphs.capture)
        self.capture_hidden_layers = tuple(draft.cfg.aux_layers)
        self.stats = SpecStats()
        self._states: dict[str, _SeqState] = {}
        self._trees: dict[str, TokenTree] = {}        # proposed, awaiting verification
        self._slots: dict[str, torch.Tensor] = {}     # this step's KV slots of each tree
        self._paths: dict[str, list[int]] = {}        # accepted node indices of this step
        self.last_logprobs: list | None = None        # verify(): logprobs of rows sampled without drafts
        # Per-request [proposed, accepted], kept after the request ends for reporting; bounded.
        self._per_request: OrderedDict[str, list[int]] = OrderedDict()

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def for_executor(cls, executor, tree: str | None = None, max_draft_len: int | None = None,
                     top_k: int | None = None, depth: int | None = None,
                     tree_choices=None, min_draft_prob: float | None = None) -> "EagleSpeculator":
        """Build from the bundle's ``speculative`` section and ``draft/``; keyword overrides win
        (the bundle's ``min_draft_prob`` applies to chains only: another tree shape drops it)."""
        spec = executor.spec.manifest.speculative   # typed, defaults stated in backend/bundle.py
        if spec is None or spec.method != "eagle3":
            raise ValueError(f"{executor.spec.path}/engine.json: speculative.method is "
                             f"{spec and spec.method!r}; rebuild with speculative.method=eagle3")
        draft_dir = Path(executor.spec.path) / spec.draft_dir
        cfg, tensors = read_bundle_draft(draft_dir)
        runner = executor.runner
        target = executor.spec.model
        if cfg.hidden_size != target.hidden_size or cfg.vocab_size != target.vocab_size:
            raise ValueError(f"{draft_dir}/config.json: draft hidden/vocab {cfg.hidden_size}/{cfg.vocab_size} "
                             f"!= target {target.hidden_size}/{target.vocab_size}; rebuild the engine")
        if executor.spec.engine.runtime == "onnx-reference":   # the bundle's draft.onnx (draft_onnx.py)
            from backend.speculative.draft_onnx import GraphDraft
            if (tree or spec.tree) != "chain":
                raise ValueError(f"speculative.tree: {tree or spec.tree} with engine.runtime onnx-reference: "
                                 f"draft.onnx runs chains only; allowed: chain")
            e = executor.spec.engine
            draft = GraphDraft(Path(executor.spec.path), cfg, tensors.get("d2t"), e.max_batch_size, e.max_seq_len,
                               runner.dtype)
        else:
            model = runner.model
            draft = Eagle3Draft(cfg, tensors, model.embed_tokens, model.lm_head,
                                model.config.max_position_embeddings + 64, runner.device, runner.dtype)
        tree = tree or spec.tree
        if min_draft_prob is None:
            min_draft_prob = spec.min_draft_prob if tree == "chain" else 0.0
        grower = TreeGrower.from_settings(
            draft, tree,
            max_draft_len if max_draft_len is not None else spec.max_draft_len,
            top_k if top_k is not None else spec.top_k,
            depth if depth is not None else spec.depth,
            tree_choices if tree_choices is not None else spec.tree_choices, min_draft_prob)
        made = cls(draft, runner.kv_caches, grower, runner)
        made.pool = getattr(draft, "pool", made.pool)   # a graph draft's caches all live in its pool
        return made

    # -- the executor seam ----------------------------------------------------------------------
    def prepare(self, out, inputs) -> None:
        self._forget(out.finished_request_ids)
        self._forget(r.request_id for r in out.preempted)
        self._slots.clear()
        for s in out.scheduled:
            if not s.num_spec_tokens and s.sample:
                # A chain cut to nothing (min_draft_prob): this step is an ordinary decode for it.
                tree = self._trees.pop(s.request.request_id, None)
                if tree is not None and tree.num_nodes == 1:
                    self.stats.undrafted_steps += 1
        if not any(s.num_spec_tokens for s in out.scheduled):
            return
        meta = inputs.meta
        qsl = meta.query_start_loc.tolist()
        tree_rows: list[tuple[int, TokenTree]] = []
        for i, s in enumerate(out.scheduled):
            k = s.num_spec_tokens
            if not k:
                continue
            rid = s.request.request_id
            tree = _truncate(self._trees[rid], 1 + k)
            self._trees[rid] = tree
            r0 = qsl[i]
            self._slots[rid] = meta.slot_mapping[r0:r0 + 1 + k].clone()
            if not tree.is_chain():
                tree_rows.append((r0, tree))
                meta.positions[r0:r0 + 1 + k] = torch.tensor(tree.positions(s.start_pos),
                                                             dtype=meta.positions.dtype)
        if tree_rows:
            # Everything not in a tree keeps the causal rule (the backend ANDs this with causality).
            mask = torch.ones(inputs.num_tokens, meta.max_query_len, dtype=torch.bool)
            for r0, tree in tree_rows:
                n = tree.num_nodes
                mask[r0:r0 + n, :n] = torch.tensor(tree.attention_mask(), dtype=torch.bool)
            meta.tree_mask = mask.to(meta.positions.device)

    def verify(self, out, logits: torch.Tensor, rows, sampler) -> list[list[int]]:
        seqs = [s for s in out.scheduled if s.sample]
        assert len(seqs) == len(rows)
        starts, r = [], 0
        for s in seqs:
            starts.append(r)
            r += 1 + s.num_spec_tokens
        assert r == logits.shape[0], (r, logits.shape)
        result: list[list[int] | None] = [None] * len(seqs)
        self.last_logprobs: list | None = None
        plain = [j for j, s in enumerate(seqs) if not s.num_spec_tokens]
        if plain:  # requests without drafts: the ordinary sampler, one batched call
            idx = torch.tensor([starts[j] for j in plain], device=logits.device)
            res = sampler(logits.index_select(0, idx), [rows[j] for j in plain])
            for j, t in zip(plain, res.token_ids):
                result[j] = [int(t)]
            if res.logprobs and any(lp is not None for lp in res.logprobs):
                self.last_logprobs = [None] * len(seqs)
                for j, lp in zip(plain, res.logprobs):
                    self.last_logprobs[j] = lp
        for j, s in enumerate(seqs):
            if not s.num_spec_tokens:
                continue
            rid = s.request.request_id
            tree = self._trees.pop(rid)
            n = tree.num_nodes
            block = logits[starts[j]:starts[j] + n]
            if rows[j].guide is not None:   # structured output: each node under the grammar's mask
                from backend.engine.guided import apply_bitmask
                block = apply_bitmask(block.float().clone(),
                                      rows[j].guide.tree_masks(tree.tokens, tree.parents).to(block.device))
            path, bonus = accept_tree(tree, block, rows[j].params, rows[j].generator)
            if path != list(range(len(path))):
                self._compact_kv(self._slots[rid], path)
            self._paths[rid] = path
            toks = emitted_tokens(tree, path, bonus)
            result[j] = toks
            st = self.stats
            st.verify_steps += 1
            st.proposed += n - 1
            st.accepted += len(path) - 1
            st.emitted += len(toks)
            st.accept_hist[len(path) - 1] = st.accept_hist.get(len(path) - 1, 0) + 1
            pr = self._per_request.setdefault(rid, [0, 0])
            pr[0] += n - 1
            pr[1] += len(path) - 1
            self._per_request.move_to_end(rid)
            if len(self._per_request) > _PER_REQUEST_KEEP:
                self._per_request.popitem(last=False)
        return result  # type: ignore[return-value]

    def propose(self, out, inputs, captured: dict[int, torch.Tensor], finished) -> None:
        self._forget(r.request_id for r in finished)
        qsl = inputs.meta.query_start_loc.tolist()
        work = []  # (seq, request, committed token rows of this step)
        for i, s in enumerate(out.scheduled):
            req = s.request
            rid = req.request_id
            if req.status.is_finished or not _static_ok(req.params):
                self._forget([rid])
                continue
            path = self._paths.pop(rid, None)
            if s.num_spec_tokens and path is not None:
                rows = [qsl[i] + node for node in path]
            elif s.num_spec_tokens:
                continue  # verify did not run for it (aborted mid-step): no state to advance
            else:
                rows = list(range(qsl[i], qsl[i] + s.num_new_tokens))
            work.append((s, req, rows))
        if not work or self._propose_graphed(work, captured):
            return
        feats = self.draft.fuse(self._aux(captured, [r for _, _, rows in work for r in rows]))
        # Every sequence's newly committed rows go through the draft in ONE call, then every tree
        # is grown depth by depth in one call per depth: the draft's cost scales with the batch's
        # rows, not its number of sequences.
        keep, slices, states, off = [], [], [], 0
        for s, req, rows in work:
            m = len(rows)
            rid = req.request_id
            st = self._states.get(rid)
            if st is None or st.next_pos != s.start_pos:
                # New request, or its history changed (preemption, prefix-cache hit): start over
                # from here; the draft just sees less context.
                if st is not None:
                    self._release(st)
                st = self._states[rid] = _SeqState(self._new_cache(), s.start_pos)
            toks = req.all_token_ids
            assert len(toks) >= st.next_pos + m + 1 or not s.sample, (len(toks), st.next_pos, m)
            use = min(m, len(toks) - 1 - st.next_pos)   # a prompt chunk's last token waits for its successor
            if use > 0:
                keep.append(torch.arange(off, off + use))
                slices.append(DraftSlice(use, st.cache, st.cache.length))
                states.append((s, req, st, use))
            off += m
        if not states:
            return
        dev = self.draft.device
        tokens = torch.tensor([t for _, req, st, use in states
                               for t in req.all_token_ids[st.next_pos + 1:st.next_pos + 1 + use]], device=dev)
        positions = torch.cat([torch.arange(st.next_pos, st.next_pos + use) for _, _, st, use in states]).to(dev)
        h = self.draft.step_many(feats.index_select(0, torch.cat(keep).to(dev)), tokens, positions, slices)
        grow: list[GrowRequest] = []
        grown: list = []
        end = 0
        for s, req, st, use in states:
            end += use
            st.cache.length += use
            st.next_pos += use
            st.last_out = h[end - 1:end]
            rid = req.request_id
            if s.sample and speculation_allowed(req.params, len(req.output_token_ids)) \
                    and st.next_pos == len(req.all_token_ids) - 1:
                grow.append(GrowRequest(st.cache, st.last_out, req.all_token_ids[-1], st.next_pos))
                grown.append(req)
            else:
                self._trees.pop(rid, None)
                req.spec_token_ids = []
        for req, tree in zip(grown, self.grower.grow_many(grow)):
            self._trees[req.request_id] = tree
            req.spec_token_ids = list(tree.tokens[1:])

    def _aux(self, captured: dict[int, torch.Tensor], rows: list[int]) -> torch.Tensor:
        """The draft's input for the step's token ``rows``: the target's aux layers side by side."""
        idx = torch.tensor(rows, device=self.draft.device)
        return torch.cat([captured[layer].index_select(0, idx) for layer in self.capture_hidden_layers], -1)

    def _propose_graphed(self, work, captured: dict[int, torch.Tensor]) -> bool:
        """``propose`` as one graph replay (``ChainDraftGraphs.run_commit``) when the step allows it:
        every sequence has a pooled draft state that this step's committed rows continue, all of them
        (at most k + 1: a decode or verify step, no prompt chunk) are fed, and a chain is grown for
        each. Otherwise (returns False) the eager path below runs for the whole step."""
        g = self.grower.graphs
        if g is None:
            return False
        items = []
        for s, req, rows in work:
            st = self._states.get(req.request_id)
            if (st is None or st.next_pos != s.start_pos or not s.sample
                    or len(req.all_token_ids) - 1 - st.next_pos != len(rows)
                    or not speculation_allowed(req.params, len(req.output_token_ids))):
                return False
            items.append((req, st, rows))
        counts = [len(rows) for _, _, rows in items]
        if not g.commit_usable(counts, [st.cache for _, st, _ in items]):
            return False
        aux = self._aux(captured, [r for _, _, rows in items for r in rows])
        tokens, positions = [], []
        for req, st, rows in items:
            tokens += req.all_token_ids[st.next_pos + 1:st.next_pos + 1 + len(rows)]
            positions += range(st.next_pos, st.next_pos + len(rows))
        drafts, logps, last = g.run_commit(aux, counts, tokens, positions, [st.cache for _, st, _ in items])
        for i, (req, st, rows) in enumerate(items):
            st.cache.length += len(rows)
            st.next_pos += len(rows)
            st.last_out = last[i:i + 1]
            tree = self.grower.chain_tree(req.all_token_ids[-1], drafts[i], logps[i])
            self._trees[req.request_id] = tree
            req.spec_token_ids = list(tree.tokens[1:])
        return True

    def request_stats(self, request_id: str) -> dict:
        """Draft tokens scored and kept for one (recent) request."""
        proposed, accepted = self._per_request.get(request_id, (0, 0))
        return {"draft_tokens_proposed": proposed, "draft_tokens_accepted": accepted}

    # -- helpers ------------------------------------------------------------------------------
    def _compact_kv(self, slots: torch.Tensor, path: list[int]) -> None:
        """Move accepted node j's KV (slot of node ``path[j]``) to slot ``start + j`` in every layer.
        ``path[j] >= j`` (topological order), so no copy overwrites a source still to be read."""
        src = torch.tensor([path[j] for j in range(1, len(path)) if path[j] != j], device=slots.device)
        dst = torch.tensor([j for j in range(1, len(path)) if path[j] != j], device=slots.device)
        s_slots, d_slots = slots[src], slots[dst]
        for k_cache, v_cache in self.kv_caches:
            nb, bs = k_cache.shape[:2]
            for cache in (k_cache, v_cache):
                flat = cache.view(nb * bs, *cache.shape[2:])
                flat[d_slots] = flat[s_slots]

    def _new_cache(self) -> DraftKV:
        """A pooled cache when there is a pool with a free slot (the chain graph needs one), else
        a private growable one (the eager path serves it)."""
        return (self.pool.acquire() if self.pool is not None else None) or self.draft.new_cache()

    def _release(self, st: _SeqState) -> None:
        if self.pool is not None:
            self.pool.release(st.cache)

    def _forget(self, request_ids) -> None:
        for rid in request_ids:
            st = self._states.pop(rid, None)
            if st is not None:
                self._release(st)
            self._trees.pop(rid, None)
            self._paths.pop(rid, None)


def _truncate(tree: TokenTree, n: int) -> TokenTree:
    """The scheduler may verify fewer drafts than proposed (room, budget): keep the first ``n``
    nodes, which is still a tree because nodes are in topological order."""
    if n >= tree.num_nodes:
        return tree
    return TokenTree(tree.tokens[:n], tree.parents[:n])


def _static_ok(params) -> bool:
    """Requests that will never get drafts need no draft state either."""
    return speculation_allowed(params, 1 << 30)


def attach(executor, **overrides) -> EagleSpeculator:
    """Turn speculation on for an executor whose bundle has an EAGLE-3 draft."""
    spec = EagleSpeculator.for_executor(executor, **overrides)
    executor.speculator = spec
    return spec


__all__ = ["EagleSpeculator", "SpecStats", "attach"]
