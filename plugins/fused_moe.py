"""Triton kernel: a fused mixture-of-experts MLP (SwiGLU experts) as two grouped GEMMs over experts.

1. moe_align (plugins/moe_align.py) groups the T * k token slots by expert, each expert padded to a
   multiple of BLOCK_M, so every row block of the GEMMs below reads one expert's weights.
2. moe_gemm_kernel, GATED: per (row block, N tile of I) it gathers the block's tokens' rows of x, runs
   the gate and the up GEMM against the block's expert and writes silu(gate) * up to the slot's row of
   an intermediate [T * k, I] in x.dtype (the activation fused: gate/up never reach memory).
3. moe_gemm_kernel, not GATED: per (row block, N tile of H) the down GEMM of those rows, times the slot's
   routing weight (fused), into fp32 [T * k, H]; then one reduction over k (torch's sum of a [T, k, H]
   view, fp32) to [T, H].
The grid is sized from the host-side bound of the padded count (moe_align.max_padded): programs past the
true count (on the device, never read back) return before loading anything, and an expert with no slot
has no block at all. Decode (few slots over many experts) uses the small row block of the tuning table
("moe_decode", 16) so an expert with one slot computes 16 rows, not 64.

Weights: gate_up [E, 2I, H] (gate rows, then up rows) and down [E, H, I] in x.dtype, or float8_e4m3fn
codes with one fp32 scale per expert (FP8_W: converted to x.dtype in registers, the scale applied to the
accumulator once: W8A16). Reference: plugins/reference/moe.py.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import tuning
from .common import Variant, check, divisible_args, launch
from .moe_align import max_padded, moe_align


@triton.jit
def moe_gemm_kernel(out_ptr, a_ptr, w_ptr, ws_ptr, tw_ptr, sorted_ptr, expert_ptr, npad_ptr,
                    num_slots, a_div, N, K, stride_am, stride_we, stride_wn, stride_om,
                    GATED: tl.constexpr, FP8_W: tl.constexpr, DOT_F32: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(npad_ptr):
        return   # past the padded count: the grid is its host-side bound
    slot = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = slot < num_slots                        # padding slots hold num_slots
    arow = (slot // a_div).to(tl.int64)             # GATED: the slot's token (x row); else the slot itself
    expert = tl.load(expert_ptr + pid_m).to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn < N
    rk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + expert * stride_we + rn[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        kmask = kk < K
        a = tl.load(a_ptr + arow[:, None] * stride_am + kk[None, :], mask=valid[:, None] & kmask[None, :], other=0.0)
        wmask = nmask[:, None] & kmask[None, :]
        w = tl.load(w_rows + kk[None, :], mask=wmask, other=0.0)
        if DOT_F32:     # the interpreter's bf16 tl.dot (and e4m3 -> bf16 cast) is wrong: CPU tests only
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        elif FP8_W:
            w = w.to(a.dtype)
        acc += tl.dot(a, tl.trans(w))
        if GATED:       # the up row of output n is row N + n of the expert's gate_up
            u = tl.load(w_rows + N * stride_wn + kk[None, :], mask=wmask, other=0.0)
            if DOT_F32:
                u = u.to(tl.float32)
            elif FP8_W:
                u = u.to(a.dtype)
            acc_up += tl.dot(a, tl.trans(u))
    if FP8_W:
        scale = tl.load(ws_ptr + expert)
        acc = acc * scale
        acc_up = acc_up * scale
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up   # silu(gate) * up in fp32, rounded once at the store
    else:
        acc = acc * tl.load(tw_ptr + slot, mask=valid, other=0.0)[:, None]
    tl.store(out_ptr + slot[:, None].to(tl.int64) * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & nmask[None, :])


def moe_config(num_slots: int, num_experts: int) -> dict:
    """The tuning table's "moe_decode" (small row block) when experts get few slots on average (decode:
    a block of 64 would be mostly padding), else "moe"."""
    big = tuning.get("moe")
    return tuning.get("moe_decode") if num_slots < big["decode_below_slots_per_expert"] * num_experts else big


def _dot_f32(x: torch.Tensor) -> bool:
    return x.dtype == torch.bfloat16 and not x.is_cuda and os.environ.get("TRITON_INTERPRET") == "1"


def fused_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, gate_up: torch.Tensor,
              down: torch.Tensor, gate_up_scale: torch.Tensor | None = None, down_scale: torch.Tensor | None = None,
              aot=None, block_m: int | None = None, out: torch.Tensor | None = None,
              scratch: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """x [T, H] fp16/bf16/fp32; topk_ids int [T, k]; topk_weights [T, k]; gate_up [E, 2I, H]; down [E, H, I]
    (x.dtype, or float8_e4m3fn with fp32 [E] gate_up_scale / down_scale); block_m: the row block (default:
    moe_config); out: [T, H] x.dtype to write into; scratch: (x.dtype [T * k, I], fp32 [T * k, H]) buffers
    for the intermediate and the weighted down rows (a caller's, kept across steps; None: allocated).
    -> out, [T, H] in x.dtype. Layouts: plugins/reference/moe.py."""
    check(x.dim() == 2 and topk_ids.dim() == 2 and topk_ids.shape == topk_weights.shape
          and topk_ids.shape[0] == x.shape[0], f"fused_moe: x {tuple(x.shape)}, topk_ids {tuple(topk_ids.shape)} "
          f"and topk_weights {tuple(topk_weights.shape)} do not agree on T")
    T, H = x.shape
    k = topk_ids.shape[1]
    E, I2, Hw = gate_up.shape
    inter = I2 // 2
    check(Hw == H and I2 % 2 == 0 and down.shape == (E, H, inter),
          f"fused_moe: gate_up {tuple(gate_up.shape)} and down {tuple(down.shape)} are not [E, 2I, {H}] and "
          f"[E, {H}, I]")
    fp8 = gate_up.dtype == torch.float8_e4m3fn
    check(down.dtype == gate_up.dtype and (gate_up.dtype == x.dtype or fp8),
          f"fused_moe: weights {gate_up.dtype}/{down.dtype}; allowed: {x.dtype} or float8_e4m3fn (both)")
    check(not fp8 or (gate_up_scale is not None and down_scale is not None and gate_up_scale.numel() == E
                      and down_scale.numel() == E), "fused_moe: float8_e4m3fn weights need fp32 [E] scales")
    n = T * k
    if out is None:
        out = torch.empty(T, H, dtype=x.dtype, device=x.device)
    check(out.shape == (T, H) and out.dtype == x.dtype and out.is_contiguous(),
          f"fused_moe: out must be contiguous {x.dtype} [{T}, {H}]")
    if n == 0 or H == 0:
        return out.zero_()
    cfg = dict(moe_config(n, E))
    if block_m:
        cfg["block_m"] = block_m
    bm = cfg["block_m"]
    sorted_ids, expert_ids, npad = moe_align(topk_ids, E, bm)
    blocks = max_padded(n, E, bm) // bm
    x, gate_up, down = x.contiguous(), gate_up.contiguous(), down.contiguous()
    tw = topk_weights.reshape(-1).float().contiguous()
    gus = gate_up_scale.reshape(-1).float().contiguous() if fp8 else tw   # tw: unread stand-in
    ds = down_scale.reshape(-1).float().contiguous() if fp8 else tw
    if scratch is None:
        scratch = (torch.empty(n, inter, dtype=x.dtype, device=x.device),
                   torch.empty(n, H, dtype=torch.float32, device=x.device))
    h, y = scratch
    check(h.shape == (n, inter) and h.dtype == x.dtype and y.shape == (n, H) and y.dtype == torch.float32
          and h.stride(1) == 1 and y.is_contiguous(),
          f"fused_moe: scratch must be ({x.dtype} [{n}, {inter}] rows contiguous, contiguous fp32 [{n}, {H}])")
    consts = dict(FP8_W=fp8, DOT_F32=_dot_f32(x), BLOCK_M=bm, BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"])
    warps, stages = cfg["num_warps"], cfg["num_stages"]
    launch(moe_gemm_kernel, (blocks, triton.cdiv(inter, cfg["block_n"])),
           (h, x, gate_up, gus, tw, sorted_ids, expert_ids, npad, n, k, inter, H, x.stride(0), gate_up.stride(0),
            gate_up.stride(1), h.stride(0)), dict(GATED=True, **consts), warps, stages, aot=aot)
    launch(moe_gemm_kernel, (blocks, triton.cdiv(H, cfg["block_n"])),
           (y, h, down, ds, tw, sorted_ids, expert_ids, npad, n, 1, H, inter, h.stride(0), down.stride(0),
            down.stride(1), y.stride(0)), dict(GATED=False, **consts), warps, stages, aot=aot)
    # the top-k weighted sum: one reduction over k, in fp32 (the weights were applied in the down GEMM)
    if x.dtype == torch.float32:
        return torch.sum(y.view(T, k, H), dim=1, out=out)
    return out.copy_(y.view(T, k, H).sum(1))


def aot_variants(e) -> list[Variant]:
    """Both GEMMs at both row blocks, for an engine with experts (EngineShapes.num_experts > 0); the
    experts are fp8 in an fp8 engine, else in the activation dtype."""
    if not e.num_experts:
        return []
    wt = "fp8e4nv" if e.quant_format == "fp8" else e.act
    # N, K and the row strides are H or I (x, h, the weights' rows; y's rows are H), an expert's stride
    # 2I x H or H x I: compiled as multiples of 16 where the shapes make them so
    dims = {e.hidden_size, e.moe_intermediate_size}
    div = divisible_args({"N": dims, "K": dims, "stride_am": dims, "stride_wn": dims, "stride_om": dims,
                          "stride_we": {2 * e.moe_intermediate_size * e.hidden_size}})
    out = []
    for cfg in (tuning.get("moe"), tuning.get("moe_decode")):
        for gated in (True, False):
            types = dict(out_ptr=f"*{e.act}" if gated else "*fp32", a_ptr=f"*{e.act}", w_ptr=f"*{wt}", ws_ptr="*fp32",
                         tw_ptr="*fp32", sorted_ptr="*i32", expert_ptr="*i32", npad_ptr="*i32", num_slots="i32",
                         a_div="i32", N="i32", K="i32", stride_am="i32", stride_we="i32", stride_wn="i32",
                         stride_om="i32")
            consts = dict(GATED=gated, FP8_W=wt == "fp8e4nv", DOT_F32=False, BLOCK_M=cfg["block_m"],
                          BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"])
            out.append(Variant(moe_gemm_kernel, types, consts, cfg["num_warps"], cfg["num_stages"], divisible=div))
    return out

