"""Adapters giving every linear implementation the registry's one signature:
fn(x [M, K], weight, weight_scale=None, weight_scale_2=None, input_scale=None, pre_quant_scale=None,
aot=None, locks=None) -> [M, N] in x.dtype. Tensor names are the bundle's (docs/contracts.md section 3);
`aot` is the bundle's plugins.launcher.KernelSet (Triton kernels launch its cubins instead of JIT);
`locks` the small-M W4A16 GEMM's split-K counters the linear keeps (None: allocated per call)."""
from __future__ import annotations

import torch

from .gemm_fp8 import fp8_linear
from .gemm_w4a16 import w4a16_linear
from .reference.gemm import fp8_linear_ref, int4_awq_linear_ref, nvfp4_linear_ref
from .reference.kv_cache import quantize_fp8


def dense(x, weight, **_):
    return torch.nn.functional.linear(x, weight.to(x.dtype))


def nvfp4_triton(x, weight, weight_scale, weight_scale_2, input_scale=None, aot=None, locks=None, **_):
    # W4A16: input_scale (for W4A4 activation quantization) is deliberately unused
    return w4a16_linear(x, "nvfp4", weight, weight_scale, weight_scale_2, aot=aot, locks=locks)


def nvfp4_torch(x, weight, weight_scale, weight_scale_2, input_scale=None, **_):
    return nvfp4_linear_ref(x, weight, weight_scale, weight_scale_2)


def int4_awq_triton(x, weight, weight_scale, pre_quant_scale=None, aot=None, locks=None, **_):
    return w4a16_linear(x, "int4_awq", weight, weight_scale, pre_quant_scale=pre_quant_scale, aot=aot, locks=locks)


def int4_awq_torch(x, weight, weight_scale, pre_quant_scale=None, **_):
    return int4_awq_linear_ref(x, weight, weight_scale, pre_quant_scale)


def fp8_triton(x, weight, weight_scale, input_scale, **_):
    return fp8_linear(x, weight, weight_scale, input_scale)


def fp8_torch(x, weight, weight_scale, input_scale, **_):
    return fp8_linear_ref(x, weight, weight_scale, input_scale)


def _fp8_activations(x, input_scale, pre_quant_scale):
    """W4A8: AWQ smoothing first, then the static fp8 activation quantization (ModelOpt's input quantizer
    order), returned dequantized so the 4-bit GEMM sees exactly the values an fp8 GEMM would."""
    if pre_quant_scale is not None:
        x = x * pre_quant_scale.to(x.dtype)
    return (quantize_fp8(x, input_scale).float() * input_scale.float()).to(x.dtype)


def w4a8_awq_triton(x, weight, weight_scale, input_scale, pre_quant_scale=None, aot=None, locks=None, **_):
    return w4a16_linear(_fp8_activations(x, input_scale, pre_quant_scale), "int4_awq", weight, weight_scale,
                        aot=aot, locks=locks)


def w4a8_awq_torch(x, weight, weight_scale, input_scale, pre_quant_scale=None, **_):
    return int4_awq_linear_ref(_fp8_activations(x, input_scale, pre_quant_scale), weight, weight_scale)
