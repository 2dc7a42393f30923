"""The decoder layer as the architecture spec describes it, on plain ops (the torch attention path).

``backend/model/llama.py`` runs the Llama layer (x * w norms before attention and MLP, SiLU) with the CPU
kernels that make it fast; a spec asking for more (``(1 + w)`` norms, a norm after each block too, GELU-tanh,
per-layer windows and ropes, a query scalar, scaled embeddings: Gemma 3) runs this layer instead. What the
spec asks is read into a ``LayerPlan`` once at load; the layer code then asks the plan, never the family.

Numbers follow transformers' reference classes: a ``(1 + w)`` norm computes ``x * rsqrt(mean(x^2) + eps)``
and its product with ``1 + w`` in fp32 and casts once (Gemma3RMSNorm); the per-head q/k norm is the same
norm over head_dim; the embedding scale is sqrt(hidden) rounded to the model's dtype before the product
(Gemma3TextScaledWordEmbedding).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from backend.arch_spec import ArchSpec
from backend.model import decoder_parts
from backend.model.decoder_parts import rope_of
from backend.model.layers import RotaryEmbedding, apply_rope, rms_norm

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


@dataclass(frozen=True)
class LayerPlan:
    """What every layer computes, read from the spec once. ``windows[i]``: layer i's sliding window
    (None: full attention); ``rope_of[i]``: the key of its rope table in ``ropes``."""
    one_plus: bool                      # norms compute x * (1 + w)
    post_norms: bool                    # a norm after attention and after the MLP too (four a layer)
    activation: str
    embedding_scale: float | None       # sqrt(hidden), or None
    scale: float                        # attention's score scale
    windows: tuple[int | None, ...]
    rope_of: tuple[str, ...]

    @property
    def plain(self) -> bool:
        """The Llama layer (llama.py's fast path) computes this plan, windows aside."""
        return not (self.one_plus or self.post_norms or self.embedding_scale) and self.activation == "silu"


def plan_of(spec: ArchSpec | None, config) -> LayerPlan:
    """The plan of a bundle's spec; a bundle from before the spec is the Llama layer, with
    ``model.sliding_window`` (Mistral) on every layer."""
    n = config.num_layers
    if spec is None:
        return LayerPlan(False, False, "silu", None, config.head_dim ** -0.5, (config.sliding_window,) * n,
                         ("full",) * n)
    if spec.num_layers != n:
        raise ValueError(f"engine.json: model.arch.layer_types: {spec.num_layers} entries for "
                         f"{n} layers; rebuild the bundle")
    return LayerPlan(
        one_plus=spec.norm == "rms_one_plus", post_norms=spec.norm_placement == "pre_post",
        activation=spec.activation,
        embedding_scale=math.sqrt(config.hidden_size) if spec.embedding_scale == "sqrt_hidden" else None,
        scale=spec.query_scale(config.head_dim), windows=tuple(spec.layer(i).window for i in range(n)),
        rope_of=spec.layer_types)


def rope_tables(spec: ArchSpec | None, config, device) -> dict[str, RotaryEmbedding]:
    """One ``RotaryEmbedding`` per attention kind of the spec (Gemma 3: sliding 10k, full 1M)."""
    if spec is None:
        return {"full": RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta,
                                        config.rope_scaling, device)}
    return {a.kind: RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                    *rope_of(a.rope, f"model.arch.attention.{a.kind}.rope"), device)
            for a in spec.attention}


def one_plus_weight(w: torch.Tensor) -> torch.Tensor:
    """A ``(1 + w)`` norm's multiplier, kept in fp32 as transformers computes it."""
    return 1.0 + w.float()


def norm(x: torch.Tensor, weight: torch.Tensor, eps: float, one_plus: bool) -> torch.Tensor:
    """RMSNorm over the last dim. ``one_plus``: ``weight`` is ``one_plus_weight``'s fp32 multiplier and
    the product is taken in fp32, cast once; else the Llama norm (``layers.rms_norm``)."""
    if not one_plus:
        return rms_norm(x, weight, eps)
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight).to(x.dtype)


def qk_norm(qk: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, num_heads: int, eps: float,
            one_plus: bool) -> torch.Tensor:
    """The per-head norm of ``qk [T, Hq + Hkv, D]`` (queries first) in the spec's norm kind."""
    if not one_plus:
        return decoder_parts.qk_norm(qk, q_weight, k_weight, num_heads, eps)
    return torch.cat([norm(qk[:, :num_heads], q_weight, eps, True), norm(qk[:, num_heads:], k_weight, eps, True)],
                     dim=1)


def spec_layer(c, plan: LayerPlan, layer, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention,
               kv_cache: tuple[torch.Tensor, torch.Tensor], meta, window: int | None,
               row_linear: Callable, apply: Callable) -> torch.Tensor:
    """One layer as ``plan`` says: ``hidden [T, H]`` -> ``[T, H]``; writes the step's keys and values into
    ``kv_cache``. ``layer`` is llama.py's DecoderLayer (``pre_ff_norm``/``post_ff_norm`` set when the plan
    has post norms; with ``one_plus`` every norm weight is already ``one_plus_weight``'s)."""
    t, eps, op = hidden.shape[0], c.rms_norm_eps, plan.one_plus
    qkv = apply(layer.qkv, norm(hidden, layer.input_norm, eps, op))
    qk = qkv[:, :c.q_size + c.kv_size].view(t, c.num_heads + c.num_kv_heads, c.head_dim)
    if layer.q_norm is not None:
        qk = qk_norm(qk, layer.q_norm, layer.k_norm, c.num_heads, eps, op)
    qk = apply_rope(qk, cos, sin)
    q, k = qk[:, :c.num_heads], qk[:, c.num_heads:]
    v = qkv[:, c.q_size + c.kv_size:].view(t, c.num_kv_heads, c.head_dim)
    k_cache, v_cache = kv_cache
    attention.write_kv(k, v, k_cache, v_cache, meta.slot_mapping, layer.k_scale, layer.v_scale)
    extra = {"window": window} if window is not None else {}
    attn = attention.forward(q, k_cache, v_cache, meta, plan.scale, layer.k_scale, layer.v_scale, **extra)
    out = row_linear(layer.o, attn.reshape(t, c.q_size))
    if plan.post_norms:
        # pre_post: post_attn_norm normalizes the attention output; pre_ff_norm feeds the MLP
        hidden = hidden + norm(out, layer.post_attn_norm, eps, op)
        x = norm(hidden, layer.pre_ff_norm, eps, op)
    else:
        hidden = hidden + out
        x = norm(hidden, layer.post_attn_norm, eps, op)
    if layer.moe is not None:   # an expert layer (backend/model/moe.py: SiLU experts, as the spec's check says)
        out = layer.moe(x)
    else:
        gate, up = apply(layer.gate_up, x).chunk(2, dim=-1)
        out = row_linear(layer.down, ACTIVATIONS[plan.activation](gate) * up)
    return hidden + (norm(out, layer.post_ff_norm, eps, op) if plan.post_norms else out)
