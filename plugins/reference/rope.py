"""Reference: rotary position embedding (rotate-half / NeoX layout, as Llama checkpoints in HF use) and
the inverse frequencies for the rope_scaling variants we support."""
from __future__ import annotations

import math

import torch

ROPE_TYPES = ("default", "linear", "llama3")


def rope_inv_freq(head_dim: int, theta: float, rope_scaling: dict | None = None) -> torch.Tensor:
    """-> [head_dim // 2] fp32 inverse frequencies, with Llama-3 / linear scaling applied."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    kind = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope_scaling.rope_type: {kind!r} is not supported; allowed: {', '.join(ROPE_TYPES)}")
    if kind == "linear":
        inv = inv / float(rope_scaling["factor"])
    elif kind == "llama3":
        factor = float(rope_scaling["factor"])
        low, high = float(rope_scaling["low_freq_factor"]), float(rope_scaling["high_freq_factor"])
        old_ctx = float(rope_scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        # long wavelengths are slowed down by `factor`, short ones kept, the band between blended
        smooth = ((old_ctx / wavelen) - low) / (high - low)
        blended = (1 - smooth) * inv / factor + smooth * inv
        inv = torch.where(wavelen > old_ctx / low, inv / factor,
                          torch.where(wavelen < old_ctx / high, inv, blended))
    return inv.float()


def rope_cos_sin(max_positions: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """-> [max_positions, 2, head_dim // 2] fp32: cos and sin of position * inv_freq."""
    ang = torch.arange(max_positions, dtype=torch.float64)[:, None] * inv_freq.double()[None, :]
    return torch.stack([ang.cos(), ang.sin()], dim=1).float()


def apply_rope_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor):
    """q: [T, Hq, D]; k: [T, Hkv, D]; positions: [T] int64; cos_sin: [max_pos, 2, D/2]
    -> (rotated q, rotated k), same shapes and dtypes (computed in fp32)."""
    cs = cos_sin[positions.long()]
    cos, sin = cs[:, 0][:, None, :], cs[:, 1][:, None, :]

    def rot(x):
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    return rot(q), rot(k)
