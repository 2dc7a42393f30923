"""The small-M FP8 GEMM (plugins/gemm_fp8_small.py) against its reference, into poisoned outputs:
M = 1..16, ragged N and K (tails masked), split-K in one launch (the last program of a tile reduces,
in split order, and leaves its counter at 0), both M = 1 paths; FP8Linear picks it for M <= 16 on
the GPU path and torch._scaled_mm above; its AOT variants are planned, launched by key, and compiled
with 16-byte loads. Interpreter: fp16/fp32 tensors holding e4m3 values, and fp8 itself."""
import os
import subprocess
import sys

import pytest
import torch

from backend.ops import linear as linear_mod
from plugins import aot, gemm_fp8_small, registry, splitk, tuning
from plugins.common import EngineShapes
from plugins.gemm_fp8_small import MAX_M, fp8_gemm_small_m, lock_count
from plugins.reference.gemm import fp8_gemm_codes_ref
from tests.kernels.kernel_utils import assert_close, poison

FP8 = torch.float8_e4m3fn
FP8_ENGINE = EngineShapes(act="bf16", kv="fp8e4nv", num_heads=4, num_kv_heads=2, head_dim=32, hidden_size=128,
                          intermediate_size=256, block_size=16, quant_format="fp8", group_size=None, speculative=False)


def _codes(*shape, device, amp):
    # clamp: a CUDA cast beyond e4m3's 448 gives NaN, not the largest finite value
    return (torch.randn(*shape, device=device) * amp).clamp(-448, 448).to(FP8)


def _case(m, n, k, device, storage):
    """fp8 codes, held as `storage` (the interpreter rule: fp16/fp32 holding the e4m3 values)."""
    xq, w = _codes(m, k, device=device, amp=30), _codes(n, k, device=device, amp=100)
    ws = torch.rand(n, device=device) * 0.01 + 1e-3
    xs = torch.tensor(0.02, device=device)
    return xq.to(storage), w.to(storage), ws, xs


STORAGE = [torch.float16, torch.float32, FP8]
OUT = {torch.float16: torch.float16, torch.float32: torch.float32, FP8: torch.bfloat16}


@pytest.mark.parametrize("storage", STORAGE, ids=["fp16", "fp32", "fp8"])
@pytest.mark.parametrize("m,n,k,split_k", [(1, 96, 576, None), (1, 200, 384, 3), (2, 64, 256, 1), (5, 130, 640, 2),
                                           (16, 72, 320, 3), (16, 256, 128, None), (7, 8, 1000, 4)])
def test_matches_reference_into_poisoned_output(device, fresh_seed, storage, m, n, k, split_k):
    xq, w, ws, xs = _case(m, n, k, device, storage)
    out_dtype = OUT[storage]
    locks = torch.zeros(lock_count(n), dtype=torch.int32, device=device)
    out = poison(torch.empty(m, n, dtype=out_dtype, device=device))
    got = fp8_gemm_small_m(xq, w, ws, xs, out_dtype, locks=locks, split_k=split_k, out=out)
    assert got.data_ptr() == out.data_ptr()
    ref = fp8_gemm_codes_ref(xq, w, ws, xs, out_dtype)
    assert_close(got, ref, out_dtype, f"fp8 small-M m={m} n={n} k={k} split={split_k}", fresh_seed)
    assert int(locks.abs().sum()) == 0, "split-K counters must be left at 0 for the next launch"
    again = fp8_gemm_small_m(xq, w, ws, xs, out_dtype, locks=locks, split_k=split_k)
    assert torch.equal(again, got), "same inputs, same bits (the reduction adds splits in a fixed order)"


@pytest.mark.parametrize("storage", [torch.float16, FP8], ids=["fp16", "fp8"])
@pytest.mark.parametrize("split_k", [1, 3])
def test_cuda_core_path_at_one_row(device, fresh_seed, storage, split_k):
    xq, w, ws, xs = _case(1, 100, 704, device, storage)
    with tuning.override("fp8_gemv", enabled=1):
        assert not gemm_fp8_small.gemm_config(1)["use_dot"] and gemm_fp8_small.gemm_config(2)["use_dot"]
        out = poison(torch.empty(1, 100, dtype=OUT[storage], device=device))
        got = fp8_gemm_small_m(xq, w, ws, xs, OUT[storage], split_k=split_k, out=out)
    assert_close(got, fp8_gemm_codes_ref(xq, w, ws, xs, OUT[storage]), OUT[storage], "fp8 gemv", fresh_seed)


def test_per_tensor_weight_scale_and_empty_inputs(device, fresh_seed):
    xq, w, _, xs = _case(3, 40, 128, device, torch.float32)
    ws = torch.tensor(0.004, device=device)
    assert_close(fp8_gemm_small_m(xq, w, ws, xs, torch.float32), fp8_gemm_codes_ref(xq, w, ws, xs, torch.float32),
                 torch.float32, "per-tensor weight scale", fresh_seed)
    assert fp8_gemm_small_m(xq[:0], w, ws, xs, torch.float32).shape == (0, 40)


def test_split_plan_fills_the_gpu_in_whole_k_tiles():
    cfg = dict(tuning.get("fp8_small_m"), block_m=16, use_dot=True, block_k=128, block_n=64, programs_per_sm=2,
               max_splits=8)
    cuda = torch.device("cuda")
    splitk._SMS[0] = 132
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(torch.cuda, "current_device", lambda: 0)
            # 4096 x 4096: 64 N tiles -> 5 K slices of 7 tiles (320 programs for 264 slots)
            assert gemm_fp8_small.plan_splits(4096, 4096, cfg, cuda) == (5, 896)
            # gate/up 28672 rows: 448 N tiles already fill 132 SMs twice: no split
            assert gemm_fp8_small.plan_splits(28672, 4096, cfg, cuda) == (1, 4096)
            # the cap, and a K of fewer tiles than the wanted splits
            assert gemm_fp8_small.plan_splits(64, 4096, cfg, cuda)[0] == 8
            assert gemm_fp8_small.plan_splits(64, 200, cfg, cuda) == (2, 128)
    finally:
        splitk._SMS.pop(0, None)


def test_refusals_name_the_problem(device):
    xq, w, ws, xs = _case(MAX_M + 1, 32, 64, device, torch.float32)
    with pytest.raises(ValueError, match="17 rows; allowed: at most 16"):
        fp8_gemm_small_m(xq, w, ws, xs, torch.float32)
    with pytest.raises(ValueError, match="do not share K"):
        fp8_gemm_small_m(xq[:2, :32], w, ws, xs, torch.float32)
    with pytest.raises(ValueError, match="both must be"):
        fp8_gemm_small_m(xq[:2].half(), w, ws, xs, torch.float32)
    with pytest.raises(ValueError, match="weight_scale has 3 values"):
        fp8_gemm_small_m(xq[:2], w, ws[:3], xs, torch.float32)
    xq, w, ws, xs = _case(2, 32, 512, device, torch.float32)
    with pytest.raises(ValueError, match="locks must be int32"):
        fp8_gemm_small_m(xq, w, ws, xs, torch.float32, locks=torch.zeros(1, dtype=torch.int64, device=device),
                         split_k=2)


def test_registry_kinds_agree(device, fresh_seed):
    xq, w, ws, xs = _case(4, 64, 256, device, torch.float16)
    a = registry.get("fp8_gemm_small_m", device, torch.float16, kind="triton")(xq, w, ws, xs, torch.float16)
    b = registry.get("fp8_gemm_small_m", device, torch.float16, kind="torch")(xq, w, ws, xs, torch.float16)
    assert_close(a, b, torch.float16, "registry kinds", fresh_seed)


def test_fp8_linear_picks_the_kernel_by_rows(device, fresh_seed, monkeypatch):
    """The GPU path (emulated: _scaled_mm runs on CPU too): M <= 16 -> the Triton kernel, M > 16 ->
    torch._scaled_mm; both equal the reference, and the kernel is what ran for the small M."""
    monkeypatch.setattr(linear_mod, "has_fp8_matmul", lambda dev: True)
    monkeypatch.setattr(linear_mod, "small_m_kernel", lambda dev: True)
    n, k = 96, 256
    t = {"weight": _codes(n, k, device=device, amp=100), "weight_scale": torch.rand(n, device=device) * 0.01,
         "input_scale": torch.tensor(0.02, device=device)}
    lin = linear_mod.make_linear("fp8", t, torch.bfloat16, device)
    assert lin.native and lin.small_m is not None and lin._locks.numel() >= lock_count(n)
    calls = []
    kernel = lin.small_m
    lin.small_m = lambda *a, **kw: calls.append(a[0].shape[0]) or kernel(*a, **kw)
    for m in (1, 16, 17):
        xq = _codes(m, k, device=device, amp=30)
        got = lin.forward_fp8(xq)
        ref = fp8_gemm_codes_ref(xq, t["weight"], t["weight_scale"], t["input_scale"], torch.bfloat16)
        assert_close(got, ref, torch.bfloat16, f"FP8Linear m={m}", fresh_seed)
    assert calls == [1, 16]


def test_fp8_linear_cpu_path_is_unchanged(device):
    t = {"weight": _codes(32, 64, device="cpu", amp=100), "weight_scale": torch.rand(32),
         "input_scale": torch.tensor(0.02)}
    lin = linear_mod.make_linear("fp8", t, torch.float32, "cpu")
    assert not lin.native and getattr(lin, "small_m", None) is None


class _Recorder:
    """Stands in for a KernelSet: records the variant keys asked for, launches nothing (-> JIT)."""

    def __init__(self):
        self.keys = set()

    def launch(self, key, grid, args):
        self.keys.add(key)
        return False


def test_aot_plan_covers_every_launched_variant(device):
    planned = {v.key for v in aot.plan(FP8_ENGINE) if v.fn is gemm_fp8_small.fp8_gemm_small_m_kernel}
    assert planned and {v.key for v in aot.plan(FP8_ENGINE)} >= planned
    assert not any(v.fn is gemm_fp8_small.fp8_gemm_small_m_kernel
                   for v in aot.plan(EngineShapes(**{**FP8_ENGINE.__dict__, "quant_format": "nvfp4"})))
    rec = _Recorder()
    for m in (1, 2, 9, 16):
        xq, w, ws, xs = _case(m, 64, 256, device, FP8)
        for split in (1, 2):
            fp8_gemm_small_m(xq, w, ws, xs, torch.bfloat16, aot=rec, split_k=split)
    assert rec.keys and rec.keys <= planned, rec.keys - planned
    for v in aot.plan(FP8_ENGINE):
        if v.fn is gemm_fp8_small.fp8_gemm_small_m_kernel:
            assert set(v.divisible) == {"K", "k_per_split", "stride_xm", "stride_wn"}


_COMPILE_CHILD = r"""
import json, re
from plugins import aot, gemm_fp8_small
from plugins.common import EngineShapes
e = EngineShapes(**json.loads(__import__("sys").argv[1]))
res = []
for v in aot.plan(e):
    if v.fn is gemm_fp8_small.fp8_gemm_small_m_kernel:
        k, meta = aot.compile_variant(v, 90)
        ptx = k.asm["ptx"]
        res.append({"key": v.key, "divisible": meta["divisible"], "v4": "ld.global.v4" in ptx or "cp.async" in ptx,
                    "byte_loads": bool(re.search(r"ld\.global(\.\w+)*\.b8", ptx)), "wgmma": "wgmma" in ptx,
                    "use_dot": v.constexprs["USE_DOT"], "pipelined": "cp.async" in ptx})
print(json.dumps(res))
"""


def test_aot_variants_compile_with_wide_loads():
    """sm_90 cubins, no GPU: the integer arguments compiled as multiples of 16 give 16-byte weight loads
    (byte loads otherwise) and, on the tensor-core path, K tiles pipelined through shared memory."""
    import dataclasses
    import json
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE_CHILD, json.dumps(dataclasses.asdict(FP8_ENGINE))],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res, "no fp8 small-M variant planned"
    for r in res:
        assert r["divisible"] and r["v4"] and not r["byte_loads"], r
        if r["use_dot"]:
            assert r["wgmma"] and r["pipelined"], r
