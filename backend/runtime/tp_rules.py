"""Which tensor-parallel splits a model allows: the rules alone, with no torch.

One place for them so that the builder's config check (``builder/config.py``, which imports no
torch) refuses exactly what ``tp_shard`` cannot split and the runtime's ``check_tp`` refuses.
``model`` is anything with the split dimensions: a ``ModelConfig`` or engine.json's ``model``
section as a dict. Query heads, MLP columns and vocab rows split evenly; KV heads split evenly too, or,
when there are fewer of them than ranks (GQA down to one KV head), each rank holds the one its query
heads read (``kv_heads_of_rank``), replicated over tp / num_kv_heads ranks.
"""
from __future__ import annotations

from typing import Any

# Every format Kiln builds (builder/config.py QUANT_FORMATS): tp_shard splits each one's scales
# with their weights (docs/contracts.md section 4, "Tensor parallelism").
SHARDABLE_FORMATS = ("none", "fp8", "nvfp4", "int4_awq", "w4a8_awq", "int8_sq")
# Formats whose weight scales cover groups of input features (nvfp4's blocks are always 16 wide; the
# AWQ formats' width is quantization.group_size): a row-parallel split must fall on a group boundary.
NVFP4_BLOCK = 16
GROUP_SIZED_FORMATS = ("int4_awq", "w4a8_awq")
# The largest tp_size a config may ask for (an 8-GPU node times 8 nodes); a model's heads bound it anyway.
MAX_TP_SIZE = 64


class ShardError(ValueError):
    """The model or its format cannot be split ``tp_size`` ways: one line naming the numbers."""


def _get(model: Any, key: str) -> int:
    return model[key] if isinstance(model, dict) else getattr(model, key)


def _dims(model: Any) -> tuple[tuple[str, int], ...]:
    # Uneven vocab slices would need padded gathers; uneven heads cannot be split at all. KV heads are
    # not here: fewer of them than ranks are replicated instead (kv_problem).
    return (("attention heads", _get(model, "num_heads")),
            ("intermediate_size", _get(model, "intermediate_size")), ("vocab_size", _get(model, "vocab_size")))


def kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """The KV heads one rank holds: its share, or (fewer KV heads than ranks) the one its query heads
    read, replicated on tp_size / num_kv_heads ranks as vLLM and TensorRT-LLM do."""
    return max(1, num_kv_heads // tp_size)


def kv_heads_of_rank(num_heads: int, num_kv_heads: int, tp_size: int, rank: int) -> tuple[int, int]:
    """(first KV head, how many) rank ``rank`` holds: the ones its query heads
    ``[rank*Hq/tp, (rank+1)*Hq/tp)`` attend with (query head h reads KV head h // (Hq/Hkv)). Under
    replication a rank's query heads all fall in one KV head's group (tp is a multiple of Hkv, so the
    group Hq/Hkv is a multiple of a rank's Hq/tp)."""
    return (rank * (num_heads // tp_size)) // (num_heads // num_kv_heads), kv_heads_per_rank(num_kv_heads, tp_size)


def kv_problem(model: Any, tp_size: int) -> str | None:
    """Why ``tp_size`` ranks cannot each hold whole KV heads (split evenly, or one replicated), or None."""
    n = _get(model, "num_kv_heads")
    if n % tp_size and tp_size % n:
        return (f"{tp_size} neither divides the model's {n} KV heads nor is a multiple of them "
                f"(num_key_value_heads={n}, tp_size={tp_size}): each rank holds its share of them, or one replicated")
    return None


def row_parallel_inputs(model: Any) -> tuple[tuple[str, int], ...]:
    """The input features of the row-parallel linears, which tensor parallelism splits: o's
    (num_heads * head_dim) and down's (intermediate_size)."""
    return (("o (num_heads*head_dim)", _get(model, "num_heads") * _get(model, "head_dim")),
            ("down (intermediate_size)", _get(model, "intermediate_size")))


def scale_group(quant_format: str, group_size: int | None) -> int | None:
    """How many input features one weight scale covers in ``quant_format`` (None: per row or tensor,
    so any column split keeps whole scales; also None for AWQ when the group size is not known)."""
    if quant_format == "nvfp4":
        return NVFP4_BLOCK
    return group_size if quant_format in GROUP_SIZED_FORMATS else None


def group_problem(model: Any, tp_size: int, quant_format: str, group_size: int | None = None) -> str | None:
    """Why the row-parallel split of ``tp_size`` would cut a scale group of ``quant_format`` (each rank
    must get whole groups: its share of in-features a multiple of the group), or None."""
    group = scale_group(quant_format, group_size)
    if group is None or tp_size <= 1:
        return None
    for what, n in row_parallel_inputs(model):
        share = n // tp_size
        if n % tp_size == 0 and share % group:
            named = "block" if quant_format == "nvfp4" else "group_size"
            return (f"{tp_size} gives each rank {share} of the {n} input features of {what}, not a multiple "
                    f"of {quant_format}'s {named} {group}: a rank would hold part of a scale group")
    return None


def allowed_tp_sizes(model: Any, limit: int = MAX_TP_SIZE, quant_format: str = "none",
                     group_size: int | None = None) -> list[int]:
    """Every tp_size up to ``limit`` that gives each rank whole heads, equal slices and whole scale groups."""
    return [t for t in range(1, limit + 1) if tp_problem(model, t) is None
            and group_problem(model, t, quant_format, group_size) is None]


def tp_problem(model: Any, tp_size: int) -> str | None:
    """Why ``model`` cannot be split ``tp_size`` ways (the first dimension it does not divide), or None."""
    for what, n in _dims(model):
        if n % tp_size:
            return f"{tp_size} does not divide the model's {n} {what}"
    return kv_problem(model, tp_size)


def check_tp(model: Any, quant_format: str, tp_size: int, group_size: int | None = None) -> None:
    """Refuse a split that would not give every rank whole heads, equal slices, a known format and whole
    scale groups. ``group_size``: the AWQ formats' (None: ``tp_shard`` checks it from the scales' shapes)."""
    if tp_size < 1:
        raise ShardError(f"tp_size: {tp_size}; must be a positive integer")
    if quant_format not in SHARDABLE_FORMATS:
        raise ShardError(f"quantization.format {quant_format!r} cannot be sharded for tp_size={tp_size}; "
                         f"allowed: {', '.join(SHARDABLE_FORMATS)}")
    problem = tp_problem(model, tp_size) or group_problem(model, tp_size, quant_format, group_size)
    if problem:
        allowed = allowed_tp_sizes(model, quant_format=quant_format, group_size=group_size)
        raise ShardError(f"tp_size={problem}; allowed: {' | '.join(map(str, allowed))}")
