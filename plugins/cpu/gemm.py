"""The CPU GEMM (gemm.c) on torch tensors: weights packed into 16-column panels once, at load, then
``y = (x @ W^T) * scale`` for float32 ``x``. AVX-512 CPUs only (``available``); elsewhere the callers
(backend/ops/cpu_matmul.py) keep FBGEMM's fp16 GEMM.

Two weight storages, both exact for the values they take:
* ``FP16``: a weight whose every value is an fp16 (bf16 checkpoints, quantization codes);
* ``E4M3``: fp8 e4m3 codes, one byte each (fp8 bundles): half the bytes a decode step streams.
"""
from __future__ import annotations

import torch

from . import build

FP16, E4M3 = 0, 1
PANEL = 16                 # output columns per panel (one 16-float AVX-512 vector)
_E4M3_MULT = 256.0         # gemm.c widens a code to value * 2^-8; the store multiplies it back

_available: list[bool] = []


def available() -> bool:
    """Whether the kernel library is loaded and this CPU runs its GEMM (AVX-512 F/BW/VL, F16C, FMA).
    The process's library itself (build.load), not ``ops.using``'s choice: weights packed for this
    kernel at load have no other way to be multiplied, so benchmarks that switch the other kernels
    off leave this one on."""
    if not _available:
        lib = build.load()
        _available.append(lib is not None and bool(lib.kiln_gemm_available()))
    return _available[0]


def pack(w: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``w [N, K]`` (float16 or float8_e4m3fn) -> ``(panels, fmt)``: ``panels [ceil(N/16), K, 16]``
    (uint16 or uint8 bit patterns; the columns past N zero), k-major inside a panel, which is the order
    the kernel reads a panel in."""
    if w.dim() != 2 or w.dtype not in (torch.float16, torch.float8_e4m3fn):
        raise ValueError(f"plugins.cpu.gemm.pack: a [N, K] float16 or float8_e4m3fn weight, got "
                         f"{w.dtype} {tuple(w.shape)}")
    n, k = w.shape
    fmt = FP16 if w.dtype == torch.float16 else E4M3
    bits = w.contiguous().view(torch.uint16 if fmt == FP16 else torch.uint8)
    padded = bits.new_zeros((n + PANEL - 1) // PANEL * PANEL, k)
    padded[:n] = bits
    return padded.view(-1, PANEL, k).transpose(1, 2).contiguous(), fmt


def unpack(panels: torch.Tensor, fmt: int, n: int) -> torch.Tensor:
    """``pack``'s inverse: the ``[N, K]`` weight as float32."""
    rows = panels.transpose(1, 2).reshape(-1, panels.shape[1])[:n]
    return rows.view(torch.float16 if fmt == FP16 else torch.float8_e4m3fn).float()


def gemm(x: torch.Tensor, panels: torch.Tensor, fmt: int, n: int, scale: torch.Tensor | None = None,
         threads: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K]`` float32 (contiguous) times the packed ``[N, K]`` weight, transposed, each output
    column times ``scale[n]`` (float32 ``[N]``, contiguous) when given -> ``[M, N]`` float32.
    ``threads``: default PyTorch's count (the kernel runs in the same OpenMP team); ``out``: a
    contiguous ``[M, N]`` float32 tensor to write (tests poison it)."""
    lib = build.load()
    m, k = x.shape
    # rows K floats apart (a single row's stride is whatever its view has: torch calls it contiguous)
    if (x.dtype is not torch.float32 or x.stride(1) != 1 or (m > 1 and x.stride(0) != k) or panels.shape[1] != k
            or (scale is not None and (scale.dtype is not torch.float32 or scale.numel() != n
                                       or not scale.is_contiguous()))):
        raise ValueError(f"plugins.cpu.gemm: x must be contiguous float32 [M, {panels.shape[1]}] and scale "
                         f"float32 [{n}]; got x {x.dtype} {tuple(x.shape)} strides {x.stride()}")
    y = torch.empty(m, n, dtype=torch.float32) if out is None else out
    if y.shape != (m, n) or y.dtype is not torch.float32 or not y.is_contiguous():
        raise ValueError(f"plugins.cpu.gemm: out must be contiguous float32 [{m}, {n}]")
    failed = lib.kiln_gemm(x.data_ptr(), m, k, panels.data_ptr(), fmt, n, y.data_ptr(),
                           scale.data_ptr() if scale is not None else None,
                           _E4M3_MULT if fmt == E4M3 else 1.0, threads or torch.get_num_threads())
    if failed:
        raise RuntimeError("plugins.cpu.gemm: this CPU cannot run kiln_gemm (no AVX-512); check available()")
    return y
