"""Tensor-parallel sharding of a bundle's runtime tensors: rank ``r`` of ``tp`` gets its share.

Pure (tensors in, tensors out, no process group), so the builder can write per-rank files ahead of
time as TensorRT-LLM's per-rank engines do, and a test can check shapes without any process.
The split follows Megatron-LM for Llama (names: docs/contracts.md section 3):

- ``qkv`` column-parallel by heads: rank r keeps its q heads' rows, then its kv heads' k rows, then
  their v rows, so the rank's fused projection is again ``q | k | v`` of a model with heads/tp.
- ``gate_up`` column-parallel: rank r keeps its slice of gate AND of up (``silu(gate) * up`` pairs
  them row for row, so both halves must come from the same intermediate columns).
- ``o`` and ``down`` row-parallel: their input columns split, outputs are partial sums all-reduced.
- ``embed_tokens`` and ``lm_head`` vocab-parallel: rows ``[r*V/tp, (r+1)*V/tp)``.
- Per-output-row scales go with their rows; per-tensor scales (``input_scale``, KV ``k/v_scale``)
  and norms are replicated. A row-parallel bias is replicated: the model adds it after the reduce.
"""
from __future__ import annotations

import dataclasses

import torch

from backend.model.config import ModelConfig

# Formats whose per-linear tensors this module knows how to split. Block-scaled 4-bit formats
# (nvfp4, int4_awq) need their group scales split along the input dim of o/down: not done yet.
SHARDABLE_FORMATS = ("none", "fp8")
# The tensors a linear may carry in those formats (anything else is refused, never replicated blindly).
_LINEAR_PARTS = ("weight", "weight_scale", "input_scale", "bias")
_COLUMN = ("qkv", "gate_up")      # output rows split
_ROW = ("o", "down")              # input columns split, outputs all-reduced


class ShardError(ValueError):
    """The model or its format cannot be split ``tp_size`` ways: one line naming the numbers."""


def check_tp(config: ModelConfig, quant_format: str, tp_size: int) -> None:
    """Refuse a split that would not give every rank whole heads, equal slices and a known format."""
    if tp_size < 1:
        raise ShardError(f"tp_size: {tp_size}; must be a positive integer")
    if quant_format not in SHARDABLE_FORMATS:
        raise ShardError(f"quantization.format {quant_format!r} cannot be sharded for tp_size={tp_size} yet; "
                         f"allowed: {', '.join(SHARDABLE_FORMATS)}")
    for what, n in (("attention heads", config.num_heads), ("KV heads", config.num_kv_heads),
                    ("intermediate_size", config.intermediate_size), ("vocab_size", config.vocab_size)):
        if n % tp_size:
            # Uneven vocab slices would need padded gathers; uneven heads cannot be split at all.
            raise ShardError(f"tp_size={tp_size} does not divide the model's {n} {what}; "
                             f"allowed: a tp_size that divides {n}")


def shard_config(config: ModelConfig, tp_size: int) -> ModelConfig:
    """The model one rank computes: heads, KV heads, intermediate size and vocab divided by ``tp_size``
    (hidden size and head_dim unchanged), so ``backend.model.llama``'s layer code runs as it is."""
    return dataclasses.replace(config, num_heads=config.num_heads // tp_size,
                               num_kv_heads=config.num_kv_heads // tp_size,
                               intermediate_size=config.intermediate_size // tp_size,
                               vocab_size=config.vocab_size // tp_size)


def _rows(t: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
    """The rows ``[start, start+n)`` of each span, concatenated into new storage (a view would keep the
    whole tensor alive, and a rank must hold only its share)."""
    return torch.cat([t.narrow(0, s, n) for s, n in spans]).clone() if len(spans) > 1 \
        else t.narrow(0, *spans[0]).clone()


def _column_parallel(parts: dict[str, torch.Tensor], spans: list[tuple[int, int]], out: int,
                     where: str) -> dict[str, torch.Tensor]:
    got = {}
    for name, t in parts.items():
        if name == "input_scale" or (name == "weight_scale" and t.numel() == 1):
            got[name] = t.clone()                       # per-tensor: every rank quantizes alike
        elif t.shape[0] == out:
            got[name] = _rows(t, spans)                 # weight, per-row weight_scale, bias
        else:
            raise ShardError(f"{where}.{name}: shape {tuple(t.shape)}; expected {out} rows or one value")
    return got


def _row_parallel(parts: dict[str, torch.Tensor], start: int, n: int, inp: int,
                  where: str) -> dict[str, torch.Tensor]:
    got = {}
    for name, t in parts.items():
        if name == "weight":
            if t.dim() != 2 or t.shape[1] != inp:
                raise ShardError(f"{where}.weight: shape {tuple(t.shape)}; expected {inp} input columns")
            got[name] = t.narrow(1, start, n).contiguous().clone()
        else:
            # Every output row stays on every rank: its scale and bias too (bias added after the reduce).
            got[name] = t.clone()
    return got


def _linear_parts(weights: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    parts = {k[len(prefix) + 1:]: v for k, v in weights.items() if k.startswith(prefix + ".")}
    unknown = sorted(set(parts) - set(_LINEAR_PARTS))
    if unknown:
        raise ShardError(f"{prefix}: tensors {', '.join(unknown)} are not part of a shardable linear "
                         f"(formats {', '.join(SHARDABLE_FORMATS)})")
    if "weight" not in parts:
        raise ShardError(f"{prefix}.weight: missing")
    return parts


def shard_weights(weights: dict[str, torch.Tensor], config: ModelConfig, quant_format: str,
                  tp_size: int, rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s tensors, named as the unsharded bundle's (its model is ``shard_config``'s).
    Every name of ``weights`` is accounted for: an unknown one is refused rather than copied."""
    check_tp(config, quant_format, tp_size)
    if not 0 <= rank < tp_size:
        raise ShardError(f"rank {rank}: outside tp_size={tp_size}")
    c, d = config, config.head_dim
    qh, kvh, inter = c.num_heads // tp_size, c.num_kv_heads // tp_size, c.intermediate_size // tp_size
    qkv_spans = [(rank * qh * d, qh * d), (c.q_size + rank * kvh * d, kvh * d),
                 (c.q_size + c.kv_size + rank * kvh * d, kvh * d)]
    gate_up_spans = [(rank * inter, inter), (c.intermediate_size + rank * inter, inter)]
    vocab = c.vocab_size // tp_size
    out: dict[str, torch.Tensor] = {}
    done: set[str] = set()

    def take(name: str, t: torch.Tensor) -> None:
        out[name] = t
        done.add(name)

    for name in ("embed_tokens.weight", "lm_head.weight"):
        if name in weights:
            t = weights[name]
            if t.shape[0] != c.vocab_size:
                raise ShardError(f"{name}: {t.shape[0]} rows; model.vocab_size is {c.vocab_size}")
            take(name, _rows(t, [(rank * vocab, vocab)]))
    if "norm.weight" in weights:
        take("norm.weight", weights["norm.weight"].clone())
    for i in range(c.num_layers):
        p = f"layers.{i}"
        for name in ("input_norm.weight", "post_attn_norm.weight", "attn.k_scale", "attn.v_scale"):
            if f"{p}.{name}" in weights:
                take(f"{p}.{name}", weights[f"{p}.{name}"].clone())
        for lin, spans, rows in (("qkv", qkv_spans, c.q_size + 2 * c.kv_size),
                                 ("gate_up", gate_up_spans, 2 * c.intermediate_size)):
            parts = _linear_parts(weights, f"{p}.{lin}")
            for k, v in _column_parallel(parts, spans, rows, f"{p}.{lin}").items():
                take(f"{p}.{lin}.{k}", v)
        for lin, n, inp in (("o", c.q_size // tp_size, c.q_size), ("down", inter, c.intermediate_size)):
            parts = _linear_parts(weights, f"{p}.{lin}")
            for k, v in _row_parallel(parts, rank * n, n, inp, f"{p}.{lin}").items():
                take(f"{p}.{lin}.{k}", v)
    left = sorted(set(weights) - done)
    if left:
        raise ShardError(f"tensors not covered by tensor-parallel sharding: {', '.join(left[:5])}"
                         f"{' ...' if len(left) > 5 else ''}")
    return out
