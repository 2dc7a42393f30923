"""Reference: RMSNorm with an optional fused residual add (Llama's pre-norm)."""
from __future__ import annotations

import torch


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None):
    """x: [T, H]; weight: [H]; residual: optional [T, H].

    Without residual -> normalized [T, H] in x.dtype. With residual -> (normalized(x + residual),
    x + residual), the sum being the next layer's residual stream (kept in x.dtype, as HF does).
    """
    if residual is not None:
        x = (x.float() + residual.float()).to(x.dtype)
    h = x.float()
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    # cast back before the weight multiply, as HF Llama does, so bf16 results match it bit for bit
    y = (weight.float() * y.to(x.dtype).float()).to(x.dtype)
    return y if residual is None else (y, x)
