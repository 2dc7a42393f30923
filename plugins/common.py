"""Helpers shared by the kernels: fp8 rounding that is exact everywhere, and small host utilities."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def round_to_e4m3(x):
    """fp32 x -> fp32 holding the nearest float8_e4m3fn value (round-to-nearest-even, saturated at 448).

    Why by hand: Triton's interpreter truncates f32 -> fp8e4nv casts (e.g. 1.99 -> 1.0) and does not
    saturate, so casting the already-rounded value keeps CPU tests and GPU runs bit-identical.
    """
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    bits = x.to(tl.int32, bitcast=True)
    # normal range: keep 3 mantissa bits of fp32's 23, rounding half to even
    lsb = (bits >> 20) & 1
    rounded = ((bits + 0x7FFFF + lsb) & ~0xFFFFF).to(tl.float32, bitcast=True)
    # subnormal range of e4m3 (|x| < 2^-6): a fixed step of 2^-9, ties to even, sign kept (also of -0)
    a = tl.abs(x) * 512.0
    r = tl.floor(a + 0.5)
    r = tl.where((r - a == 0.5) & (r % 2.0 == 1.0), r - 1.0, r)
    sub = ((r / 512.0).to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(x) < 0.015625, sub, rounded)


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def scale_tensor(scale, device) -> torch.Tensor:
    """A per-layer scale (None, float or 0-d tensor) as a 1-element fp32 tensor the kernels read."""
    if scale is None:
        return torch.ones(1, dtype=torch.float32, device=device)
    if isinstance(scale, torch.Tensor):
        return scale.reshape(1).to(device=device, dtype=torch.float32)
    return torch.full((1,), float(scale), dtype=torch.float32, device=device)


def check(cond: bool, msg: str) -> None:
    """User-facing argument check: a one-line ValueError (asserts are for our own invariants)."""
    if not cond:
        raise ValueError(msg)
