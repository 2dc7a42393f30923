"""Every quantization format the builder can export runs through the runtime's linear registry."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from backend.ops.linear import LINEAR_FORMATS, LinearFormatError, make_linear
from quant import formats

OUT, IN = 48, 128


def _tensors(fmt: str, w: torch.Tensor, x: torch.Tensor) -> dict[str, torch.Tensor]:
    t = dict(formats.get_format(fmt).quantize(w) if fmt not in ("int4_awq", "w4a8_awq")
             else formats.quantize_int4(w, 32))
    amax = x.abs().max()
    if fmt in ("fp8", "w4a8_awq"):
        t["input_scale"] = (amax / 448.0).float()
    if fmt == "int8_sq":
        t["input_scale"] = (amax / 127.0).float()
    if fmt == "nvfp4":
        t["input_scale"] = (amax / (6.0 * 448.0)).float()
    return t


def test_registry_covers_every_runtime_format():
    assert set(LINEAR_FORMATS) == set(formats.FORMATS)


@pytest.mark.parametrize("fmt", sorted(formats.FORMATS))
def test_linear_matches_dequantized_reference(fmt):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(OUT, IN, generator=g) * 0.05
    x = torch.randn(5, IN, generator=g)
    t = _tensors(fmt, w, x)
    lin = make_linear(fmt, t, torch.float32, "cpu", where="layers.0.qkv")
    y = lin(x)
    assert y.shape == (5, OUT)
    dense = formats.get_format(fmt).dequantize({k: v for k, v in t.items()}, torch.float32)
    # Exactly the reference: dequantized weight, activations quantized the way the format does it.
    act = formats.get_format(fmt).activation
    xq = x
    if act == "fp8":
        xq = ((x / t["input_scale"]).clamp(-448, 448).to(torch.float8_e4m3fn).float() * t["input_scale"])
    elif act == "int8":
        xq = (x / t["input_scale"]).round().clamp(-128, 127) * t["input_scale"]
    elif act == "nvfp4":
        xq = formats.fake_quantize_nvfp4_activation(x, t["input_scale"])
    torch.testing.assert_close(y, F.linear(xq, dense), atol=1e-4, rtol=1e-4)
    # ... and close to the unquantized layer (the format is not garbage).
    rel = (y - F.linear(x, w)).norm() / F.linear(x, w).norm()
    assert rel < {"none": 1e-6, "fp8": 0.08, "int8_sq": 0.05}.get(fmt, 0.3), rel


def test_missing_tensor_is_a_clear_error():
    w = torch.randn(OUT, IN)
    t = formats.quantize_fp8_per_row(w)  # no input_scale
    with pytest.raises(LinearFormatError, match=r"layers\.3\.o.*fp8.*input_scale"):
        make_linear("fp8", t, torch.float32, "cpu", where="layers.3.o")
    with pytest.raises(LinearFormatError, match="quantization.format: 'fp6'"):
        make_linear("fp6", {"weight": w}, torch.float32, "cpu")


def test_excluded_module_stored_dense_in_a_quantized_bundle():
    w = torch.randn(OUT, IN)
    lin = make_linear("fp8", {"weight": w}, torch.float32, "cpu")
    assert lin.format == "none" and torch.equal(lin.weight, w)
