"""FP8 (W8A8) linear: torch._scaled_mm on GPUs that have it (rowwise scales), else a Triton GEMM.

Activations are quantized with the static per-tensor input_scale by torch ops (exact on every device;
the Triton interpreter's own fp32 -> fp8 casts are wrong), weights are float8_e4m3fn [N, K] with a
per-output-row fp32 weight_scale. Reference: plugins/reference/gemm.py (fp8_linear_ref).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import Variant, check, launch
from .reference.kv_cache import quantize_fp8


@triton.jit
def fp8_gemm_kernel(out_ptr, x_ptr, w_ptr, ws_ptr, xs_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        a = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + kk[None, :],
                    mask=(rm < M)[:, None] & (kk < K)[None, :], other=0.0)
        b = tl.load(w_ptr + rn[:, None].to(tl.int64) * stride_wn + kk[None, :],
                    mask=(rn < N)[:, None] & (kk < K)[None, :], other=0.0)
        acc += tl.dot(a, tl.trans(b))   # fp8 x fp8 -> fp32 (native on sm_89+)
    acc = acc * tl.load(xs_ptr) * tl.load(ws_ptr + rn, mask=rn < N, other=0.0)[None, :]
    tl.store(out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rm < M)[:, None] & (rn < N)[None, :])


def scaled_mm_usable(x: torch.Tensor, N: int) -> bool:
    """torch._scaled_mm with rowwise scales needs CUDA sm_89+, bf16 output and K, N multiples of 16."""
    if not (x.is_cuda and hasattr(torch, "_scaled_mm") and x.dtype == torch.bfloat16):
        return False
    return torch.cuda.get_device_capability(x.device) >= (8, 9) and x.shape[1] % 16 == 0 and N % 16 == 0


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor,
               use_scaled_mm: bool | None = None, aot=None) -> torch.Tensor:
    """x: [M, K] 16/32-bit; weight: float8_e4m3fn [N, K]; weight_scale: fp32 [N]; input_scale: fp32 [].
    -> [M, N] in x.dtype. use_scaled_mm=None picks torch._scaled_mm when usable."""
    check(x.dim() == 2 and weight.dim() == 2 and weight.shape[1] == x.shape[1],
          f"fp8_linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not share K")
    check(weight.dtype == torch.float8_e4m3fn, f"fp8_linear: weight dtype {weight.dtype}; allowed: float8_e4m3fn")
    M, K = x.shape
    N = weight.shape[0]
    check(weight_scale.numel() == N, f"fp8_linear: weight_scale has {weight_scale.numel()} values, need {N}")
    xq = quantize_fp8(x, input_scale).contiguous()
    xs = input_scale.reshape(1).float()
    ws = weight_scale.reshape(-1).float().contiguous()
    if use_scaled_mm is None:
        use_scaled_mm = scaled_mm_usable(x, N)
    if use_scaled_mm:
        return torch._scaled_mm(xq, weight.t(), scale_a=xs.expand(M, 1).contiguous(), scale_b=ws.view(1, N),
                                out_dtype=x.dtype)
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    bm = _block_m(M)
    w = weight.contiguous()
    launch(fp8_gemm_kernel, (triton.cdiv(M, bm), triton.cdiv(N, 64)),
           (out, xq, w, ws, xs, M, N, K, xq.stride(0), w.stride(0), out.stride(0)),
           dict(BLOCK_M=bm, BLOCK_N=64, BLOCK_K=64), aot=aot)
    return out


def _block_m(M: int) -> int:
    return 16 if M <= 16 else 64


def aot_variants(e) -> list[Variant]:
    """The Triton fallback (GPUs or dtypes where torch._scaled_mm is not usable), per M tile."""
    if e.quant_format != "fp8":
        return []
    types = dict(out_ptr=f"*{e.act}", x_ptr="*fp8e4nv", w_ptr="*fp8e4nv", ws_ptr="*fp32", xs_ptr="*fp32",
                 M="i32", N="i32", K="i32", stride_xm="i32", stride_wn="i32", stride_om="i32")
    return [Variant(fp8_gemm_kernel, types, dict(BLOCK_M=_block_m(m), BLOCK_N=64, BLOCK_K=64), divisible=divisible(e))
            for m in (1, 64)]


def divisible(e) -> tuple[str, ...]:
    """K and the row strides (xq and the weight are contiguous: both K) compiled as multiples of 16 when
    every linear's K of the engine is one (16-byte fp8 loads, pipelined K tiles); the launcher sends a
    call that breaks it to JIT."""
    from .common import divisible_args, linear_in_features
    ks = linear_in_features(e)
    return divisible_args({"K": ks, "stride_xm": ks, "stride_wn": ks})
