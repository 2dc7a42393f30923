"""What both W4A16 GEMMs (``gemm_w4a16.py`` for M > 16, ``gemm_w4a16_small.py`` for decode-sized M)
share: the format ids, the 4-bit decode, the format an engine runs and the arguments compiled as
multiples of 16. Its own module so the two kernels need not import each other (the large-M launcher
hands small M to the small kernel)."""
from __future__ import annotations

import triton
import triton.language as tl

FMT_INT4_AWQ = 0
FMT_NVFP4 = 1
FORMATS = {"int4_awq": FMT_INT4_AWQ, "nvfp4": FMT_NVFP4}


@triton.jit
def decode_4bit(nib, FMT: tl.constexpr):
    """4-bit codes (int32) -> fp32 values (before scaling)."""
    if FMT == 0:
        val = (nib - 8).to(tl.float32)
    else:
        mag = nib & 7
        e = mag >> 1
        m = (mag & 1).to(tl.float32)
        # e2m1: subnormal m*0.5 when e == 0, else (1 + m/2) * 2^(e-1)
        val = tl.where(e == 0, m * 0.5, (2.0 + m) * (1 << e).to(tl.float32) * 0.25)
        val = tl.where(nib >= 8, -val, val)
    return val


def divisible(e) -> tuple[str, ...]:
    """Integer arguments the engine's shapes make multiples of 16 (compiled so: 16-byte weight loads):
    K and x's row stride (x is made contiguous), the packed row K/2, the scale row K/group; k_per_split is
    whole K tiles. The launcher sends a call that breaks one to JIT."""
    from .common import divisible_args, linear_in_features
    ks = linear_in_features(e)
    group = 16 if e.quant_format == "nvfp4" else int(e.group_size or 0)
    vals = {"K": ks, "k_per_split": {16}, "stride_xm": ks, "stride_wn": {k // 2 for k in ks}}
    if group and all(k % group == 0 for k in ks):
        vals["stride_sn"] = {k // group for k in ks}
    return divisible_args(vals)


def w4a16_format(e) -> str | None:
    """The W4A16 kernel format an engine's quantization runs (W4A8 runs the same GEMM), or None."""
    fmt = "int4_awq" if e.quant_format == "w4a8_awq" else e.quant_format
    return fmt if fmt in FORMATS else None
