"""CUDA graphs for decode steps: one captured forward per batch-size bucket, replayed every step.

Why: a decode step of an eager PyTorch model launches a thousand or more small kernels, and the host
cannot issue them as fast as the GPU runs them (measured on an H200, Llama-3.1-8B shape: 30 ms per
token at batch 1 against a 1.9 ms bandwidth floor). A replayed graph issues them all in one call.

How: static input buffers sized for the largest bucket; a step of T decode sequences is padded to the
smallest bucket B >= T (padding rows: KV slot -1 = not written, sequence length 0 = empty attention),
copied into the buffers, and graph B is replayed; its logits rows [:T] are the step's. Attention runs
with the engine's max_seq_len as its bound, so the decode kernel's split count, fixed at capture, fits
every later step. Only pure decode steps with the triton attention backend and no captured hidden
states (EAGLE) take this path; everything else runs eagerly.

``capture=False`` replays nothing: the same padded static-buffer forward runs eagerly. That is how
the CPU tests check the padding and buffer logic, which is where this can go wrong.
"""
from __future__ import annotations

import torch

from backend.attention.metadata import AttentionMetadata


def buckets(max_batch: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then steps of 8 to 64, then steps of 32 (vLLM's spacing)."""
    sizes = [1, 2, 4] + list(range(8, 65, 8)) + list(range(96, max(96, max_batch) + 32, 32))
    return sorted({s for s in sizes if s < max_batch} | {max_batch})


class DecodeGraphs:
    def __init__(self, model, kv_caches, max_batch: int, max_blocks: int, max_seq_len: int,
                 device: torch.device, capture: bool = True) -> None:
        self.model, self.kv_caches = model, kv_caches
        self.sizes = buckets(max_batch)
        self.max_seq_len = max_seq_len
        self.capture = capture
        self.device = device
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[object, torch.Tensor]] = {}
        self.steps = 0       # decode steps that took this path (replayed, or run eagerly when not capturing)
        self.failed: str | None = None    # why capture failed (then the runner stops using this)

    def usable(self, input_ids: torch.Tensor, meta: AttentionMetadata, capture_layers) -> bool:
        t = int(input_ids.shape[0])
        return (self.failed is None and meta.num_prefills == 0 and meta.tree_mask is None and not capture_layers
                and 0 < t <= self.sizes[-1] and meta.num_decode_tokens == t == meta.num_seqs
                and meta.block_tables.shape[1] <= self.block_tables.shape[1])

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(
            positions=self.positions[:b], slot_mapping=self.slot_mapping[:b], block_tables=self.block_tables[:b],
            seq_lens=self.seq_lens[:b], query_start_loc=self.query_start_loc[:b + 1],
            context_lens=self.context_lens[:b], num_prefills=0, num_prefill_tokens=0, num_decode_tokens=b,
            max_query_len=1, max_seq_len=self.max_seq_len)

    def _forward(self, b: int) -> torch.Tensor:
        hidden, _ = self.model.forward(self.input_ids[:b], self._meta(b), self.kv_caches, ())
        return self.model.compute_logits(hidden)

    def _capture_all(self) -> None:
        """Largest first, into one memory pool: a smaller graph reuses the larger one's activations
        (graphs never run at once, and each step's logits are consumed before the next replay)."""
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):       # warm-up off the default stream: compiles, cuBLAS handles
            for b in self.sizes:
                self._forward(b)
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        for b in reversed(self.sizes):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                out = self._forward(b)
            self.graphs[b] = (g, out)

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Logits ``[T, V]`` of a pure decode step (``usable`` was true)."""
        t = int(input_ids.shape[0])
        b = next(s for s in self.sizes if s >= t)
        w = meta.block_tables.shape[1]
        self.steps += 1
        self.input_ids[:t].copy_(input_ids)
        self.positions[:t].copy_(meta.positions)
        self.slot_mapping[:t].copy_(meta.slot_mapping)
        self.block_tables[:t, :w].copy_(meta.block_tables)
        self.seq_lens[:t].copy_(meta.seq_lens)
        if b > t:   # padding rows: nothing written, nothing attended
            self.slot_mapping[t:b].fill_(-1)
            self.seq_lens[t:b].zero_()
            self.positions[t:b].zero_()
        if not self.capture:
            return self._forward(b)[:t]
        if not self.graphs:
            try:
                self._capture_all()
            except Exception as exc:  # noqa: BLE001 - graphs are a speed-up: never the engine's failure
                import warnings
                self.graphs.clear()
                self.failed = f"{type(exc).__name__}: {exc}"
                warnings.warn(f"CUDA graph capture failed ({self.failed}); decoding eagerly", RuntimeWarning)
                torch.cuda.synchronize(self.device)
                return self._forward(b)[:t]
        # (warm-up and capture only read the input buffers: they still hold this step's inputs)
        g, out = self.graphs[b]
        g.replay()
        return out[:t]
