"""backend/model/layers.py on CPU: the float32 RMSNorm takes PyTorch's single op, which must give the
bits of Hugging Face's formula (fp32 mean of squares, rsqrt, then the weight) that it replaces."""
from __future__ import annotations

import pytest
import torch

from backend.model.layers import rms_norm


def _hf_formula(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


@pytest.mark.parametrize("hidden", [64, 576, 960, 2048, 4096, 5120])
@pytest.mark.parametrize("rows", [1, 2, 5, 33])
def test_float32_rms_norm_has_the_formulas_bits(hidden, rows):
    g = torch.Generator().manual_seed(hidden * 100 + rows)
    x = torch.randn(rows, hidden, generator=g) * torch.rand(rows, 1, generator=g) * 10
    weight = torch.randn(hidden, generator=g)
    for eps in (1e-5, 1e-6):
        assert torch.equal(rms_norm(x, weight, eps), _hf_formula(x, weight, eps))


def test_bfloat16_keeps_the_formula():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 576, generator=g).to(torch.bfloat16)
    weight = torch.randn(576, generator=g).to(torch.bfloat16)
    assert torch.equal(rms_norm(x, weight, 1e-5), _hf_formula(x, weight, 1e-5))
