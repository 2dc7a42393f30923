"""Stateless building blocks of Llama-family decoders: RMSNorm, rotary embeddings, SwiGLU.

Numerics follow Hugging Face transformers' Llama so a bf16/fp32 bundle reproduces its outputs:
RMSNorm in fp32 then cast back before the weight multiply, RoPE tables computed in fp32.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

from plugins import registry

# The CPU kernels these layers call where they apply (float32 on CPU): rows of the kernel table.
_cpu_add_rms_norm = registry.load("add_rms_norm", "cpu")
_cpu_rope = registry.load("rope_tables", "cpu")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x [..., H]`` -> normalized ``[..., H]`` in ``x``'s dtype."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32 and x.device.type == "cpu":
        done = _cpu_add_rms_norm(x, None, weight, eps) if x.dim() == 2 else None
        if done is not None:     # the CPU kernel: one call for the ~9 ops of the one below, the same bits
            return done[1]
        # PyTorch's one op gives these bits in float32 on CPU (checked at every size from 64 to 5120,
        # 1-33 rows: tests/runtime/test_layers_cpu.py) where the lines below are seven
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``[T, 2I]`` (gate | up) -> ``silu(gate) * up`` ``[T, I]``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# ---- rotary embeddings: one function per rope_scaling type ------------------------------------

def _default_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def _linear_inv_freq(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    return _default_inv_freq(head_dim, theta, None) / float(scaling["factor"])


def _llama3_inv_freq(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """Llama 3.1: long wavelengths are divided by ``factor``, short ones kept, a smooth ramp between."""
    inv_freq = _default_inv_freq(head_dim, theta, None)
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_ctx = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _dynamic_inv_freq(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """Dynamic NTK: the base grows with the sequence beyond ``original_max_position_embeddings`` (transformers
    scales from max_position_embeddings and recomputes while generating past it). Within that length, which is
    where a bundle runs, it is the default rope; the formula is evaluated there."""
    factor, old_ctx = float(scaling["factor"]), float(scaling["original_max_position_embeddings"])
    seq_len = old_ctx
    base = theta * ((factor * seq_len / old_ctx) - (factor - 1)) ** (head_dim / (head_dim - 2))
    return _default_inv_freq(head_dim, base, None)


def _yarn_inv_freq(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """YaRN: interpolated (divided by ``factor``) below the correction range's low dims, extrapolated above
    its high dims, a linear ramp between; cos/sin also scale (``rope_attention_factor``)."""
    factor, old_ctx = float(scaling["factor"]), float(scaling["original_max_position_embeddings"])
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001        # a zero-width ramp would divide by zero
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolated = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolated) + (1.0 / pos_freqs) * extrapolated


def _longrope_inv_freq(head_dim: int, theta: float, scaling: dict, long: bool = False) -> torch.Tensor:
    """LongRoPE (Phi-3): each frequency divided by its own factor, ``short_factor`` within the pretraining
    length (``original_max_position_embeddings``), ``long_factor`` beyond it."""
    ext = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
    return 1.0 / (ext * theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


ROPE_TYPES: dict[str, Callable[[int, float, dict | None], torch.Tensor]] = {
    "default": _default_inv_freq,
    "linear": _linear_inv_freq,
    "dynamic": _dynamic_inv_freq,
    "llama3": _llama3_inv_freq,
    "yarn": _yarn_inv_freq,
    "longrope": _longrope_inv_freq,
}


def rope_attention_factor(scaling: dict | None) -> float:
    """What cos and sin are multiplied by: YaRN's mscale and LongRoPE's length factor, else 1."""
    kind = rope_type(scaling)
    if kind not in ("yarn", "longrope"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    if kind == "longrope":
        old_ctx = float(scaling["original_max_position_embeddings"])
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_ctx))

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    return float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)


def rope_type(scaling: dict | None) -> str:
    if not scaling:
        return "default"
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ValueError(f"engine.json: model.rope_scaling.rope_type: {kind!r} is not supported; "
                         f"allowed: {', '.join(ROPE_TYPES)}")
    return kind


class RotaryEmbedding:
    """Precomputed ``cos``/``sin`` tables ``[max_pos, head_dim]`` (fp32), indexed by token position."""

    def __init__(self, head_dim: int, max_pos: int, theta: float, scaling: dict | None,
                 device: torch.device | str = "cpu") -> None:
        kind = rope_type(scaling)
        inv_freq = ROPE_TYPES[kind](head_dim, theta, scaling)
        pos = torch.arange(max_pos, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)
        if kind == "longrope":
            # positions past the pretraining length rotate with the long factors. transformers instead
            # re-rotates every position with them once a sequence passes that length, which a KV cache of
            # keys rotated earlier cannot do: the two agree on sequences within it.
            old_ctx = int(scaling["original_max_position_embeddings"])
            long = torch.outer(pos[old_ctx:], _longrope_inv_freq(head_dim, theta, scaling, long=True))
            freqs = torch.cat([freqs[:old_ctx], long])
        emb = torch.cat([freqs, freqs], dim=-1)
        scale = rope_attention_factor(scaling)
        self.cos = (emb.cos() * scale).to(device)
        self.sin = (emb.sin() * scale).to(device)
        self.max_pos = max_pos

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token ``cos, sin [T, 1, D]`` in ``dtype`` (computed once per step, shared by layers)."""
        return (self.cos.index_select(0, positions).to(dtype).unsqueeze(1),
                self.sin.index_select(0, positions).to(dtype).unsqueeze(1))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, H, D]`` by the per-token angles (``rotate_half`` convention of HF Llama): float32
    on CPU in one call of the CPU kernel (plugins/cpu, the same bits as the six ops below)."""
    y = _cpu_rope(x, cos, sin)
    if y is not None:
        return y
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
