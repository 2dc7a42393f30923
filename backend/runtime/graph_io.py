"""The decoder graph's inputs and outputs: the contract between the ONNX export (builder/tensorrt/),
the runners that execute the graph (``engine.runtime`` onnx-reference and tensorrt) and the TensorRT
plan's optimization profiles.

One graph runs any step the native runner runs: prefill chunks, decodes and tree-masked speculative
verifications, mixed. Everything per step comes in as tensors; Kiln's KV manager owns the paged pool
(``k_cache.{i}``/``v_cache.{i}``, one pair per layer) and the block tables, the graph writes the step's
keys and values into the pool (``k_cache_out.{i}`` alias ``k_cache.{i}``: TensorRT binds both to one
address; the ONNX reference returns the same array) and reads context from it.

Symbolic dimensions: ``tokens`` (T, this step's tokens), ``seqs`` (B), ``table`` (block-table width),
``tree`` (tree-mask width; 0 = plain causal attention among the step's tokens), ``rows`` (logits rows),
``blocks`` (the pool's blocks, decided at load from free memory: a plan accepts any count up to the
engine's limit).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# (name, dtype name, dims); dtype "kv" = the pool's dtype, "model" = the model's compute dtype
STEP_INPUTS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("input_ids", "int64", ("tokens",)),
    ("positions", "int64", ("tokens",)),
    ("slot_mapping", "int64", ("tokens",)),          # -1: a padding token, nothing written
    ("block_tables", "int32", ("seqs", "table")),
    ("query_start_loc", "int32", ("seqs_plus_1",)),
    ("context_lens", "int32", ("seqs",)),
    ("tree_mask", "bool", ("tokens", "tree")),
    ("logits_indices", "int64", ("rows",)),
)
KV_DIMS = ("blocks", "block_size", "kv_heads", "head_dim")
LOGITS = "logits"   # float32 [rows, vocab]


def k_cache(i: int) -> str:
    return f"k_cache.{i}"


def v_cache(i: int) -> str:
    return f"v_cache.{i}"


def k_cache_out(i: int) -> str:
    return f"k_cache_out.{i}"


def v_cache_out(i: int) -> str:
    return f"v_cache_out.{i}"


def hidden_out(i: int) -> str:
    """The residual stream after layer ``i`` (an EAGLE-3 draft's auxiliary input), ``model`` [tokens, hidden]."""
    return f"hidden.{i}"


# The EAGLE-3 draft's graph (``draft.onnx``, builder/tensorrt/draft_export.py): one draft step over
# ``tokens`` entries, the same step tensors as the decoder's (positions, slots, block tables and tree
# mask address the draft's OWN paged pool, ``draft_k_cache``/``draft_v_cache``). Each entry's feature
# is, for the first ``aux_tokens`` rows, the target's aux layers side by side through ``fc``, for the
# rest the draft's own pre-norm output of the step before (EAGLE's recurrence), so tokens =
# aux_tokens + draft_tokens and the caller orders its rows that way. Dims ``aux_width`` (aux layers x
# hidden) and ``hidden`` are the model's, fixed at export.
DRAFT_GRAPH = "draft.onnx"
_STEP = {name: (name, dtype, dims) for name, dtype, dims in STEP_INPUTS}
DRAFT_INPUTS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    _STEP["input_ids"],                                   # the token AFTER each entry's position
    ("aux_hidden", "model", ("aux_tokens", "aux_width")),
    ("draft_hidden", "model", ("draft_tokens", "hidden")),
    *(_STEP[n] for n in ("positions", "slot_mapping", "block_tables", "query_start_loc", "context_lens",
                         "tree_mask", "logits_indices")),
)
DRAFT_K_CACHE, DRAFT_V_CACHE = "draft_k_cache", "draft_v_cache"
DRAFT_K_CACHE_OUT, DRAFT_V_CACHE_OUT = "draft_k_cache_out", "draft_v_cache_out"
DRAFT_LOGITS = "draft_logits"          # float32 [rows, draft_vocab]: draft ids (d2t is the host's)
DRAFT_HIDDEN_OUT = "draft_hidden_out"  # model [tokens, hidden]: pre-norm outputs, the next step's features


def step_feeds(input_ids: "torch.Tensor", meta, logits_indices: "torch.Tensor") -> dict[str, "torch.Tensor"]:
    """One step's graph inputs (the pool excluded) from what the executor gives every runner."""
    import torch
    tree = meta.tree_mask
    if tree is None:
        tree = torch.zeros((input_ids.shape[0], 0), dtype=torch.bool, device=input_ids.device)
    return {"input_ids": input_ids, "positions": meta.positions, "slot_mapping": meta.slot_mapping,
            "block_tables": meta.block_tables, "query_start_loc": meta.query_start_loc,
            "context_lens": meta.context_lens, "tree_mask": tree, "logits_indices": logits_indices}


@dataclass(frozen=True)
class Profile:
    """One optimization profile: each symbolic dimension's (min, opt, max)."""
    name: str
    dims: dict[str, tuple[int, int, int]]


def profiles(max_batch_size: int, max_num_tokens: int, max_seq_len: int, block_size: int,
             max_draft_tokens: int = 0) -> list[Profile]:
    """The context profile (prefill chunks mixed with decodes, up to ``max_num_tokens`` tokens) and the
    generation profile (decode / verify steps: up to 1 + ``max_draft_tokens`` tokens per sequence),
    both derived from the engine's limits so the plan accepts every step the scheduler can form."""
    table = -(-(max_seq_len + 64) // block_size)       # the executor's block-table width
    blocks = max(1, max_batch_size * -(-max_seq_len // block_size))
    per_seq = 1 + max_draft_tokens
    tree = (0, 0, per_seq) if max_draft_tokens else (0, 0, 0)
    gen_tokens = max_batch_size * per_seq
    common = {"table": (1, table, table), "blocks": (1, blocks, blocks), "tree": tree}
    context = Profile("context", dict(common, tokens=(1, max_num_tokens, max_num_tokens),
                                      seqs=(1, max_batch_size, max_batch_size),
                                      seqs_plus_1=(2, max_batch_size + 1, max_batch_size + 1),
                                      rows=(1, max_batch_size, gen_tokens)))
    generation = Profile("generation", dict(common, tokens=(1, gen_tokens, gen_tokens),
                                            seqs=(1, max_batch_size, max_batch_size),
                                            seqs_plus_1=(2, max_batch_size + 1, max_batch_size + 1),
                                            rows=(1, gen_tokens, gen_tokens)))
    return [context, generation]
