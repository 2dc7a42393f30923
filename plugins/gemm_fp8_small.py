"""Triton kernel: FP8 (W8A8) GEMM for decode-sized M (1..16 rows), one launch, split-K in the launch.

y[m, n] = xs * ws[n] * sum_k xq[m, k] * w[n, k]: ``xq`` the fp8 e4m3 codes of the activations (static
per-tensor ``input_scale`` xs, the only activation scaling the bundles hold: docs/contracts.md section 3),
``w`` float8_e4m3fn [N, K] with a per-output-row fp32 ``weight_scale`` ws (a per-tensor scale is one
value repeated). Why a kernel of its own: at M <= 16 the GEMM only streams the weight, and
``torch._scaled_mm``'s tiles are sized for large M; the target is >= 75% of copy bandwidth.

How it reads the weight: each program owns BLOCK_N output rows and one K slice. ``USE_DOT``: the product
is computed transposed, ``w_tile [BLOCK_N, BLOCK_K] @ x_tile^T [BLOCK_K, 16]``, so the weight is the MMA's
wide operand and M only pads the narrow one (tensor-core FLOPs are free here, and loads that feed
``tl.dot`` are software-pipelined over ``num_stages``); otherwise (M = 1) a plain multiply and row sum.
Split-K without a second launch, deterministic, with self-resetting counters: plugins/splitk.py.

Interpreter tests run it on fp16/fp32 tensors holding e4m3 values (the notes' rule); on a GPU it reads
float8_e4m3fn. Reference: plugins/reference/gemm.py (fp8_gemm_codes_ref).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import tuning
from . import splitk
from .common import Variant, check, launch
from .splitk import plan_splits, store_split_k

MAX_M = 16                      # rows this kernel takes; larger M is torch._scaled_mm's (or fp8_gemm_kernel's)


@triton.jit
def fp8_gemm_small_m_kernel(out_ptr, x_ptr, w_ptr, ws_ptr, xs_ptr, part_ptr, lock_ptr,
                            M, N, K, k_per_split, num_splits, stride_xm, stride_wn, stride_om,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            USE_DOT: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    nmask = rn < N
    mmask = rm < M
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_wn
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_xm
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)           # transposed: [n, m]
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + rk
        kmask = kk < k_hi
        w = tl.load(w_rows + kk[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
        x = tl.load(x_rows + kk[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        if USE_DOT:
            acc += tl.dot(w, tl.trans(x))                      # fp8 x fp8 -> fp32 on sm_89+
        else:
            # BLOCK_M == 1: a row of products summed along K (CUDA cores)
            acc += tl.sum(w.to(tl.float32) * x.to(tl.float32), axis=1)[:, None]
    scale = tl.load(xs_ptr) * tl.load(ws_ptr + rn, mask=nmask, other=0.0)
    omask = nmask[:, None] & mmask[None, :]
    store_split_k(acc, scale, out_ptr, part_ptr, lock_ptr, rn, rm, omask, stride_om, N, pid_n, pid_k,
                  num_splits, BLOCK_N, BLOCK_M)


def gemm_config(M: int) -> dict:
    """The launch configuration for M rows (plugins.tuning): "fp8_gemv" (CUDA cores, one row) when it
    is enabled and M == 1, else "fp8_small_m" (tensor cores, M padded to 16)."""
    gemv = tuning.get("fp8_gemv")
    if M == 1 and gemv["enabled"]:
        return dict(gemv, block_m=1, use_dot=False)
    return dict(tuning.get("fp8_small_m"), block_m=16, use_dot=True)


def lock_count(N: int) -> int:
    """int32 counters a caller keeps for weights of N output rows (one per N tile of any configuration)."""
    return splitk.lock_count(N, "fp8_gemv", "fp8_small_m")


def fp8_gemm_small_m(xq: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     input_scale: torch.Tensor, out_dtype: torch.dtype, locks: torch.Tensor | None = None,
                     aot=None, split_k: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """xq: [M, K] activation codes, M <= 16, rows contiguous (float8_e4m3fn; fp16/fp32 holding e4m3
    values in the interpreter tests); weight: [N, K] of the same kind, rows contiguous; weight_scale:
    fp32 [N] (or one value); input_scale: fp32 [] or [1]; locks: int32 zeros, >= lock_count(N) entries
    (None: allocated here, zeroed: one extra kernel); split_k: K slices (default: plan_splits); out: an
    [M, N] out_dtype buffer to write (tests poison it). -> [M, N] in out_dtype =
    (xq * input_scale) @ (weight * weight_scale[:, None]).T."""
    check(xq.dim() == 2 and weight.dim() == 2 and weight.shape[1] == xq.shape[1],
          f"fp8_gemm_small_m: xq {tuple(xq.shape)} and weight {tuple(weight.shape)} do not share K")
    M, K = xq.shape
    N = weight.shape[0]
    check(M <= MAX_M, f"fp8_gemm_small_m: {M} rows; allowed: at most {MAX_M} (larger M: torch._scaled_mm)")
    check(xq.stride(1) == 1 and weight.stride(1) == 1, "fp8_gemm_small_m: xq and weight need contiguous rows")
    check(xq.dtype == weight.dtype, f"fp8_gemm_small_m: xq is {xq.dtype}, weight {weight.dtype}; both must be "
          "float8_e4m3fn (or, in interpreter tests, the same float dtype)")
    ws = weight_scale.reshape(-1)
    check(ws.numel() in (1, N), f"fp8_gemm_small_m: weight_scale has {ws.numel()} values; allowed: 1 or {N}")
    if ws.numel() == 1:
        ws = ws.expand(N)
    ws = ws.float().contiguous()
    xs = input_scale.reshape(1).float()
    if out is None:
        out = torch.empty(M, N, dtype=out_dtype, device=xq.device)
    check(out.shape == (M, N) and out.dtype == out_dtype and out.stride(1) == 1,
          f"fp8_gemm_small_m: out must be [{M}, {N}] {out_dtype} with contiguous rows")
    if M == 0 or N == 0:
        return out
    cfg = gemm_config(M)
    splits, per = plan_splits(N, K, cfg, xq.device, split_k)
    n_tiles = triton.cdiv(N, cfg["block_n"])
    if splits > 1:
        if locks is None:
            locks = torch.zeros(n_tiles, dtype=torch.int32, device=xq.device)
        check(locks.dtype == torch.int32 and locks.numel() >= n_tiles,
              f"fp8_gemm_small_m: locks must be int32 with >= {n_tiles} entries")
        part = torch.empty(splits, N, cfg["block_m"], dtype=torch.float32, device=xq.device)
    else:
        part = ws                                    # unused: any fp32 / int32 tensors of the right types
        locks = locks if locks is not None else torch.empty(1, dtype=torch.int32, device=xq.device)
    launch(fp8_gemm_small_m_kernel, (n_tiles, splits),
           (out, xq, weight, ws, xs, part, locks, M, N, K, per, splits, xq.stride(0), weight.stride(0), out.stride(0)),
           _constexprs(cfg), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], aot=aot)
    return out


def _constexprs(cfg: dict) -> dict:
    return dict(BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"], USE_DOT=cfg["use_dot"])


# compiled as multiples of 16 (16-byte vector loads, pipelined K tiles); true of every Llama-family
# hidden/intermediate size, and k_per_split is whole K tiles. A call where one is not runs JIT.
DIVISIBLE = ("K", "k_per_split", "stride_xm", "stride_wn")


def aot_variants(e) -> list[Variant]:
    """FP8 engines: one variant per M class of gemm_config (M = 1, M = 2..16); N, K, the split count
    and the strides are runtime arguments, so every linear of the engine shares them."""
    if e.quant_format != "fp8":
        return []
    types = dict(out_ptr=f"*{e.act}", x_ptr="*fp8e4nv", w_ptr="*fp8e4nv", ws_ptr="*fp32", xs_ptr="*fp32",
                 part_ptr="*fp32", lock_ptr="*i32", M="i32", N="i32", K="i32", k_per_split="i32",
                 num_splits="i32", stride_xm="i32", stride_wn="i32", stride_om="i32")
    out = {}
    for m in (1, MAX_M):
        cfg = gemm_config(m)
        v = Variant(fp8_gemm_small_m_kernel, types, _constexprs(cfg), num_warps=cfg["num_warps"],
                    num_stages=cfg["num_stages"], divisible=DIVISIBLE)
        out.setdefault(v.key, v)
    return list(out.values())
