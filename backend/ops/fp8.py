"""fp8 e4m3 codes <-> scaled values, fast on CPU, same bits everywhere.

PyTorch converts fp8 to float on CPU one element at a time: 3 ns per value on the development VM
(76 us for a 16 x 1536 activation; 10 ms for a 2048-token prefill's), which made the emulated
activation quantization of every FP8 linear cost more than half its GEMM in a decode step. There
are only 256 codes: gathering ``code x scale`` from a 256-entry table by byte gives the bits of
``(codes.float() * scale).to(dtype)`` exactly (the table holds that same fp32 product, rounded to
``dtype`` the same way) at a fraction of the time. Quantizing (float -> fp8) is vectorized and stays.
Below ``TABLE_MIN`` values the table's own ops (building it, widening the byte index) cost more than
the conversion saves: a decode row (576-1536 values) converts directly in half the time, measured
on the 2-core AVX2 EPYC (30 vs 65 us for a whole fake quantization; crossover between 6k and 9k values).
"""
from __future__ import annotations

import torch

from plugins import registry

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
# Every fp8 e4m3 value by its byte (the NaN codes 0x7f and 0xff included).
FP8_VALUES = torch.arange(256, dtype=torch.uint8).view(FP8).float()
TABLE_MIN = 8192
_cpu_fake_quant_fp8 = registry.load("fake_quant_fp8", "cpu")   # the CPU kernel, where it applies


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x / scale`` to e4m3, saturated: a value past the calibrated range clips, never NaN."""
    return ((x if x.dtype == torch.float32 else x.float()) / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(codes.float() * scale).to(dtype)``, bit for bit; by table lookup on CPU from TABLE_MIN values."""
    if codes.device.type != "cpu" or codes.numel() < TABLE_MIN:
        values = codes.float().mul_(scale)
        return values if dtype == torch.float32 else values.to(dtype)
    table = (FP8_VALUES * scale.float()).to(dtype)
    return table.index_select(0, codes.view(torch.uint8).reshape(-1).int()).view(codes.shape)


def fake_quant(x: torch.Tensor, scale: torch.Tensor, scale_value: float | None = None) -> torch.Tensor:
    """Per-tensor static e4m3 activation quantization, returned dequantized in ``x``'s dtype: float32
    on CPU in one pass of the CPU kernel (plugins/cpu: the same bits, one call for the ~13 ops below).
    ``scale_value``: ``float(scale)`` if the caller keeps it (saves reading the tensor every call)."""
    y = _cpu_fake_quant_fp8(x, scale if scale_value is None else scale_value)
    if y is not None:
        return y
    return dequantize(quantize(x, scale), scale, x.dtype)
