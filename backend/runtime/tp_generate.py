"""Greedy decoding over a tensor-parallel runner: rank 0 decides, every rank follows.

The smallest form of #20's process model (before ``Executor`` spawns workers itself): all ranks run
the same steps on the same inputs; rank 0 alone sees the logits (``TPLlamaModel.compute_logits``),
picks the token and broadcasts it, which is the next step's input on every rank. With no process
group (tp 1, a plain ``ModelRunner``) the same loop runs in one process, so both sides of a TP-vs-TP1
comparison are driven by one piece of code.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from backend.runtime.native import prefill_meta
from backend.runtime.spec import load_engine_spec
from backend.ops.attention.metadata import AttentionMetadata


@dataclass
class Greedy:
    """One prompt's greedy continuation and the fp32 logits each token was picked from (rank 0)."""
    tokens: list[int]
    logits: torch.Tensor   # [steps, vocab]


def decode_meta(pos: int, block_size: int) -> AttentionMetadata:
    """One sequence's decode step at position ``pos`` with its cache in blocks 0.. ."""
    i32 = torch.int32
    nblk = -(-(pos + 1) // block_size)
    return AttentionMetadata(
        positions=torch.tensor([pos]), slot_mapping=torch.tensor([pos]),
        block_tables=torch.arange(nblk, dtype=i32).view(1, -1), seq_lens=torch.tensor([pos + 1], dtype=i32),
        query_start_loc=torch.tensor([0, 1], dtype=i32), context_lens=torch.tensor([pos], dtype=i32),
        num_prefills=0, num_prefill_tokens=0, num_decode_tokens=1, max_query_len=1, max_seq_len=pos + 1)


def _pick(logits: torch.Tensor | None, distributed: bool) -> int:
    """Rank 0's argmax, broadcast so that every rank feeds the same token next."""
    tok = torch.tensor([int(logits[0].argmax())] if logits is not None else [0], dtype=torch.int64)
    if distributed:
        dist.broadcast(tok, src=0)
    return int(tok[0])


def greedy(execute: Callable, block_size: int, prompts: list[list[int]], steps: int,
           distributed: bool = False, forced: list[list[int]] | None = None) -> list[Greedy]:
    """``steps`` greedy tokens per prompt, one prompt at a time (each reuses blocks 0..). ``execute``
    is ``ModelRunner.execute`` or ``TPRunner.execute``; logits are kept where they arrive (rank 0).
    ``forced``: feed these tokens instead (teacher forcing: logits of two models on one sequence)."""
    out = []
    with torch.inference_mode():
        for n, ids in enumerate(prompts):
            t = len(ids)
            logits, _ = execute(torch.tensor(ids), prefill_meta(t, block_size, torch.device("cpu")),
                                torch.tensor([t - 1]))
            rows, tokens = [], []
            for step in range(steps):
                if logits is not None:
                    rows.append(logits[0].clone())
                tokens.append(forced[n][step] if forced is not None else _pick(logits, distributed))
                if step + 1 < steps:
                    logits, _ = execute(torch.tensor([tokens[-1]]), decode_meta(t + step, block_size),
                                        torch.tensor([0]))
            out.append(Greedy(tokens, torch.stack(rows) if rows else torch.empty(0)))
    return out


def greedy_worker(rank: int, tp_size: int, bundle: str, prompts: list[list[int]], steps: int,
                  num_blocks: int, dtype: str, out: str, overrides: dict | None = None,
                  forced: list[list[int]] | None = None) -> None:
    """``backend.runtime.tp.spawn`` target: each rank builds its ``TPRunner``, decodes, and saves what
    it holds (the shapes of its weights and KV cache) to ``<out>.rank<r>``; rank 0 adds the results."""
    from backend.runtime.tp import TPRunner
    spec = load_engine_spec(bundle, overrides)
    runner = TPRunner(spec, tp_size, rank, num_blocks, dtype=getattr(torch, dtype))
    m = runner.model
    held = {"embed_tokens": tuple(m.embed_tokens.shape), "lm_head": tuple(m.lm_head.shape),
            "kv_cache": tuple(runner.kv_caches[0][0].shape)}
    for i, layer in enumerate(m.layers):
        for name in ("qkv", "o", "gate_up", "down"):
            lin = getattr(layer, name)
            held[f"layers.{i}.{name}"] = tuple(getattr(lin, "linear", lin).weight.shape)
    results = greedy(runner.execute, runner.block_size, prompts, steps, distributed=True, forced=forced)
    saved = [{"tokens": r.tokens, "logits": r.logits} for r in results] if rank == 0 else None
    torch.save({"held": held, "results": saved}, Path(f"{out}.rank{rank}"))
