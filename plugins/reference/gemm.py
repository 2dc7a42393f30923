"""Reference: linear layers on the quantized weight layouts of docs/contracts.md section 3.

y = x @ W^T with W dequantized in fp32.
"""
from __future__ import annotations

import torch

from .kv_cache import quantize_fp8

# The dequantizers are quant/formats.py's (the single definition of the weight layouts that
# compile and runtime share): the GEMM kernels are tested against them.
from quant.formats import dequantize_int4, dequantize_nvfp4  # noqa: E402


def dequant_nvfp4(weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor) -> torch.Tensor:
    """weight uint8 [N, K/2] (e2m1), weight_scale float8_e4m3fn [N, K/16], weight_scale_2 fp32 [] -> fp32 [N, K]."""
    return dequantize_nvfp4(weight, weight_scale, weight_scale_2)


def dequant_int4_awq(weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """weight uint8 [N, K/2] (value = nibble - 8), weight_scale [N, K/group] -> fp32 [N, K]."""
    return dequantize_int4(weight, weight_scale)


def nvfp4_linear_ref(x, weight, weight_scale, weight_scale_2):
    """W4A16 NVFP4: x [M, K] 16-bit -> [M, N] in x.dtype (activations are not quantized)."""
    return (x.float() @ dequant_nvfp4(weight, weight_scale, weight_scale_2).t()).to(x.dtype)


def int4_awq_linear_ref(x, weight, weight_scale, pre_quant_scale=None):
    """W4A16 INT4-AWQ: x [M, K] -> [M, N] in x.dtype; pre_quant_scale [K] multiplies x first."""
    xf = x.float() if pre_quant_scale is None else x.float() * pre_quant_scale.float()
    return (xf @ dequant_int4_awq(weight, weight_scale).t()).to(x.dtype)


def fp8_linear_ref(x, weight, weight_scale, input_scale):
    """FP8 W8A8: x [M, K] quantized to fp8 with the static input_scale, weight float8_e4m3fn [N, K],
    weight_scale fp32 [N] (per output row) -> [M, N] in x.dtype."""
    xq = quantize_fp8(x, input_scale).float() * input_scale.float()
    w = weight.float() * weight_scale.float()[:, None]
    return (xq @ w.t()).to(x.dtype)


def fp8_gemm_codes_ref(xq, weight, weight_scale, input_scale, out_dtype, **_):
    """FP8 W8A8 on activations already quantized: xq [M, K] e4m3 codes (float8_e4m3fn, or a float dtype
    holding e4m3 values), weight [N, K] likewise, weight_scale fp32 [N] (or one value), input_scale fp32 []
    -> [M, N] in out_dtype, computed in fp32 (every product of two e4m3 values is exact there)."""
    ws = weight_scale.float().reshape(-1)
    y = (xq.float() @ weight.float().t()) * (input_scale.float().reshape(()) * ws)
    return y.to(out_dtype)
