"""References of the CPU kernels (plugins/cpu/kernels.c): the PyTorch ops each one replaces, whose
bits it must give (float32 in, float32 out)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .kv_cache import quantize_fp8


def fake_quant_fp8_ref(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """x / scale to fp8 e4m3 (saturated) and back, times scale: what an fp8 GEMM or fp8 KV cache sees."""
    return quantize_fp8(x, scale).float() * scale


def mul_fake_quant_fp8_ref(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """fake_quant_fp8(a * b): SwiGLU's product (a = silu(gate), b = up) as the fp8 down GEMM sees it."""
    return fake_quant_fp8_ref(a * b, scale)


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] (rotate-half layout), cos/sin broadcastable to it -> x * cos + rotate_half(x) * sin."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def add_rms_norm_ref(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                     scale: torch.Tensor | float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, y): the residual add (h = x + delta; x when delta is None), RMSNorm of h (PyTorch's one
    float32 op: backend/model/layers.rms_norm), fake-quantized for an fp8 GEMM when a scale is given."""
    h = x if delta is None else x + delta
    y = F.rms_norm(h, (h.shape[-1],), weight, eps)
    return h, (y if scale is None else fake_quant_fp8_ref(y, scale))
