"""Launch configurations of the kernels on NVIDIA GPUs, in one table: tile sizes, warps, pipeline
stages and split counts. The kernel wrappers launch with these values and plugins.aot compiles exactly
these variants into a bundle, so changing a value here changes both (bundles built before then fall
back to JIT for that kernel, with a warning, until rebuilt).

Values come from `make bench-kernels BENCH_ARGS=--sweep` on an NVIDIA H200 (docs/perf/kernels-h200.json,
"sweep"): each entry says which measured configuration won. The Triton interpreter (CPU tests) uses its
own, smaller tiles where the wrappers say so: there every program costs Python time.
"""
from __future__ import annotations

import copy
from contextlib import contextmanager

GPU: dict[str, dict[str, int]] = {
    # one program per (sequence, KV head, split); splits fill programs_per_sm x SMs programs.
    # H200 sweep (2026-11-26, b64 ctx2048, Llama-3.1-8B heads): 0.176 ms vs 0.186 ms with 4 per SM
    # split_programs_per_sm: when the batch leaves SMs idle (batch x KV heads < programs_per_sm x SMs: small
    # batch, long context) the sequence is split to reach this many programs per SM, up to
    # paged_decode.MAX_SPLITS. NOT yet measured (4 is a starting point for the sweep's candidates 2/4/8 at
    # b1 ctx8192); batch 64 at ctx 2048 is unsplit either way.
    # heads_first: launch order (KV head, sequence) instead of (sequence, KV head); NOT yet measured
    "paged_decode": {"tile": 64, "num_warps": 4, "num_stages": 3, "programs_per_sm": 2, "split_programs_per_sm": 4,
                     "heads_first": 0},
    # fp8 KV, H100 sweep (2026-11-27, docs/perf/decode-attention-h100.json): dot_f16 (fp16 dots under bf16
    # activations: one conversion per two e4m3 codes instead of three), v_u16 (V read as 16-bit words: no
    # byte-wise transpose in shared memory) and heads_first (KV heads of a sequence adjacent in launch
    # order) together, tile 128 and 3 stages: b512 ctx1536 (a 1000/1000 throughput run's step) 0.575 ms
    # per call = 95% of copy bandwidth, was 0.734 ms (75%); b64 ctx2048 78% (was 61%); b1 ctx8192 33% (31%).
    # Tile 64 / 2 stages gives b64 85% but b512 92%: the throughput shape decides
    "paged_decode_fp8": {"tile": 128, "num_warps": 4, "num_stages": 3, "programs_per_sm": 2,
                         "split_programs_per_sm": 4, "heads_first": 1, "dot_f16": 1, "v_u16": 1},
    # rows = query tokens x padded GQA group per program; tile_n = keys per inner step (0.702 vs 0.738 ms)
    "paged_prefill": {"rows": 128, "tile_n": 64, "num_warps": 4, "num_stages": 3},
    # W4A16 GEMM for decode-sized M (<= 16): plugins/gemm_w4a16_small.py, the weight as the MMA's wide
    # operand (M padded to 16), split-K in the launch filling programs_per_sm x SMs programs, at most
    # max_splits K slices. NOT yet measured on a GPU: starting points for the sweep (w4a16_small_m). The
    # kernel it replaces for M <= 16 (gemm_w4a16.py, block_m 16, block_n 64, block_k 128, split_k 4) ran
    # M=1 4096x4096 in 0.084 ms int4 / 0.121 ms nvfp4 on the H200: the numbers to beat
    "w4a16_small_m": {"block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 4, "programs_per_sm": 2,
                      "max_splits": 8},
    # the same at M == 1 on CUDA cores with per-group sums (one scale multiply per group) when enabled
    "w4a16_gemv": {"enabled": 0, "block_n": 16, "block_k": 256, "num_warps": 4, "num_stages": 3, "programs_per_sm": 4,
                   "max_splits": 8},
    # W4A16 GEMM for M > 16 (plugins/gemm_w4a16.py); split_k > 1 sums fp32 partials. 64-wide tiles. 128x128 tiles won for int4 at M=256 (0.255 vs 0.293 ms) but doubled NVFP4's
    # time and need 240 KB of shared memory with fp32 activations (over the H200's 227 KB)
    "w4a16_large": {"block_m": 64, "block_n": 64, "block_k": 64, "num_warps": 4, "num_stages": 3, "split_k": 1},
    # FP8 GEMM for M <= 16 (plugins/gemm_fp8_small.py), tensor cores with M padded to 16; split-K in the
    # launch fills programs_per_sm x SMs programs, at most max_splits K slices. NOT yet measured on a GPU:
    # starting points for `make bench-kernels BENCH_ARGS=--sweep` (sweep entry fp8_small_m)
    "fp8_small_m": {"block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 4, "programs_per_sm": 2,
                    "max_splits": 8},
    # the same at M == 1 on CUDA cores (a row of products and a sum) when enabled: the sweep compares both
    # fused MoE (plugins/fused_moe.py): the grouped gate/up and down GEMMs' row block (slots of one expert),
    # N and K tiles. "moe_decode" (block_m 16) runs when the slots per expert average below
    # decode_below_slots_per_expert, so a decode step's experts are padded to 16 rows, not 64. NOT yet
    # measured on a GPU: starting points (vLLM's defaults are of this size) for a sweep
    "moe": {"block_m": 64, "block_n": 64, "block_k": 64, "num_warps": 4, "num_stages": 3,
            "decode_below_slots_per_expert": 16},
    "moe_decode": {"block_m": 16, "block_n": 64, "block_k": 64, "num_warps": 4, "num_stages": 3},
    "fp8_gemv": {"enabled": 0, "block_n": 16, "block_k": 512, "num_warps": 4, "num_stages": 3, "programs_per_sm": 4,
                 "max_splits": 8},
}


def apply_env(env: dict | None = None) -> None:
    """KILN_TUNING='{"paged_decode_fp8": {"dot_f16": 1}}' replaces table values for this process: how a
    benchmark on a lent GPU runs a sweep's winner without editing this file (a bundle compiles what is
    in effect when it is built). Unknown kernels or keys are refused, naming the allowed ones."""
    import json
    import os
    text = (os.environ if env is None else env).get("KILN_TUNING", "").strip()
    if not text:
        return
    try:
        values = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"KILN_TUNING: not JSON ({exc})") from None
    if not isinstance(values, dict):
        raise ValueError("KILN_TUNING: expected a JSON object {kernel: {key: value}}")
    for name, vals in values.items():
        if name not in GPU:
            raise ValueError(f"KILN_TUNING: no kernel {name!r}; allowed: {', '.join(GPU)}")
        unknown = set(vals) - set(GPU[name]) if isinstance(vals, dict) else {"(not an object)"}
        if unknown:
            raise ValueError(f"KILN_TUNING: {name} has no {', '.join(sorted(unknown))}; allowed: {', '.join(GPU[name])}")
        GPU[name].update({k: int(v) for k, v in vals.items()})


apply_env()


def get(name: str) -> dict[str, int]:
    return GPU[name]


@contextmanager
def override(name: str, **values):
    """Temporarily launch kernel `name` with other values (the benchmark's sweep)."""
    unknown = set(values) - set(GPU[name])
    if unknown:
        raise KeyError(f"plugins.tuning: {name} has no {', '.join(sorted(unknown))}; allowed: {', '.join(GPU[name])}")
    saved = copy.deepcopy(GPU[name])
    GPU[name].update(values)
    try:
        yield
    finally:
        GPU[name] = saved
