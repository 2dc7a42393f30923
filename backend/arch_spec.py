"""The architecture spec: how a decoder family computes a layer, beside its shapes.

``engine.json``'s model section holds it as ``arch`` (``ArchSpec.to_dict``); the builder derives it once
from the checkpoint's config.json (``builder/families/``) and the runtime, quantizer, tensor-parallel
rules, draft and exports read this object instead of asking which family a bundle is. Shapes (hidden
size, heads, head dim) stay in the model section's own keys: the spec says what to compute, not how big.

Frozen and checked at construction; every bad value raises ``ArchSpecError`` with one line naming the
field and the allowed values. Standard library only: it is part of the bundle contract and is read
inside Triton's Python backend.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

# x * w (Llama) or x * (1 + w) (Gemma: the checkpoint stores w - 1, zero-initialised)
NORM_KINDS = ("rms", "rms_one_plus")
# pre: a norm before attention and one before the MLP; pre_post: also one after each (Gemma 3, four a layer)
NORM_PLACEMENTS = ("pre", "pre_post")
ACTIVATIONS = ("silu", "gelu_tanh")
MLP_KINDS = ("gated",)                  # down(act(gate(x)) * up(x))
TENSOR_LAYOUTS = ("separate", "fused")  # how q/k/v (or gate/up) are stored in the checkpoint
EMBEDDING_SCALES = ("none", "sqrt_hidden")
ATTENTION_KINDS = ("full", "sliding")

# rope type -> (parameters it needs, parameters it may have); theta and partial_rotary_factor always apply
ROPE_PARAMETERS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "default": ((), ()),
    "linear": (("factor",), ()),
    "dynamic": (("factor", "original_max_position_embeddings"), ()),
    "llama3": (("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"), ()),
    "yarn": (("factor", "original_max_position_embeddings"),
             ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate")),
    "longrope": (("factor", "short_factor", "long_factor", "original_max_position_embeddings"),
                 ("attention_factor",)),
}


_ROPE_ALWAYS = ("type", "theta", "partial_rotary_factor")


class ArchSpecError(ValueError):
    """One field of the spec is wrong: ``path`` names it (``arch.attention.sliding.rope.factor``)."""

    def __init__(self, path: str, problem: str, allowed: str | None = None) -> None:
        self.path, self.problem, self.allowed = path, problem, allowed
        super().__init__(f"{path}: {problem}" + (f"; allowed: {allowed}" if allowed else ""))

    def under(self, prefix: str) -> "ArchSpecError":
        return ArchSpecError(f"{prefix}.{self.path}" if self.path else prefix, self.problem, self.allowed)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _one_of(path: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ArchSpecError(path, f"{_show(value)} is not supported", " | ".join(allowed))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _positive(path: str, value: Any, kind: type = float) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) if kind is int else _is_number(value)
    if not ok or value <= 0:
        what = "integer" if kind is int else "number"
        raise ArchSpecError(path, f"{_show(value)} is not a positive {what}", f"a positive {what}")


def _flag(path: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ArchSpecError(path, f"{_show(value)} is not a boolean", "true | false")


@dataclass(frozen=True)
class Rope:
    """Rotary embedding of one attention kind. ``None`` fields are not used by ``type``
    (ROPE_PARAMETERS says which are); ``attention_factor`` None: the variant's own formula."""
    type: str = "default"
    theta: float = 10000.0
    partial_rotary_factor: float = 1.0          # share of head_dim that rotates (Phi-4-mini: 0.75)
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None        # llama3
    high_freq_factor: float | None = None       # llama3
    attention_factor: float | None = None       # yarn, longrope: scale of cos/sin (yarn's mscale)
    beta_fast: float | None = None              # yarn
    beta_slow: float | None = None              # yarn
    mscale: float | None = None                 # yarn (DeepSeek)
    mscale_all_dim: float | None = None         # yarn (DeepSeek)
    truncate: bool | None = None                # yarn: round the correction range to whole dims
    short_factor: tuple[float, ...] | None = None   # longrope: per rotary dim pair, within the original length
    long_factor: tuple[float, ...] | None = None    # longrope: per rotary dim pair, beyond it

    def __post_init__(self) -> None:
        _one_of("type", self.type, tuple(ROPE_PARAMETERS))
        _positive("theta", self.theta)
        prf = self.partial_rotary_factor
        if not _is_number(prf) or not 0 < prf <= 1:
            raise ArchSpecError("partial_rotary_factor", _show(prf), "a number in (0, 1]")
        needed, optional = ROPE_PARAMETERS[self.type]
        for name in needed:
            if getattr(self, name) is None:
                raise ArchSpecError(name, f"missing; a {self.type} rope needs it",
                                    ", ".join(needed))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None or f.name in _ROPE_ALWAYS:
                continue
            if f.name not in needed + optional:
                raise ArchSpecError(f.name, f"{_show(value)} is not a parameter of a {self.type} rope",
                                    ", ".join(needed + optional) or "none")
            if f.name == "truncate":
                _flag(f.name, value)
            elif f.name in ("short_factor", "long_factor"):
                if not isinstance(value, tuple) or not value or not all(_is_number(x) and x > 0 for x in value):
                    raise ArchSpecError(f.name, _show(value), "a non-empty list of positive numbers")
            else:
                _positive(f.name, value, int if f.name == "original_max_position_embeddings" else float)
        if self.type == "llama3" and self.low_freq_factor >= self.high_freq_factor:
            raise ArchSpecError("low_freq_factor", f"{self.low_freq_factor} is not below high_freq_factor "
                                f"{self.high_freq_factor}", "low_freq_factor < high_freq_factor")
        if self.type == "longrope" and len(self.short_factor) != len(self.long_factor):
            raise ArchSpecError("long_factor", f"{len(self.long_factor)} values but short_factor has "
                                f"{len(self.short_factor)}", "one value per rotary dimension pair in both")

    def rotary_dim(self, head_dim: int) -> int:
        return int(head_dim * self.partial_rotary_factor)

    def to_dict(self) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None:
                out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    @classmethod
    def from_dict(cls, d: Any) -> "Rope":
        d = _object(d, cls)
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})


@dataclass(frozen=True)
class Attention:
    """One attention kind of the layer pattern: full context, or the last ``window`` tokens."""
    kind: str
    rope: Rope = Rope()
    window: int | None = None

    def __post_init__(self) -> None:
        _one_of("kind", self.kind, ATTENTION_KINDS)
        if not isinstance(self.rope, Rope):
            raise ArchSpecError("rope", f"{_show(self.rope)}", "a Rope")
        if self.kind == "sliding":
            _positive("window", self.window, int)
        elif self.window is not None:
            raise ArchSpecError("window", f"{_show(self.window)} on a full attention", "null (no window)")

    def to_dict(self) -> dict[str, Any]:
        return {**({"window": self.window} if self.window is not None else {}), "rope": self.rope.to_dict()}


# the router of an expert layer: softmax over every expert's logit, then the top-k probabilities
# (Mixtral, Qwen3-MoE; ``renormalize``: divided by their sum). Sigmoid scoring with groups (DeepSeek) is not here
ROUTERS = ("softmax_topk",)


@dataclass(frozen=True)
class Experts:
    """The mixture-of-experts MLP of the layers in ``layers`` (the others keep the dense gated MLP): each
    token's ``top_k`` experts of ``num_experts`` chosen by ``router``, each a gated MLP of width
    ``intermediate_size``, their outputs summed weighted by the router's probabilities. A shared expert
    (Qwen2-MoE), a gated MLP of width ``shared_intermediate_size`` that every token runs, adds its output
    to that sum, times ``sigmoid(shared_gate(x))`` (a [1, H] linear) when ``shared_gate``."""
    num_experts: int
    top_k: int
    intermediate_size: int
    layers: tuple[int, ...]
    router: str = "softmax_topk"
    renormalize: bool = False
    shared_intermediate_size: int | None = None     # None: no shared expert
    shared_gate: bool = False

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "intermediate_size"):
            _positive(name, getattr(self, name), int)
        if self.shared_intermediate_size is not None:
            _positive("shared_intermediate_size", self.shared_intermediate_size, int)
        _flag("shared_gate", self.shared_gate)
        if self.shared_gate and self.shared_intermediate_size is None:
            raise ArchSpecError("shared_gate", "true without a shared expert",
                                "false, or a shared_intermediate_size")
        if self.top_k > self.num_experts:
            raise ArchSpecError("top_k", f"{self.top_k} exceeds num_experts {self.num_experts}",
                                f"1..{self.num_experts}")
        _one_of("router", self.router, ROUTERS)
        _flag("renormalize", self.renormalize)
        if not isinstance(self.layers, tuple) or not self.layers or \
                not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in self.layers) or \
                list(self.layers) != sorted(set(self.layers)):
            raise ArchSpecError("layers", _show(self.layers), "a non-empty ascending list of layer indices")

    def to_dict(self) -> dict[str, Any]:
        out = {**dataclasses.asdict(self), "layers": list(self.layers)}
        if self.shared_intermediate_size is None:   # absent, as in bundles built before shared experts
            del out["shared_intermediate_size"], out["shared_gate"]
        return out

    @classmethod
    def from_dict(cls, d: Any) -> "Experts":
        d = dict(_object(d, cls))
        if isinstance(d.get("layers"), list):
            d["layers"] = tuple(d["layers"])
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in d and
                   f.default is dataclasses.MISSING]
        if missing:
            raise ArchSpecError(missing[0], "missing", ", ".join(missing))
        return cls(**d)


_ENUMS = {"norm": NORM_KINDS, "norm_placement": NORM_PLACEMENTS, "activation": ACTIVATIONS, "mlp": MLP_KINDS,
          "gate_up": TENSOR_LAYOUTS, "qkv": TENSOR_LAYOUTS, "embedding_scale": EMBEDDING_SCALES}
_FLAGS = ("qk_norm", "qkv_bias", "o_bias", "mlp_bias", "tie_word_embeddings")


@dataclass(frozen=True)
class ArchSpec:
    """What a decoder layer computes. ``layer_types[i]`` names the ``attention`` entry of layer i."""
    layer_types: tuple[str, ...]
    attention: tuple[Attention, ...] = (Attention("full"),)
    norm: str = "rms"
    norm_placement: str = "pre"
    activation: str = "silu"
    mlp: str = "gated"
    gate_up: str = "separate"
    qkv: str = "separate"
    qk_norm: bool = False                       # a per-head norm (kind ``norm``) on q and k before rope
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    embedding_scale: str = "none"               # sqrt_hidden: embeddings times sqrt(hidden_size)
    query_pre_attn_scalar: float | None = None  # scores scaled by its -1/2 power; None: head_dim's
    experts: Experts | None = None              # mixture-of-experts layers; None: every MLP dense

    def __post_init__(self) -> None:
        for name, allowed in _ENUMS.items():
            _one_of(f"arch.{name}", getattr(self, name), allowed)
        for name in _FLAGS:
            _flag(f"arch.{name}", getattr(self, name))
        if self.query_pre_attn_scalar is not None:
            _positive("arch.query_pre_attn_scalar", self.query_pre_attn_scalar)
        if not isinstance(self.attention, tuple) or not self.attention or \
                not all(isinstance(a, Attention) for a in self.attention):
            raise ArchSpecError("arch.attention", _show(self.attention), "a non-empty tuple of Attention")
        kinds = [a.kind for a in self.attention]
        if len(set(kinds)) != len(kinds):
            raise ArchSpecError("arch.attention", f"kinds {kinds} repeat", "each kind once")
        if not isinstance(self.layer_types, tuple) or not self.layer_types:
            raise ArchSpecError("arch.layer_types", _show(self.layer_types), "a non-empty list, one per layer")
        for i, kind in enumerate(self.layer_types):
            _one_of(f"arch.layer_types[{i}]", kind, tuple(kinds))
        if self.experts is not None:
            if not isinstance(self.experts, Experts):
                raise ArchSpecError("arch.experts", _show(self.experts), "an Experts")
            if self.experts.layers[-1] >= self.num_layers:
                raise ArchSpecError("arch.experts.layers", f"layer {self.experts.layers[-1]} does not exist",
                                    f"0..{self.num_layers - 1}")
        unused = [k for k in kinds if k not in self.layer_types]
        if unused:
            raise ArchSpecError(f"arch.attention.{unused[0]}", "no layer uses it",
                                " | ".join(dict.fromkeys(self.layer_types)))

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    def layer(self, i: int) -> Attention:
        """Layer ``i``'s attention kind, window and rope."""
        return next(a for a in self.attention if a.kind == self.layer_types[i])

    def sparse(self, i: int) -> bool:
        """Layer ``i``'s MLP is the experts' (else the dense gated MLP)."""
        return self.experts is not None and i in self.experts.layers

    def query_scale(self, head_dim: int) -> float:
        return (self.query_pre_attn_scalar or head_dim) ** -0.5

    def to_dict(self) -> dict[str, Any]:
        """JSON for engine.json: fields in declaration order, ``attention`` keyed by kind."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "attention":
                value = {a.kind: a.to_dict() for a in value}
            elif f.name == "layer_types":
                value = list(value)
            elif f.name == "experts":
                if value is None:   # absent, as in bundles built before expert layers existed
                    continue
                value = value.to_dict()
            out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, d: Any) -> "ArchSpec":
        """The spec from ``to_dict``'s JSON; ArchSpecError names the first wrong field under ``arch.``."""
        try:
            d = dict(_object(d, cls))
        except ArchSpecError as exc:
            raise exc.under("arch") from None
        if "layer_types" not in d:
            raise ArchSpecError("arch.layer_types", "missing", "a list, one attention kind per layer")
        attention = d.get("attention", {"full": {}})
        if not isinstance(attention, dict):
            raise ArchSpecError("arch.attention", _show(attention), "an object keyed by " +
                                " | ".join(ATTENTION_KINDS))
        parsed = []
        for kind, body in attention.items():
            where = f"arch.attention.{kind}"
            try:
                body = dict(_object(body, Attention))
                if "kind" in body:
                    raise ArchSpecError("kind", "given inside its entry", "the entry's key names the kind")
            except ArchSpecError as exc:
                raise exc.under(where) from None
            try:
                rope = Rope.from_dict(body.get("rope", {}))
            except ArchSpecError as exc:
                raise exc.under(f"{where}.rope") from None
            try:
                parsed.append(Attention(kind, **{**body, "rope": rope}))
            except ArchSpecError as exc:
                raise exc.under(where) from None
        d["attention"] = tuple(parsed)
        if d.get("experts") is not None:
            try:
                d["experts"] = Experts.from_dict(d["experts"])
            except ArchSpecError as exc:
                raise exc.under("arch.experts") from None
        if isinstance(d["layer_types"], list):
            d["layer_types"] = tuple(d["layer_types"])
        return cls(**d)


def _object(d: Any, cls: type) -> dict:
    """``d`` is an object holding only ``cls``'s fields; errors are relative (the caller prefixes)."""
    allowed = [f.name for f in dataclasses.fields(cls)]
    if not isinstance(d, dict):
        raise ArchSpecError("", f"{_show(d)}", "an object with " + ", ".join(allowed))
    for key in d:
        if key not in allowed:
            raise ArchSpecError(key, "unknown field", ", ".join(allowed))
    return d
