"""The CPU kernels on torch tensors: each takes float32 CPU tensors and returns a new contiguous
float32 tensor, or None where it does not apply (no library: see build.py; another dtype or device;
a layout it does not take), and the caller runs its PyTorch ops instead (the same numbers:
plugins/reference/cpu.py defines them).

Why: a float32 decode step on CPU is bound by how many ops it dispatches (a SmolLM2 layer ran ~127);
fp8 fake quantization alone was ~13 of them, 4-6 times a layer. One ctypes call costs a few
microseconds, whatever the row count; at prefill sizes the kernels are also faster than the ops.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from . import build

_F32 = torch.float32
_state: list = []   # [library or None] after the first call


def library():
    """The loaded kernels, or None (built and loaded on first use: build.load)."""
    if not _state:
        _state.append(build.load())
    return _state[0]


@contextlib.contextmanager
def using(lib) -> Iterator[None]:
    """Run with ``lib`` as the loaded kernels (None: the PyTorch ops), then with what was there:
    for benchmarks and tests that compare the two ways in one process."""
    before = library()
    _state[:] = [lib]
    try:
        yield
    finally:
        _state[:] = [before]


def _rows(x: torch.Tensor) -> tuple[int, int, int] | None:
    """``(rows, cols, row stride)`` reading ``x`` as rows of its dims after the first, if the kernels
    can read it in place: float32 on CPU, every dim but the first contiguous (a column slice of a
    fused GEMM output is; its rows are ``stride`` floats apart)."""
    if x.dtype is not _F32 or x.device.type != "cpu" or x.dim() == 0:
        return None
    if x.dim() == 1:
        return (1, x.shape[0], x.shape[0]) if x.stride(0) == 1 or x.shape[0] < 2 else None
    cols = 1
    for d in range(x.dim() - 1, 0, -1):
        if x.shape[d] != 1 and x.stride(d) != cols:
            return None
        cols *= x.shape[d]
    return x.shape[0], cols, (x.stride(0) if x.shape[0] > 1 else cols)


def fake_quant_fp8(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor | None:
    """``fake_quant_fp8_ref(x, scale)``; rows of ``x`` may be strided (a column slice)."""
    lib = library()
    rx = _rows(x) if lib is not None else None
    if rx is None:
        return None
    rows, cols, stride = rx
    y = torch.empty(x.shape, dtype=_F32)
    if rows and cols:
        lib.kiln_fake_quant_fp8(x.data_ptr(), stride, y.data_ptr(), rows, cols, float(scale))
    return y


def mul_fake_quant_fp8(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor | None:
    """``mul_fake_quant_fp8_ref(a, b, scale)`` for ``a``, ``b`` of one shape (rows may be strided)."""
    lib = library()
    if lib is None or a.shape != b.shape:
        return None
    ra, rb = _rows(a), _rows(b)
    if ra is None or rb is None:
        return None
    y = torch.empty(a.shape, dtype=_F32)
    if ra[0] and ra[1]:
        lib.kiln_mul_fake_quant_fp8(a.data_ptr(), ra[2], b.data_ptr(), rb[2], y.data_ptr(), ra[0], ra[1], float(scale))
    return y


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """``rope_ref(x, cos, sin)``: ``x [T, H, D]`` with contiguous heads (rows may be strided: the q|k
    columns of a fused qkv), ``cos``/``sin`` ``[T, 1, D]`` or ``[T, D]`` contiguous -> ``[T, H, D]``."""
    lib = library()
    if lib is None or x.dim() != 3 or x.dtype is not _F32 or x.device.type != "cpu":
        return None
    t, h, d = x.shape
    if (d % 2 or x.stride(2) != 1 or x.stride(1) != d or cos.dtype is not _F32 or sin.dtype is not _F32
            or not cos.is_contiguous() or not sin.is_contiguous() or cos.numel() != t * d or sin.numel() != t * d):
        return None
    y = torch.empty(t, h, d, dtype=_F32)
    if y.numel():
        lib.kiln_rope(x.data_ptr(), x.stride(0) if t > 1 else h * d, cos.data_ptr(), sin.data_ptr(), y.data_ptr(),
                      t, h, d)
    return y
