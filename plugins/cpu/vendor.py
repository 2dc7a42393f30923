"""The CPU GEMMs PyTorch ships (oneDNN's linear, FBGEMM's fp16-weight GEMM), as rows of the kernel
table like Kiln's own (plugins/registry.py, kind "cpu"), so which matmul a CPU linear runs is chosen
in one place.

Each name is the op's overload itself, or None in a PyTorch build without that library (non-x86,
no mkldnn): a Python wrapper would add a call to each of a decode step's ~120 linears, and the
packet's own dispatch checks every argument for fake script objects first (~10 us a call), so the
``.default`` overload is what is bound. ``*_available`` say which exist; the registry's ``available``
asks them.
"""
from __future__ import annotations

import torch


def _onednn_linear():
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._linear_pointwise
    except (AttributeError, RuntimeError):
        return None


def _fbgemm(name: str):
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return None
    try:
        return getattr(torch.ops.quantized, name).default
    except (AttributeError, RuntimeError):
        return None


# onednn_linear(x, w_column_major, bias, "none", [], "") -> y: oneDNN's matmul (batch invariant over a
# column-major weight given at least two rows; backend/ops/cpu_matmul.py)
onednn_linear = _onednn_linear()
# fp16_pack(w, None) -> packed;  fp16_gemm(x, packed) -> y (fp32 activations and sums);
# fp16_unpack(packed) -> (w fp16, bias)
fp16_pack = _fbgemm("linear_prepack_fp16")
fp16_gemm = _fbgemm("linear_dynamic_fp16")
fp16_unpack = _fbgemm("linear_unpack_fp16")


def onednn_available() -> bool:
    return onednn_linear is not None


def fbgemm_available() -> bool:
    return fp16_pack is not None and fp16_gemm is not None and fp16_unpack is not None
