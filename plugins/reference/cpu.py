"""References of the CPU kernels (plugins/cpu/kernels.c): the PyTorch ops each one replaces, whose
bits it must give (float32 in, float32 out)."""
from __future__ import annotations

import torch

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
