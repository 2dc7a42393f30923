"""Time a bundle's decode step in candidate compute dtypes, from one layer (``cpu_dtype``'s evidence).

A decode step costs ``num_layers`` decoder layers plus the logits matmul, so this builds layer 0 from
the bundle's own tensors in each dtype (``llama.build_layer``: the linears' real shapes, format and
CPU storage), a KV cache and the metadata of a decode step of ``rows`` sequences at ``context``
tokens, and runs ``llama.decoder_layer`` through the torch attention backend (the CPU's): the same
ops a real step runs. The logits matmul is timed on a slice of the head's rows (the full
vocabulary's weight would be a second copy in each dtype) and scaled to the vocabulary.

Robust to a shared, noisy machine: timed on ONE thread (restored after), dtypes interleaved within
each repetition (a burst of load hits both), a warm-up repetition dropped, the median kept. One
thread because with two threads on two cores that other processes also use, every op waits for
its slower thread at the end: medians of the same op then varied 6x (1.6 vs 10 ms, SmolLM2's layer
with a neighbour at 100% of both cores), while single-thread medians stayed within 15% of their
minimum; what differs between the dtypes is each core's kernel, which one thread measures. About
half a second for SmolLM2; ``budget_s`` caps the repetitions for larger models.
"""
from __future__ import annotations

import time

import torch

from backend.runtime.cpu_dtype import median_ms
from backend.model import decoder_parts
from backend.model.layers import RotaryEmbedding
from backend.model.llama import build_layer, decoder_layer
from backend.ops import cpu_matmul
from backend.ops.attention import get_backend
from backend.ops.attention.metadata import AttentionMetadata

# Decode steps timed: (sequences, context tokens). One sequence is the latency case, 16 the
# concurrency the serving benchmark measures.
SHAPES = ((1, 256), (16, 256))
# Rows of the logits weight timed (then scaled to the vocabulary)
HEAD_ROWS = 8192


def _decode_meta(rows: int, context: int, block_size: int) -> AttentionMetadata:
    """A decode step of ``rows`` sequences, each ``context`` tokens in cache, in distinct blocks."""
    nblk = -(-(context + 1) // block_size)
    i32 = torch.int32
    tables = torch.arange(rows * nblk, dtype=i32).view(rows, nblk)
    slots = tables[:, context // block_size].long() * block_size + context % block_size
    return AttentionMetadata(
        positions=torch.full((rows,), context), slot_mapping=slots, block_tables=tables,
        seq_lens=torch.full((rows,), context + 1, dtype=i32),
        query_start_loc=torch.arange(rows + 1, dtype=i32), context_lens=torch.full((rows,), context, dtype=i32),
        num_prefills=0, num_prefill_tokens=0, num_decode_tokens=rows, max_query_len=1, max_seq_len=context + 1)


class _Case:
    """One dtype's layer, head slice, caches and inputs for every shape."""

    def __init__(self, spec, weights: dict[str, torch.Tensor], dtype: torch.dtype, kv_fp8: bool) -> None:
        c, bs = spec.model, spec.engine.kv_block_size
        dev = torch.device("cpu")
        self.c, self.dtype = c, dtype
        arch = c.arch_spec   # layer 0 as the model builds it: an expert layer's MLP is its experts
        self.layer = build_layer(weights, 0, spec.quant_format, dtype, dev, experts=arch.experts if arch else None)
        head = weights.get("lm_head.weight", weights.get("embed_tokens.weight"))
        self.head_scale = c.vocab_size / min(HEAD_ROWS, head.shape[0])
        self.head = cpu_matmul.prepare(head[:HEAD_ROWS].to(dtype))
        self.attention = get_backend("torch", "cpu")
        # an fp8 cache on CPU is stored in the compute dtype (see ModelRunner): time what runs
        self.attention.fp8_as_float = kv_fp8
        gen = torch.Generator().manual_seed(0)
        self.steps = []
        for rows, context in SHAPES:
            context = min(context, spec.engine.max_seq_len - 1)
            meta = _decode_meta(rows, context, bs)
            nblk = meta.block_tables.numel()
            kv = tuple(torch.randn(nblk, bs, c.num_kv_heads, c.head_dim, generator=gen).to(dtype) for _ in range(2))
            rope = RotaryEmbedding(c.head_dim, context + 1, *decoder_parts.rope_args(c, c.arch_spec))
            cos, sin = rope.tables(meta.positions, dtype)
            hidden = torch.randn(rows, c.hidden_size, generator=gen).to(dtype)
            self.steps.append((f"{rows} seq x {context} ctx", hidden, cos, sin, kv, meta))

    def run(self, k: int) -> tuple[float, float]:
        """Step shape ``k``: (seconds of the layer, seconds of the head slice)."""
        _name, hidden, cos, sin, kv, meta = self.steps[k]
        t0 = time.perf_counter()
        out = decoder_layer(self.c, self.layer, hidden, cos, sin, self.attention, kv, meta, self.c.head_dim ** -0.5)
        t1 = time.perf_counter()
        cpu_matmul.linear(out, self.head)
        return t1 - t0, time.perf_counter() - t1


def time_layers(spec, weights: dict[str, torch.Tensor], dtypes: tuple[torch.dtype, ...], kv_fp8: bool = False,
                reps: int = 9, budget_s: float = 1.5) -> dict[str, dict[str, float]]:
    """{dtype name: {shape: estimated decode-step ms}} = num_layers x the layer's median + the logits
    matmul's median scaled to the vocabulary, over ``reps`` interleaved repetitions (at least 3;
    fewer than ``reps`` once ``budget_s`` is spent)."""
    cases = [_Case(spec, weights, dt, kv_fp8) for dt in dtypes]
    layer = {(i, k): [] for i in range(len(cases)) for k in range(len(SHAPES))}
    head = {key: [] for key in layer}
    start = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            for rep in range(reps + 1):
                for k in range(len(SHAPES)):
                    for i, case in enumerate(cases):
                        t_layer, t_head = case.run(k)
                        if rep:   # repetition 0 warms up (first-call allocations, oneDNN primitive caches)
                            layer[(i, k)].append(t_layer)
                            head[(i, k)].append(t_head)
                if rep >= 3 and time.perf_counter() - start > budget_s:
                    break
    finally:
        torch.set_num_threads(threads)
    out: dict[str, dict[str, float]] = {}
    for i, case in enumerate(cases):
        out[str(case.dtype).removeprefix("torch.")] = {
            case.steps[k][0]: round(case.c.num_layers * median_ms(layer[(i, k)])
                                    + case.head_scale * median_ms(head[(i, k)]), 3)
            for k in range(len(SHAPES))}
    return out
