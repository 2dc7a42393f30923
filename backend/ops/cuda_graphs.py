"""CUDA graphs for decode and speculative-verify steps: captured forwards replayed every step.

Why: a step of an eager PyTorch model launches a thousand or more small kernels, and the host cannot
issue them as fast as the GPU runs them (measured on an H200, Llama-3.1-8B shape: 30 ms per token at
batch 1 against a 1.9 ms bandwidth floor). A replayed graph issues them all in one call. With EAGLE
every step is a verify pass (1 + k query rows per sequence) that also returns the draft's aux layers:
without graphs for those, speculation pays the eager price on every pass and cannot win.

A graph is keyed by ``(q, b, layers, tree)``: ``q`` the step's longest query (1 = plain decode, 1 + k
= a verify pass), ``b`` a batch-size bucket, ``layers`` the target layers whose outputs are returned
as well (EAGLE's aux layers) and ``tree`` whether the step has a token-tree mask. A step of ``t <= b`` sequences and ``T <= t*q`` query rows is copied
into static buffers of ``b*q`` rows and replayed; its rows ``[:T]`` are the step's. Padding: rows past
``T`` write no KV (slot -1); sequences past ``t`` have no query rows and length 0.

* ``q == 1``: the split-K decode kernel, bounded by the engine's max_seq_len (its split count is fixed
  at capture and fits every later step). A step whose bucket has no graph yet captures it and every
  smaller bucket still missing, so graphs exist up to the largest batch that has run, not up to
  max_batch_size (which may be set far above what the KV cache lets run: concurrency is then bounded by
  KV capacity alone, and capturing buckets no step reaches would cost start-up time and memory).
* ``q > 1``: the varlen prefill kernel, launched for ``q`` query rows per sequence (a sequence with
  fewer rows, a shorter chain, fits too); chains run its causal variant, trees its tree-mask variant
  with the mask in a static buffer. Captured lazily, one key at a time, as steps of that shape appear.

A graph returns the final hidden rows, not logits: the runner computes logits of the rows that sample
after the replay, as the eager path does. Per-bucket logits (``[b, vocab]`` fp32, 0.5 MB a row for a
128k vocabulary) kept alive by every graph would take gigabytes at large batches, out of the few percent
of device memory the KV pool leaves; three launches after a replay cost the GPU nothing (queued).

Only steps without prefill rows, with the triton attention backend, take this path; everything else
runs eagerly. ``capture=False`` replays nothing: the same padded static-buffer forward runs eagerly.
That is how the CPU tests check the padding and buffer logic, which is where this can go wrong.
"""
from __future__ import annotations

import dataclasses

import torch

from backend.logs import get_logger
from backend.ops.attention.metadata import AttentionMetadata

_LOG = get_logger("ops.cuda_graphs")

# Longest query per sequence that gets graphs (1 + max_draft_len of any sane speculation setting).
MAX_QUERY = 16


def buckets(max_batch: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then steps of 8 to 64, then steps of 32 (vLLM's spacing)."""
    sizes = [1, 2, 4] + list(range(8, 65, 8)) + list(range(96, max(96, max_batch) + 32, 32))
    return sorted({s for s in sizes if s < max_batch} | {max_batch})


def capture_graphs(fns: list, device: torch.device, pool) -> list[tuple[object, object]]:
    """Warm each ``fn`` up once on a side stream (kernel compiles, cuBLAS workspaces stay out of the
    graph), then capture each, in the order given, into the memory ``pool``: ``[(graph, outputs)]``."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for fn in fns:
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    out = []
    for fn in fns:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool):
            res = fn()
        out.append((g, res))
    return out


class _Buffers:
    """Static inputs of every graph of one query length ``q``: rows for the largest bucket."""

    def __init__(self, q: int, max_batch: int, max_blocks: int, device: torch.device) -> None:
        n, rows = max_batch, max_batch * q
        self.q = q
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((rows,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(n, dtype=torch.int32, device=device)
        # q == 1: every sequence is one row (fixed); q > 1: copied from the step, padded.
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device) * (1 if q == 1 else 0)
        self.tree_mask = torch.ones(rows, q, dtype=torch.bool, device=device) if q > 1 else None
        self.has_tree = False
        # the sliding layers' slots and block tables when they have a KV pool of their own
        # (backend/engine/kv_groups.py): made at the first such step, before any graph reads them
        self.window_slots: torch.Tensor | None = None
        self.window_tables: torch.Tensor | None = None

    def load(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> None:
        """Copy one step in; pad every row and sequence past it up to the largest bucket (a graph
        of any bucket may run next, or be captured now: stale slots must never be written)."""
        t, rows = meta.num_seqs, int(input_ids.shape[0])
        w = meta.block_tables.shape[1]
        self.input_ids[:rows].copy_(input_ids)
        self.positions[:rows].copy_(meta.positions)
        self.slot_mapping[:rows].copy_(meta.slot_mapping)
        self.slot_mapping[rows:].fill_(-1)
        self.positions[rows:].zero_()
        self.block_tables[:t, :w].copy_(meta.block_tables)
        if meta.window is not None:
            if self.window_slots is None:
                self.window_slots = torch.full_like(self.slot_mapping, -1)
                self.window_tables = torch.zeros_like(self.block_tables)
            self.window_slots[:rows].copy_(meta.window.slot_mapping)
            self.window_slots[rows:].fill_(-1)
            self.window_tables[:t, :w].copy_(meta.window.block_tables)
        self.seq_lens[:t].copy_(meta.seq_lens)
        self.seq_lens[t:].zero_()
        self.context_lens[:t].copy_(meta.context_lens)
        self.context_lens[t:].zero_()
        if self.q > 1:
            self.query_start_loc[:t + 1].copy_(meta.query_start_loc)
            self.query_start_loc[t + 1:].fill_(rows)     # padding sequences: no query rows
            self.has_tree = meta.tree_mask is not None
            if self.has_tree:
                mq = meta.max_query_len
                self.tree_mask[:rows, :mq].copy_(meta.tree_mask)
                self.tree_mask[:rows, mq:].fill_(True)

    def meta(self, b: int, max_seq_len: int, tree: bool) -> AttentionMetadata:
        r = b * self.q
        meta = AttentionMetadata(
            positions=self.positions[:r], slot_mapping=self.slot_mapping[:r], block_tables=self.block_tables[:b],
            seq_lens=self.seq_lens[:b], query_start_loc=self.query_start_loc[:b + 1],
            context_lens=self.context_lens[:b], num_prefills=0, num_prefill_tokens=0, num_decode_tokens=r,
            max_query_len=self.q, max_seq_len=max_seq_len,
            tree_mask=self.tree_mask[:r] if tree else None)
        if self.window_slots is not None:
            meta.window = dataclasses.replace(meta, slot_mapping=self.window_slots[:r],
                                              block_tables=self.window_tables[:b])
        return meta


class DecodeGraphs:
    """A runner's graphs (see the module docstring). ``agree(failure: str | None) -> str | None``, for a
    tensor-parallel rank: called by every rank after each capture attempt, returns a failure if any
    rank had one, so that all ranks then run that step and every later one eagerly together. A
    model whose forward holds collectives must capture and replay the same graphs in the same order
    on every rank: that holds because every choice here (``usable``, the bucket, the keys to
    capture, their order) is a function of the step's inputs, which every rank receives alike, and
    of this object's history, which is then alike too (``failed`` included, through ``agree``)."""

    def __init__(self, model, kv_caches, max_batch: int, max_blocks: int, max_seq_len: int,
                 device: torch.device, capture: bool = True, agree=None) -> None:
        self.model, self.kv_caches = model, kv_caches
        self.agree = agree
        self.sizes = buckets(max_batch)
        self.max_blocks, self.max_seq_len = max_blocks, max_seq_len
        self.capture = capture
        self.device = device
        self._buffers: dict[int, _Buffers] = {}
        # (q, b, layers, tree) -> (graph, final hidden [b*q, H], {layer: hidden [b*q, H]})
        self.graphs: dict[tuple, tuple[object, torch.Tensor, dict[int, torch.Tensor]]] = {}
        self._pool = None
        self.steps = 0       # steps that took this path (replayed, or run eagerly when not capturing)
        self.verify_steps = 0   # of which q > 1 (speculative verify passes)
        self.failed: str | None = None    # why capture failed (then the runner stops using this)

    def usable(self, input_ids: torch.Tensor, meta: AttentionMetadata, capture_layers) -> bool:
        t, q = meta.num_seqs, meta.max_query_len
        if (self.failed is not None or meta.num_prefills or not 0 < t <= self.sizes[-1] or not 1 <= q <= MAX_QUERY
                or meta.block_tables.shape[1] > self.max_blocks):
            return False
        if q == 1:
            return meta.tree_mask is None and meta.num_decode_tokens == t == int(input_ids.shape[0])
        return int(input_ids.shape[0]) == meta.num_decode_tokens <= t * q

    def _forward(self, q: int, b: int, layers: tuple[int, ...], tree: bool):
        buf = self._buffers[q]
        return self.model.forward(buf.input_ids[:b * q], buf.meta(b, self.max_seq_len, tree), self.kv_caches,
                                  layers)

    def _capture(self, keys: list[tuple]) -> None:
        """Largest first, into one memory pool: a smaller graph reuses a larger one's activations
        (graphs never run at once, and each step's outputs are consumed before the next replay).
        Warm-up and capture run on the step's own inputs (already in the buffers): the KV they
        write is the step's own, and padding rows write none."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        keys = sorted(keys, key=lambda k: -k[0] * k[1])
        made = capture_graphs([lambda key=key: self._forward(*key) for key in keys], self.device, self._pool)
        for key, (g, (hidden, captured)) in zip(keys, made):
            self.graphs[key] = (g, hidden, captured)

    def decode_keys_to_capture(self, b: int, layers: tuple[int, ...]) -> list[tuple]:
        """Plain-decode keys missing for a step of bucket ``b``: ``b`` and every smaller bucket."""
        return [k for k in ((1, s, layers, False) for s in self.sizes if s <= b) if k not in self.graphs]

    @property
    def captured_batch(self) -> int:
        """The largest plain-decode bucket captured so far (0: none)."""
        return max((k[1] for k in self.graphs if k[0] == 1), default=0)

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, meta: AttentionMetadata,
            capture_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The final (normed) hidden rows ``[T, H]`` of the step and the requested layers' outputs
        ``[T, H]`` (``usable`` was true). Both are views of static buffers: valid until the next replay."""
        t, q, rows = meta.num_seqs, meta.max_query_len, int(input_ids.shape[0])
        b = next(s for s in self.sizes if s >= t)
        layers = tuple(capture_layers)
        buf = self._buffers.get(q)
        if buf is None:
            buf = self._buffers[q] = _Buffers(q, self.sizes[-1], self.max_blocks, self.device)
        buf.load(input_ids, meta)
        self.steps += 1
        self.verify_steps += q > 1
        key = (q, b, layers, buf.has_tree)
        if not self.capture:
            hidden, captured = self._forward(*key)
        else:
            if key not in self.graphs:
                # plain decoding captures this bucket and every smaller one still missing (batches
                # shrink as requests finish: those buckets will be wanted); verify shapes one by one
                keys = self.decode_keys_to_capture(b, layers) if q == 1 else [key]
                failure = None
                try:
                    self._capture(keys)
                except Exception as exc:  # noqa: BLE001 - graphs are a speed-up: never the engine's failure
                    failure = f"{type(exc).__name__}: {exc}"
                if self.agree is not None:
                    failure = self.agree(failure)
                if failure is not None:
                    self.graphs.clear()
                    self.failed = failure
                    _LOG.warning("CUDA graph capture failed (%s); running steps eagerly", self.failed)
                    torch.cuda.synchronize(self.device)
                    buf.load(input_ids, meta)
                    hidden, captured = self._forward(*key)
                    return hidden[:rows], {i: h[:rows] for i, h in captured.items()}
            g, hidden, captured = self.graphs[key]
            g.replay()
        return hidden[:rows], {i: h[:rows] for i, h in captured.items()}
