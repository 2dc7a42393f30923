"""Triton kernel: W4A16 GEMM, y = x @ dequant(W)^T with 4-bit weights unpacked inside the GEMM.

Formats (docs/contracts.md section 3), both packing two 4-bit values per byte, low nibble = even k:
- int4_awq: value = nibble - 8, times weight_scale [N, K/group] (model dtype); pre_quant_scale [K] is
  applied to x on the host (one elementwise multiply, cheaper than per tile).
- nvfp4: e2m1 codes, times float8_e4m3fn weight_scale [N, K/16] and the fp32 weight_scale_2 [].
Even and odd k are multiplied as two half-width dots, so packed bytes never need interleaving.
Reference: plugins/reference/gemm.py.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import tuning
from .common import Variant, check, launch
from .w4a16_codes import FMT_INT4_AWQ, FORMATS, decode_4bit, divisible, w4a16_format

@triton.jit
def w4a16_gemm_kernel(out_ptr, x_ptr, w_ptr, ws_ptr, ws2_ptr, M, N, K, k_per_split,
                      stride_xm, stride_om, stride_wn, stride_sn,
                      FMT: tl.constexpr, GROUP: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                      ROW_SCALE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    half = tl.arange(0, BLOCK_K // 2)
    mmask = rm < M
    nmask = rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if FMT == 1:
        global_scale = tl.load(ws2_ptr)
    # split-K (decode-sized M: few output tiles, so K is shared out too); k_per_split % BLOCK_K == 0
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kp = k0 // 2 + half                 # packed column
        kmask = kp < k_hi // 2
        wmask = nmask[:, None] & kmask[None, :]
        packed = tl.load(w_ptr + rn[:, None].to(tl.int64) * stride_wn + kp[None, :], mask=wmask, other=0).to(tl.int32)
        xmask = mmask[:, None] & kmask[None, :]
        xp = x_ptr + rm[:, None].to(tl.int64) * stride_xm + 2 * kp[None, :]
        x_even = tl.load(xp, mask=xmask, other=0.0)
        x_odd = tl.load(xp + 1, mask=xmask, other=0.0)
        if ROW_SCALE:
            # int4 with the whole K tile inside one group: one scale per output row, applied to the
            # tile's partial sums (BLOCK_N multiplies instead of BLOCK_N x BLOCK_K; -8..7 are exact)
            srow = tl.load(ws_ptr + rn.to(tl.int64) * stride_sn + k0 // GROUP, mask=nmask, other=0.0).to(tl.float32)
            w_even = ((packed & 15) - 8).to(x_ptr.dtype.element_ty)
            w_odd = ((packed >> 4) - 8).to(x_ptr.dtype.element_ty)
            part = tl.dot(x_even, tl.trans(w_even)) + tl.dot(x_odd, tl.trans(w_odd))
            acc += part * srow[None, :]
        else:
            scale = tl.load(ws_ptr + rn[:, None].to(tl.int64) * stride_sn + (2 * kp[None, :]) // GROUP,
                            mask=wmask, other=0.0).to(tl.float32)
            if FMT == 1:
                scale = scale * global_scale
            w_even = (decode_4bit(packed & 15, FMT) * scale).to(x_ptr.dtype.element_ty)
            w_odd = (decode_4bit(packed >> 4, FMT) * scale).to(x_ptr.dtype.element_ty)
            acc += tl.dot(x_even, tl.trans(w_even))
            acc += tl.dot(x_odd, tl.trans(w_odd))
    if SPLIT:   # fp32 partials [splits, M, N], summed by the wrapper
        part = out_ptr + pid_k.to(tl.int64) * M * N + rm[:, None].to(tl.int64) * N + rn[None, :]
        tl.store(part, acc, mask=mmask[:, None] & nmask[None, :])
    else:
        tl.store(out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=mmask[:, None] & nmask[None, :])


SMALL_M = 16   # M at or below this runs plugins/gemm_w4a16_small.py (decode-sized: the weight streams)


def gemm_config(M: int) -> dict:
    """Tiles, warps, stages and split-K of this kernel (plugins.tuning "w4a16_large"): it runs M > SMALL_M
    (w4a16_linear sends smaller M to the small-M kernel), or any M when called directly."""
    return tuning.get("w4a16_large")


def w4a16_linear(x: torch.Tensor, fmt: str, weight: torch.Tensor, weight_scale: torch.Tensor,
                 weight_scale_2: torch.Tensor | None = None, pre_quant_scale: torch.Tensor | None = None,
                 aot=None, split_k: int | None = None, locks: torch.Tensor | None = None) -> torch.Tensor:
    """x: [M, K] fp16/bf16/fp32 (rows contiguous); weight: uint8 [N, K/2]; weight_scale: [N, K/group]
    (int4_awq, model dtype) or float8_e4m3fn [N, K/16] (nvfp4); weight_scale_2: fp32 [] (nvfp4);
    pre_quant_scale: [K] (int4_awq, optional); split_k: K slices summed in fp32 (default: tuning);
    locks: int32 zeros for the small-M kernel's split-K counters (gemm_w4a16_small.lock_count(N); None:
    allocated per call). -> [M, N] in x.dtype. M <= SMALL_M runs gemm_w4a16_small (one launch)."""
    check(fmt in FORMATS, f"w4a16_linear: format {fmt!r}; allowed: {', '.join(FORMATS)}")
    check(x.dim() == 2, f"w4a16_linear: x must be [M, K], got {tuple(x.shape)}")
    M, K = x.shape
    N = weight.shape[0]
    check(weight.dtype == torch.uint8 and weight.shape == (N, K // 2) and K % 2 == 0,
          f"w4a16_linear: weight must be uint8 [N, {K // 2}] for K={K}, got {weight.dtype} {tuple(weight.shape)}")
    check(weight_scale.dim() == 2 and weight_scale.shape[0] == N and weight_scale.shape[1] > 0
          and K % weight_scale.shape[1] == 0, f"w4a16_linear: weight_scale shape {tuple(weight_scale.shape)} "
          f"does not divide K={K} into groups")
    group = K // weight_scale.shape[1]
    check(group % 2 == 0, f"w4a16_linear: group size {group} must be even")
    if fmt == "nvfp4":
        check(group == 16 and weight_scale.dtype == torch.float8_e4m3fn and weight_scale_2 is not None,
              "w4a16_linear: nvfp4 needs float8_e4m3fn weight_scale [N, K/16] and weight_scale_2")
        ws2 = weight_scale_2.reshape(1).float()
    else:
        ws2 = weight_scale  # unused by the int4 variant
    if pre_quant_scale is not None:
        x = x * pre_quant_scale.to(x.dtype)
    x = x.contiguous()
    weight, weight_scale = weight.contiguous(), weight_scale.contiguous()
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    if M <= SMALL_M:
        from .gemm_w4a16_small import w4a16_small_m
        return w4a16_small_m(x, fmt, weight, weight_scale, weight_scale_2, locks=locks, aot=aot, split_k=split_k,
                             out=out)
    cfg = gemm_config(M)
    bm, bn, bk = cfg["block_m"], cfg["block_n"], cfg["block_k"]
    splits = max(1, min(split_k or cfg["split_k"], triton.cdiv(K, bk)))
    per = triton.cdiv(triton.cdiv(K, splits), bk) * bk      # whole K tiles per split
    splits = triton.cdiv(K, per)
    dest = torch.empty(splits, M, N, dtype=torch.float32, device=x.device) if splits > 1 else out
    launch(w4a16_gemm_kernel, (triton.cdiv(M, bm), triton.cdiv(N, bn), splits),
           (dest, x, weight, weight_scale, ws2, M, N, K, per, x.stride(0), out.stride(0), weight.stride(0),
            weight_scale.stride(0)),
           _constexprs(FORMATS[fmt], group, cfg, splits > 1), num_warps=cfg["num_warps"],
           num_stages=cfg["num_stages"], aot=aot)
    if splits > 1:
        torch.sum(dest, dim=0, out=out) if out.dtype == torch.float32 else out.copy_(dest.sum(0))
    return out


def _constexprs(fmt_id: int, group: int, cfg: dict, split: bool) -> dict:
    row_scale = fmt_id == FMT_INT4_AWQ and group % cfg["block_k"] == 0
    return dict(FMT=fmt_id, GROUP=group, BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"],
                SPLIT=split, ROW_SCALE=row_scale)


def aot_variants(e) -> list[Variant]:
    """M > SMALL_M (M, N, K are runtime arguments): unsplit and, when tuned so, split-K."""
    fmt = w4a16_format(e)
    if fmt is None:
        return []
    nvfp4 = fmt == "nvfp4"
    types = dict(out_ptr=f"*{e.act}", x_ptr=f"*{e.act}", w_ptr="*u8", ws_ptr="*fp8e4nv" if nvfp4 else f"*{e.act}",
                 ws2_ptr="*fp32" if nvfp4 else f"*{e.act}", M="i32", N="i32", K="i32", k_per_split="i32",
                 stride_xm="i32", stride_om="i32", stride_wn="i32", stride_sn="i32")
    group = 16 if nvfp4 else int(e.group_size)
    out = []
    cfg = gemm_config(SMALL_M + 1)
    for split in sorted({False, cfg["split_k"] > 1}):
        t = dict(types, out_ptr="*fp32") if split else types
        out.append(Variant(w4a16_gemm_kernel, t, _constexprs(FORMATS[fmt], group, cfg, split),
                           num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], divisible=divisible(e)))
    return out
