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


ROPE_TYPES: dict[str, Callable[[int, float, dict | None], torch.Tensor]] = {
    "default": _default_inv_freq,
    "linear": _linear_inv_freq,
    "llama3": _llama3_inv_freq,
}


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
        inv_freq = ROPE_TYPES[rope_type(scaling)](head_dim, theta, scaling)
        pos = torch.arange(max_pos, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = emb.cos().to(device)
        self.sin = emb.sin().to(device)
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
