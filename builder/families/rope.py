"""config.json's rope fields -> ``Rope``: transformers 5's ``rope_parameters`` and the older ``rope_theta`` +
``rope_scaling`` (+ Phi-3's top-level ``original_max_position_embeddings`` and ``partial_rotary_factor``),
resolved the way transformers resolves them, so the spec is complete without the config beside it."""
from __future__ import annotations

from typing import Any

from backend.arch_spec import ROPE_PARAMETERS, ArchSpecError, Rope
from builder.families.base import HfConfig

# the config fields these readers consume (each family adds them to its own)
ROPE_FIELDS = frozenset({"rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor"})
# transformers' names of rope types -> the spec's ("su" is Phi-3's first name for LongRoPE)
HF_ROPE_TYPES = {**{t: t for t in ROPE_PARAMETERS}, "su": "longrope"}
_PARAMS = {"factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor", "attention_factor",
           "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate", "short_factor", "long_factor",
           "partial_rotary_factor"}
_SCALED = ("llama3", "yarn", "longrope")   # transformers fills original_max_position_embeddings for these


def object_field(cfg: HfConfig, field: str) -> dict:
    value = cfg.data.get(field)
    if value is not None and not isinstance(value, dict):
        raise cfg.refuse(field, f"{value!r:.60} is not an object", "an object of rope parameters, or null")
    return dict(value or {})


def flat_rope_parameters(cfg: HfConfig, default_theta: float = 10000.0) -> tuple[str, dict]:
    """The one rope dict of a family whose layers share a rope, and the field to name in errors."""
    params, scaling = object_field(cfg, "rope_parameters"), object_field(cfg, "rope_scaling")
    where = "rope_scaling" if scaling else "rope_parameters"
    merged = {**params, **scaling}
    # the top-level value wins, as in builder/model_spec.py's rope_theta
    theta = cfg.data.get("rope_theta")
    merged["rope_theta"] = theta if theta is not None else merged.get("rope_theta", default_theta)
    if cfg.data.get("partial_rotary_factor") is not None:
        merged["partial_rotary_factor"] = cfg.data["partial_rotary_factor"]
    return where, merged


def to_rope(cfg: HfConfig, raw: dict, where: str) -> Rope:
    """One HF rope dict -> Rope; a key, type or value the spec cannot hold is refused naming ``where.key``."""
    names = {raw.get(k) for k in ("rope_type", "type") if raw.get(k) is not None}
    if len(names) > 1:
        raise cfg.refuse(f"{where}.rope_type", f"{sorted(names)} (rope_type and type disagree)", "one rope type")
    hf_type = names.pop() if names else "default"
    if hf_type not in HF_ROPE_TYPES:
        raise cfg.refuse(f"{where}.rope_type", f"{hf_type!r} is not supported", " | ".join(HF_ROPE_TYPES))
    kind = HF_ROPE_TYPES[hf_type]
    kw: dict[str, Any] = {"type": kind}
    for key, value in raw.items():
        if key in ("rope_type", "type") or value is None:
            continue
        if key == "rope_theta":
            kw["theta"] = value
        elif key in _PARAMS:
            kw[key] = tuple(value) if isinstance(value, list) else value
        else:
            raise cfg.refuse(f"{where}.{key}", f"{value!r:.60} is not a rope parameter Kiln reads",
                             ", ".join(["rope_type", "rope_theta", *sorted(_PARAMS)]))
    max_pos = cfg.data.get("max_position_embeddings")
    if kind == "dynamic":   # transformers scales from max_position_embeddings, whatever the dict says
        given = kw.get("original_max_position_embeddings")
        if given is not None and given != max_pos:
            raise cfg.refuse(f"{where}.original_max_position_embeddings", f"{given} differs from "
                             f"max_position_embeddings {max_pos}, which a dynamic rope scales from",
                             f"{max_pos} or leave it out")
        kw["original_max_position_embeddings"] = max_pos
    elif kind in _SCALED:
        top = cfg.data.get("original_max_position_embeddings")   # Phi-3 keeps it here; transformers prefers it
        kw["original_max_position_embeddings"] = top if top is not None else \
            kw.get("original_max_position_embeddings", max_pos)
        if kind != "llama3" and kw.get("factor") is None and max_pos and kw["original_max_position_embeddings"]:
            kw["factor"] = max_pos / kw["original_max_position_embeddings"]
    try:
        rope = Rope(**kw)
    except ArchSpecError as exc:
        key = {"theta": "rope_theta", "type": "rope_type"}.get(exc.path, exc.path)
        raise cfg.refuse(f"{where}.{key}", exc.problem, exc.allowed or "see the rope type's parameters") from None
    _check_dims(cfg, rope, where)
    return rope


def shared_rope(cfg: HfConfig, default_theta: float = 10000.0) -> Rope:
    where, raw = flat_rope_parameters(cfg, default_theta)
    return to_rope(cfg, raw, where)


def _check_dims(cfg: HfConfig, rope: Rope, where: str) -> None:
    """LongRoPE gives one factor per rotary frequency: a wrong count would broadcast or crash later."""
    if rope.short_factor is None:
        return
    heads, hidden = cfg.data.get("num_attention_heads"), cfg.data.get("hidden_size")
    head_dim = cfg.data.get("head_dim") or (hidden // heads if heads and hidden else None)
    if head_dim:
        pairs = rope.rotary_dim(head_dim) // 2
        for name in ("short_factor", "long_factor"):
            n = len(getattr(rope, name))
            if n != pairs:
                raise cfg.refuse(f"{where}.{name}", f"{n} values for {pairs} rotary frequencies",
                                 f"{pairs} values (head_dim {head_dim} x partial_rotary_factor / 2)")
