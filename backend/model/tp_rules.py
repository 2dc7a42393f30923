"""Which tensor-parallel splits a model allows: the rules alone, with no torch.

One place for them so that the builder's config check (``builder/config.py``, which imports no
torch) refuses exactly what ``tp_shard`` cannot split and the runtime's ``check_tp`` refuses.
``model`` is anything with the four split dimensions: a ``ModelConfig`` or engine.json's ``model``
section as a dict.
"""
from __future__ import annotations

from typing import Any

# Formats whose per-linear tensors tp_shard knows how to split. Block-scaled 4-bit formats
# (nvfp4, int4_awq) need their group scales split along the input dim of o/down: not done yet.
SHARDABLE_FORMATS = ("none", "fp8")
# The largest tp_size a config may ask for (an 8-GPU node times 8 nodes); a model's heads bound it anyway.
MAX_TP_SIZE = 64


class ShardError(ValueError):
    """The model or its format cannot be split ``tp_size`` ways: one line naming the numbers."""


def _dims(model: Any) -> tuple[tuple[str, int], ...]:
    get = model.get if isinstance(model, dict) else (lambda k: getattr(model, k))
    # Uneven vocab slices would need padded gathers; uneven heads cannot be split at all.
    return (("attention heads", get("num_heads")), ("KV heads", get("num_kv_heads")),
            ("intermediate_size", get("intermediate_size")), ("vocab_size", get("vocab_size")))


def allowed_tp_sizes(model: Any, limit: int = MAX_TP_SIZE) -> list[int]:
    """Every tp_size up to ``limit`` that gives each rank whole heads and equal slices."""
    return [t for t in range(1, limit + 1) if all(n % t == 0 for _, n in _dims(model))]


def tp_problem(model: Any, tp_size: int) -> str | None:
    """Why ``model`` cannot be split ``tp_size`` ways (the first dimension it does not divide), or None."""
    for what, n in _dims(model):
        if n % tp_size:
            return f"{tp_size} does not divide the model's {n} {what}"
    return None


def check_tp(model: Any, quant_format: str, tp_size: int) -> None:
    """Refuse a split that would not give every rank whole heads, equal slices and a known format."""
    if tp_size < 1:
        raise ShardError(f"tp_size: {tp_size}; must be a positive integer")
    if quant_format not in SHARDABLE_FORMATS:
        raise ShardError(f"quantization.format {quant_format!r} cannot be sharded for tp_size={tp_size} yet; "
                         f"allowed: {', '.join(SHARDABLE_FORMATS)}")
    problem = tp_problem(model, tp_size)
    if problem:
        raise ShardError(f"tp_size={problem}; allowed: {' | '.join(map(str, allowed_tp_sizes(model)))}")
