"""Split-K for the small-M GEMMs (``gemm_fp8_small``, ``gemm_w4a16_small``): the plan and the epilogue.

At decode-sized M a GEMM only streams its weight, and the N tiles alone leave SMs idle for square
weights, so K is split into slices as well. Both kernels finish in ONE launch: each program stores its
fp32 partial rows, and the last program of an N tile to arrive (an atomic counter per tile) adds the
partials in split order (deterministic) and writes the output, then resets its counter to 0, so the
counters (``locks``, int32 zeros owned by the caller, e.g. one per linear) are ready for the next launch,
also inside a CUDA graph.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import tuning

INTERPRETER_PROGRAMS = 8        # split-K target under the interpreter (no SMs to fill there)
_SMS: dict[int, int] = {}       # device index -> SM count (queried once)


def target_programs(device: torch.device, per_sm: int) -> int:
    """Programs that fill the GPU (``per_sm`` per SM); a fixed small number under the interpreter."""
    if device.type != "cuda":
        return INTERPRETER_PROGRAMS
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return per_sm * _SMS[idx]


def plan_splits(N: int, K: int, cfg: dict, device: torch.device, split_k: int | None = None) -> tuple[int, int]:
    """-> (num_splits, k_per_split): enough (N tile, K slice) programs to fill the GPU, whole K tiles per
    slice, at most ``cfg["max_splits"]`` (each split adds M x N fp32 partials written and read back:
    small next to the weight's bytes at M <= 16)."""
    bk = cfg["block_k"]
    k_tiles = triton.cdiv(K, bk)
    if split_k is None:
        n_tiles = triton.cdiv(N, cfg["block_n"])
        split_k = min(triton.cdiv(target_programs(device, cfg["programs_per_sm"]), n_tiles), cfg["max_splits"])
    splits = max(1, min(split_k, k_tiles))
    per = triton.cdiv(k_tiles, splits) * bk
    return triton.cdiv(K, per), per


def lock_count(N: int, *tunings: str) -> int:
    """int32 counters a caller keeps for weights of N output rows: one per N tile of any of the named
    ``plugins.tuning`` configurations."""
    return triton.cdiv(N, min(tuning.get(name)["block_n"] for name in tunings))


@triton.jit
def store_split_k(acc, scale, out_ptr, part_ptr, lock_ptr, rn, rm, omask, stride_om, N, pid_n, pid_k,
                  num_splits, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """Write ``acc [BLOCK_N, BLOCK_M]`` (the transposed output tile: rows ``rn``, columns ``rm``) times
    ``scale [BLOCK_N]``: directly with one split, else through the partials [num_splits, N, BLOCK_M]
    fp32 and the tile's counter (module docstring). Only the M real rows are written and read back."""
    optrs = out_ptr + rm[None, :].to(tl.int64) * stride_om + rn[:, None]
    if num_splits == 1:
        tl.store(optrs, (acc * scale[:, None]).to(out_ptr.dtype.element_ty), mask=omask)
    else:
        pofs = rn[:, None].to(tl.int64) * BLOCK_M + rm[None, :]
        tl.store(part_ptr + pid_k.to(tl.int64) * N * BLOCK_M + pofs, acc, mask=omask)
        tl.debug_barrier()                                     # every thread's partial is stored ...
        arrived = tl.atomic_add(lock_ptr + pid_n, 1, sem="acq_rel")   # ... before this release
        if arrived == num_splits - 1:
            total = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            for s in range(0, num_splits):
                total += tl.load(part_ptr + s * N * BLOCK_M + pofs, mask=omask, other=0.0, cache_modifier=".cg")
            tl.store(optrs, (total * scale[:, None]).to(out_ptr.dtype.element_ty), mask=omask)
            tl.atomic_xchg(lock_ptr + pid_n, 0, sem="relaxed")
