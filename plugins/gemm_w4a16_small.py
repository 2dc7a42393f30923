"""Triton kernel: W4A16 GEMM for decode-sized M (1..16 rows), one launch, split-K in the launch.

y = x @ dequant(W)^T with the 4-bit weight (docs/contracts.md section 3: two codes per byte, low nibble =
even k) unpacked in registers, never written out. Why a kernel of its own: at M <= 16 the GEMM only
streams the weight (K x N / 2 bytes), and plugins/gemm_w4a16.py's tiles put M on the MMA's wide side,
padded 1 -> 16, with a fixed split-K summed by a second launch (0.37x a bf16 GEMM at M = 1 on the H200).
This is the W4A16 sibling of plugins/gemm_fp8_small.py and shares its structure:

- each program owns BLOCK_N output rows and one K slice; the slices are as many as fill
  programs_per_sm x SMs programs (at most max_splits), so a 4096 x 4096 layer (64 N tiles) still runs
  on every SM;
- ``USE_DOT``: the product is computed transposed, ``w [BLOCK_N, BLOCK_K/2] @ x^T [BLOCK_K/2, 16]``
  (even and odd k as two half-width dots: packed bytes are never interleaved), so the weight is the
  MMA's wide operand and M only pads the narrow one; otherwise (M = 1, the "w4a16_gemv" configuration)
  products and sums on CUDA cores;
- scales, once per group where the format allows it:
  * int4_awq with the K tile inside one group (group % BLOCK_K == 0, e.g. group 128): the codes
    (-8..7, exact in 16 bits) go into the dot unscaled and the group's scale multiplies the tile's
    partial sums, BLOCK_N x 16 multiplies instead of BLOCK_N x BLOCK_K;
  * nvfp4: e2m1 code x its e4m3 block scale is exact in fp16/bf16 (at most 6 significant bits, inside
    both ranges), so each element takes one multiply and the fp32 global scale multiplies the
    accumulator once at the end (the old kernel multiplied every element by both, in fp32);
  * the CUDA-core path sums each group's products first and scales the group sum (BLOCK_K / group
    multiplies per row and tile), for both formats;
  * otherwise (int4 groups narrower than the tile) one multiply per element, as the reference rounds.
- split-K without a second launch: partials in fp32, the last program of an N tile to arrive (an atomic
  counter per tile, reset by that program) adds them in split order (deterministic) and stores.
Expected effect (unmeasured: `make bench-kernels` A/B vs a bf16 GEMM at M = 1, 4, 16): the weight read
at a large share of copy bandwidth instead of 0.37x bf16; measurement is the device script's.
Reference: plugins/reference/gemm.py (nvfp4_linear_ref, int4_awq_linear_ref).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import tuning
from . import splitk
from .common import Variant, check, launch
from .splitk import plan_splits, store_split_k
from .w4a16_codes import FORMATS, FMT_INT4_AWQ, FMT_NVFP4, decode_4bit, divisible, w4a16_format

MAX_M = 16                      # rows this kernel takes; larger M is plugins/gemm_w4a16.py's

SCALE_ELEMENT = 0   # one multiply per weight element (in the activation dtype, as the reference rounds)
SCALE_TILE = 1      # int4: one scale per row per K tile, on the tile's partial sums
SCALE_GROUP = 2     # CUDA cores: per-group sums, then one multiply per group


@triton.jit
def w4a16_small_m_kernel(out_ptr, x_ptr, w_ptr, ws_ptr, ws2_ptr, part_ptr, lock_ptr,
                         M, N, K, k_per_split, num_splits, stride_xm, stride_wn, stride_sn, stride_om,
                         FMT: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr, SCALE: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    half = tl.arange(0, BLOCK_K // 2)
    nmask = rn < N
    mmask = rm < M
    k_lo = pid_k * k_per_split                  # k_per_split: whole BLOCK_K tiles
    k_hi = tl.minimum(k_lo + k_per_split, K)
    w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_wn
    s_rows = ws_ptr + rn.to(tl.int64) * stride_sn
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_xm
    xdt = x_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)            # transposed: [n, m]
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kp = k0 // 2 + half                                    # packed column
        kmask = kp < k_hi // 2
        wmask = nmask[:, None] & kmask[None, :]
        packed = tl.load(w_rows + kp[None, :], mask=wmask, other=0).to(tl.int32)
        # x's K tile in one contiguous load, split into even and odd k in registers
        kk = k0 + tl.arange(0, BLOCK_K)
        xt = tl.load(x_rows + kk[None, :], mask=mmask[:, None] & (kk < k_hi)[None, :], other=0.0)
        x_even, x_odd = tl.split(tl.reshape(xt, [BLOCK_M, BLOCK_K // 2, 2]))   # [BLOCK_M, BLOCK_K/2] each
        v_even = decode_4bit(packed & 15, FMT)                    # fp32 code values, unscaled
        v_odd = decode_4bit(packed >> 4, FMT)
        if SCALE == 2:
            # CUDA cores (BLOCK_M == 1): products summed per group, each group sum scaled once
            prod = v_even * x_even.to(tl.float32) + v_odd * x_odd.to(tl.float32)   # [BLOCK_N, BLOCK_K/2]
            gsum = tl.sum(tl.reshape(prod, [BLOCK_N, BLOCK_K // GROUP, GROUP // 2]), 2)
            gi = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
            sc = tl.load(s_rows[:, None] + gi[None, :], mask=nmask[:, None] & (gi < k_hi // GROUP)[None, :],
                         other=0.0).to(tl.float32)
            acc += tl.sum(gsum * sc, 1)[:, None]
        else:
            if SCALE == 1:
                w_even = v_even.to(xdt)                        # -8..7: exact
                w_odd = v_odd.to(xdt)
            else:
                if GROUP <= BLOCK_K:
                    # the tile's BLOCK_K / GROUP scales of a row in one load, broadcast over their groups
                    gi = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
                    sg = tl.load(s_rows[:, None] + gi[None, :], mask=nmask[:, None] & (gi < k_hi // GROUP)[None, :],
                                 other=0.0).to(tl.float32)
                    sc = tl.reshape(tl.broadcast_to(sg[:, :, None], [BLOCK_N, BLOCK_K // GROUP, GROUP // 2]),
                                    [BLOCK_N, BLOCK_K // 2])
                else:
                    sc = tl.load(s_rows[:, None] + (2 * kp[None, :]) // GROUP, mask=wmask, other=0.0).to(tl.float32)
                # nvfp4: code x e4m3 scale is exact in 16 bits; int4: rounded as the reference rounds
                w_even = (v_even * sc).to(xdt)
                w_odd = (v_odd * sc).to(xdt)
            if USE_DOT:
                if xdt == tl.float32:
                    part = tl.dot(w_even, tl.trans(x_even), input_precision="ieee")
                    part += tl.dot(w_odd, tl.trans(x_odd), input_precision="ieee")
                else:
                    part = tl.dot(w_even, tl.trans(x_even))
                    part += tl.dot(w_odd, tl.trans(x_odd))
            else:
                part = tl.sum(w_even.to(tl.float32) * x_even.to(tl.float32)
                              + w_odd.to(tl.float32) * x_odd.to(tl.float32), axis=1)[:, None]
            if SCALE == 1:
                srow = tl.load(s_rows + k0 // GROUP, mask=nmask, other=0.0).to(tl.float32)
                acc += part * srow[:, None]
            else:
                acc += part
    scale = tl.full([BLOCK_N], 1.0, tl.float32)
    if FMT == 1:
        scale = scale * tl.load(ws2_ptr)                       # nvfp4's global scale, once per output
    omask = nmask[:, None] & mmask[None, :]
    store_split_k(acc, scale, out_ptr, part_ptr, lock_ptr, rn, rm, omask, stride_om, N, pid_n, pid_k,
                  num_splits, BLOCK_N, BLOCK_M)


def gemm_config(M: int) -> dict:
    """The launch configuration for M rows (plugins.tuning): "w4a16_gemv" (CUDA cores, one row) when it
    is enabled and M == 1, else "w4a16_small_m" (tensor cores, M padded to 16)."""
    gemv = tuning.get("w4a16_gemv")
    if M == 1 and gemv["enabled"]:
        return dict(gemv, block_m=1, use_dot=False)
    return dict(tuning.get("w4a16_small_m"), block_m=16, use_dot=True)


def scale_mode(fmt_id: int, group: int, cfg: dict) -> int:
    """How the kernel applies the group scales for this format, group size and configuration."""
    bk = cfg["block_k"]
    if not cfg["use_dot"] and bk % group == 0 and group & (group - 1) == 0:
        return SCALE_GROUP
    if fmt_id == FMT_INT4_AWQ and group % bk == 0:
        return SCALE_TILE
    return SCALE_ELEMENT


def lock_count(N: int) -> int:
    """int32 counters a caller keeps for weights of N output rows (one per N tile of any configuration)."""
    return splitk.lock_count(N, "w4a16_gemv", "w4a16_small_m")


def w4a16_small_m(x: torch.Tensor, fmt: str, weight: torch.Tensor, weight_scale: torch.Tensor,
                  weight_scale_2: torch.Tensor | None = None, locks: torch.Tensor | None = None, aot=None,
                  split_k: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [M, K], M <= 16, fp16/bf16/fp32 with contiguous rows (AWQ's pre_quant_scale already applied:
    plugins.gemm_w4a16.w4a16_linear does); weight: uint8 [N, K/2]; weight_scale: [N, K/group] (int4_awq,
    model dtype) or float8_e4m3fn [N, K/16] (nvfp4); weight_scale_2: fp32 [] (nvfp4); locks: int32
    zeros, >= lock_count(N) entries (None: allocated here, zeroed: one extra kernel); split_k: K slices
    (default: plan_splits); out: an [M, N] x.dtype buffer to write (tests poison it). -> [M, N] x.dtype."""
    check(fmt in FORMATS, f"w4a16_small_m: format {fmt!r}; allowed: {', '.join(FORMATS)}")
    check(x.dim() == 2, f"w4a16_small_m: x must be [M, K], got {tuple(x.shape)}")
    M, K = x.shape
    N = weight.shape[0]
    check(M <= MAX_M, f"w4a16_small_m: {M} rows; allowed: at most {MAX_M} (larger M: gemm_w4a16)")
    check(weight.dtype == torch.uint8 and weight.shape == (N, K // 2) and K % 2 == 0,
          f"w4a16_small_m: weight must be uint8 [N, {K // 2}] for K={K}, got {weight.dtype} {tuple(weight.shape)}")
    check(x.stride(1) == 1 and weight.stride(1) == 1 and weight_scale.stride(-1) == 1,
          "w4a16_small_m: x, weight and weight_scale need contiguous rows")
    check(weight_scale.dim() == 2 and weight_scale.shape[0] == N and weight_scale.shape[1] > 0
          and K % weight_scale.shape[1] == 0, f"w4a16_small_m: weight_scale shape {tuple(weight_scale.shape)} "
          f"does not divide K={K} into groups")
    group = K // weight_scale.shape[1]
    check(group % 2 == 0, f"w4a16_small_m: group size {group} must be even")
    fmt_id = FORMATS[fmt]
    if fmt_id == FMT_NVFP4:
        check(group == 16 and weight_scale.dtype == torch.float8_e4m3fn and weight_scale_2 is not None,
              "w4a16_small_m: nvfp4 needs float8_e4m3fn weight_scale [N, K/16] and weight_scale_2")
        ws2 = weight_scale_2.reshape(1).float()
    else:
        ws2 = weight_scale   # unused by the int4 variant (compiled with the scale's type)
    if out is None:
        out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    check(out.shape == (M, N) and out.dtype == x.dtype and out.stride(1) == 1,
          f"w4a16_small_m: out must be [{M}, {N}] {x.dtype} with contiguous rows")
    if M == 0 or N == 0:
        return out
    cfg = gemm_config(M)
    splits, per = plan_splits(N, K, cfg, x.device, split_k)
    n_tiles = triton.cdiv(N, cfg["block_n"])
    if splits > 1:
        if locks is None:
            locks = torch.zeros(n_tiles, dtype=torch.int32, device=x.device)
        check(locks.dtype == torch.int32 and locks.numel() >= n_tiles,
              f"w4a16_small_m: locks must be int32 with >= {n_tiles} entries")
        part = torch.empty(splits, N, cfg["block_m"], dtype=torch.float32, device=x.device)
    else:
        # unused without a split: any fp32 / int32 tensors (torch.empty launches nothing)
        part = torch.empty(1, dtype=torch.float32, device=x.device)
        locks = locks if locks is not None else torch.empty(1, dtype=torch.int32, device=x.device)
    launch(w4a16_small_m_kernel, (n_tiles, splits),
           (out, x, weight, weight_scale, ws2, part, locks, M, N, K, per, splits, x.stride(0), weight.stride(0),
            weight_scale.stride(0), out.stride(0)),
           _constexprs(fmt_id, group, cfg), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], aot=aot)
    return out


def _constexprs(fmt_id: int, group: int, cfg: dict) -> dict:
    return dict(FMT=fmt_id, GROUP=group, BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"],
                USE_DOT=cfg["use_dot"], SCALE=scale_mode(fmt_id, group, cfg))


def aot_variants(e) -> list[Variant]:
    """4-bit engines: one variant per M class of gemm_config (M = 1, M = 2..16); N, K, the split count
    and the strides are runtime arguments, so every linear of the engine shares them. Integer arguments
    the shapes make multiples of 16 are compiled so (w4a16_codes.divisible)."""
    fmt = w4a16_format(e)
    if fmt is None:
        return []
    nvfp4 = fmt == "nvfp4"
    group = 16 if nvfp4 else int(e.group_size)
    types = dict(out_ptr=f"*{e.act}", x_ptr=f"*{e.act}", w_ptr="*u8", ws_ptr="*fp8e4nv" if nvfp4 else f"*{e.act}",
                 ws2_ptr="*fp32" if nvfp4 else f"*{e.act}", part_ptr="*fp32", lock_ptr="*i32",
                 M="i32", N="i32", K="i32", k_per_split="i32", num_splits="i32", stride_xm="i32",
                 stride_wn="i32", stride_sn="i32", stride_om="i32")
    out = {}
    for m in (1, MAX_M):
        cfg = gemm_config(m)
        v = Variant(w4a16_small_m_kernel, types, _constexprs(FORMATS[fmt], group, cfg), num_warps=cfg["num_warps"],
                    num_stages=cfg["num_stages"], divisible=divisible(e))
        out.setdefault(v.key, v)
    return list(out.values())
