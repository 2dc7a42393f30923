"""backend/ops/fp8.py: the CPU table lookup must give PyTorch's fp8 conversion bits exactly (both
paths are run on every input: the table, forced with TABLE_MIN 0, and the size-chosen one)."""
from __future__ import annotations

import pytest
import torch

from backend.ops import fp8


@pytest.fixture(params=["table", "by size"])
def table_min(request, monkeypatch):
    if request.param == "table":
        monkeypatch.setattr(fp8, "TABLE_MIN", 0)
    return fp8.TABLE_MIN


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fake_quant_equals_the_conversion_round_trip(dtype, table_min):
    """Activations quantized with a static scale, past the range included (saturated, not NaN),
    then dequantized: the same bits as x / s -> e4m3 -> float32 -> x s -> dtype."""
    torch.manual_seed(0)
    scale = torch.tensor(0.0173)
    x = torch.cat([torch.randn(37, 96) * 3, torch.tensor([[1e4, -1e4, 0.0, -0.0] * 24]),
                   torch.randn(2, 96) * 1e-4]).to(dtype)   # normal, saturating, zero, subnormal codes
    want = ((x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale).to(dtype)
    got = fp8.fake_quant(x, scale)
    assert got.dtype == dtype and got.shape == x.shape
    assert torch.equal(got, want)
    assert bool(got.isfinite().all()) and float(got.abs().max()) == float((448 * scale).to(dtype))


def test_dequantize_every_code_in_any_shape(table_min):
    codes = torch.arange(256, dtype=torch.uint8).view(fp8.FP8).view(4, 8, 8)
    scale = torch.tensor(3.5)
    got = fp8.dequantize(codes, scale, torch.float32)
    want = codes.float() * scale
    assert got.shape == codes.shape
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
