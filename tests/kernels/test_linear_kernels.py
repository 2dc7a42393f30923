"""The runtime's 4-bit linears with packed weights and the registry's Triton GEMM (the GPU path)
equal the same linears dequantized at load (the CPU path) — interpreter on CPU, real kernels on a GPU."""
from __future__ import annotations

import pytest
import torch

from backend.ops.linear import make_linear
from quant import formats
from tests.kernels.kernel_utils import assert_close

OUT, IN = 96, 128


def _tensors(fmt: str, w: torch.Tensor, x: torch.Tensor, smooth: bool) -> dict[str, torch.Tensor]:
    t = dict(formats.quantize_int4(w, 32) if fmt != "nvfp4" else formats.get_format(fmt).quantize(w))
    if fmt == "w4a8_awq":
        t["input_scale"] = (x.abs().max() / 448.0).float()
    if smooth and fmt != "nvfp4":
        t["pre_quant_scale"] = torch.rand(IN) + 0.5
    return t


# NVFP4 has no AWQ smoothing scale; the int4 formats run with and without one.
CASES = [("nvfp4", False), ("int4_awq", False), ("int4_awq", True), ("w4a8_awq", False), ("w4a8_awq", True)]


@pytest.mark.parametrize("fmt,smooth", CASES)
@pytest.mark.parametrize("m", [1, 7, 33])
def test_packed_kernel_linear_equals_dequantized(device, fresh_seed, fmt, m, smooth):
    w = torch.randn(OUT, IN) * 0.05
    x = torch.randn(m, IN)
    t = _tensors(fmt, w, x, smooth)
    t["bias"] = torch.randn(OUT) * 0.1
    packed = make_linear(fmt, {k: v.to(device) for k, v in t.items()}, torch.float32, device, kernels=True)
    plain = make_linear(fmt, t, torch.float32, "cpu", kernels=False)
    assert packed.weight.dtype == torch.uint8, "the kernel path must keep the packed 4-bit weight"
    assert packed.out_features == OUT
    y = packed(x.to(device))
    assert_close(y, plain(x), torch.float32, f"{fmt} m={m} smooth={smooth}", fresh_seed)


def test_kernels_default_only_on_gpu():
    w = torch.randn(OUT, IN) * 0.05
    lin = make_linear("int4_awq", dict(formats.quantize_int4(w, 32)), torch.float32, "cpu")
    assert not lin.kernels and lin.weight.dtype == torch.float32
