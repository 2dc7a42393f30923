"""The small-M W4A16 GEMM (plugins/gemm_w4a16_small.py) against the references, into poisoned outputs:
NVFP4 and INT4-AWQ at M = 1, 3, 16, ragged N and K (tails masked), every scale mode (per tile, per
element, per group on the CUDA-core path), split-K in one launch (counters left at 0, same bits twice);
w4a16_linear picks it for M <= 16; its AOT variants are planned, launched by key, compiled with the
16-byte hints the engine's shapes guarantee, and refused (-> JIT) by the launcher when a call breaks them."""
import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from plugins import aot, gemm_w4a16, gemm_w4a16_small as small, splitk, tuning, w4a16_codes
from plugins.common import EngineShapes
from plugins.gemm_w4a16 import w4a16_linear
from plugins.gemm_w4a16_small import MAX_M, lock_count, w4a16_small_m
from plugins.reference.gemm import int4_awq_linear_ref, nvfp4_linear_ref
from tests.kernels.kernel_utils import assert_close, poison

LLAMA8B_NVFP4 = EngineShapes(act="bf16", kv="fp8e4nv", num_heads=32, num_kv_heads=8, head_dim=128, hidden_size=4096,
                             intermediate_size=14336, block_size=16, quant_format="nvfp4", group_size=None,
                             speculative=False)
SMOL_INT4 = EngineShapes(act="bf16", kv="bf16", num_heads=9, num_kv_heads=3, head_dim=64, hidden_size=576,
                         intermediate_size=1536, block_size=16, quant_format="int4_awq", group_size=64,
                         speculative=False)


def _weights(fmt, n, k, group, dtype, device):
    w = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device)
    if fmt == "nvfp4":
        ws = (torch.rand(n, k // 16, device=device) * 2 + 0.1).to(torch.float8_e4m3fn)
        return w, ws, torch.tensor(0.01, device=device)
    return w, (torch.rand(n, k // group, device=device) * 0.02 + 0.001).to(dtype), None


def _ref(fmt, x, w, ws, ws2):
    return nvfp4_linear_ref(x, w, ws, ws2) if fmt == "nvfp4" else int4_awq_linear_ref(x, w, ws)


CASES = [  # (fmt, m, n, k, group, split_k)
    ("nvfp4", 1, 96, 576, 16, None),       # K tail (576 = 4.5 tiles of 128)
    ("nvfp4", 3, 130, 512, 16, 3),         # ragged N
    ("nvfp4", 16, 64, 256, 16, 1),
    ("int4_awq", 1, 72, 512, 128, None),   # group = tile: one scale per row per tile
    ("int4_awq", 3, 64, 768, 256, 2),      # group of two tiles
    ("int4_awq", 16, 100, 576, 32, 3),     # groups narrower than the tile: per element; K tail
    ("int4_awq", 3, 40, 576, 64, None),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("fmt,m,n,k,group,split_k", CASES)
def test_matches_reference_into_poisoned_output(device, fresh_seed, dtype, fmt, m, n, k, group, split_k):
    x = torch.randn(m, k, device=device).to(dtype)
    w, ws, ws2 = _weights(fmt, n, k, group, dtype, device)
    locks = torch.zeros(lock_count(n), dtype=torch.int32, device=device)
    out = poison(torch.empty(m, n, dtype=dtype, device=device))
    got = w4a16_small_m(x, fmt, w, ws, ws2, locks=locks, split_k=split_k, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert_close(got, _ref(fmt, x, w, ws, ws2), dtype, f"{fmt} m={m} n={n} k={k} g={group} split={split_k}",
                 fresh_seed)
    assert int(locks.abs().sum()) == 0, "split-K counters must be left at 0 for the next launch"
    again = w4a16_small_m(x, fmt, w, ws, ws2, locks=locks, split_k=split_k)
    assert torch.equal(again, got), "same inputs, same bits (the reduction adds splits in a fixed order)"


@pytest.mark.parametrize("fmt,k,group", [("nvfp4", 768, 16), ("int4_awq", 640, 128), ("int4_awq", 512, 32)])
@pytest.mark.parametrize("split_k", [1, 3])
def test_cuda_core_path_scales_each_group_once(device, fresh_seed, fmt, k, group, split_k):
    x = torch.randn(1, k, device=device).half()
    w, ws, ws2 = _weights(fmt, 100, k, group, torch.float16, device)
    with tuning.override("w4a16_gemv", enabled=1):
        cfg = small.gemm_config(1)
        assert not cfg["use_dot"] and small.gemm_config(2)["use_dot"]
        assert small.scale_mode(w4a16_codes.FORMATS[fmt], group, cfg) == small.SCALE_GROUP
        out = poison(torch.empty(1, 100, dtype=torch.float16, device=device))
        got = w4a16_small_m(x, fmt, w, ws, ws2, split_k=split_k, out=out)
    assert_close(got, _ref(fmt, x, w, ws, ws2), torch.float16, f"{fmt} gemv g={group}", fresh_seed)


def test_scale_modes():
    dot = small.gemm_config(4)
    assert small.scale_mode(w4a16_codes.FMT_INT4_AWQ, 128, dot) == small.SCALE_TILE
    assert small.scale_mode(w4a16_codes.FMT_INT4_AWQ, 32, dot) == small.SCALE_ELEMENT
    assert small.scale_mode(w4a16_codes.FMT_NVFP4, 16, dot) == small.SCALE_ELEMENT


def test_w4a16_linear_picks_the_kernel_by_rows(device, fresh_seed, monkeypatch):
    """M <= 16 -> the small-M kernel (one launch), M > 16 -> gemm_w4a16's tiles; both equal the reference."""
    calls = []
    kernel = small.w4a16_small_m
    monkeypatch.setattr(small, "w4a16_small_m", lambda x, *a, **kw: calls.append(x.shape[0]) or kernel(x, *a, **kw))
    w, ws, ws2 = _weights("nvfp4", 64, 256, 16, torch.float16, device)
    for m in (1, 3, 16, 17):
        x = torch.randn(m, 256, device=device).half()
        assert_close(w4a16_linear(x, "nvfp4", w, ws, ws2), nvfp4_linear_ref(x, w, ws, ws2), torch.float16,
                     f"w4a16_linear m={m}", fresh_seed)
    assert calls == [1, 3, 16]


def test_split_plan_fills_the_gpu_in_whole_k_tiles(monkeypatch):
    cfg = dict(tuning.get("w4a16_small_m"), block_m=16, use_dot=True, block_k=128, block_n=64, programs_per_sm=2,
               max_splits=8)
    monkeypatch.setattr(splitk, "target_programs", lambda dev, per_sm: per_sm * 132)
    cuda = torch.device("cuda")
    assert small.plan_splits(4096, 4096, cfg, cuda) == (5, 896)     # 64 N tiles x 5 slices for 264 slots
    assert small.plan_splits(28672, 4096, cfg, cuda) == (1, 4096)   # gate/up: N tiles alone fill the GPU
    assert small.plan_splits(64, 4096, cfg, cuda)[0] == 8           # the cap
    assert small.plan_splits(64, 200, cfg, cuda) == (2, 128)        # fewer K tiles than wanted


def test_refusals_name_the_problem(device):
    x = torch.zeros(MAX_M + 1, 64, device=device)
    w, ws, ws2 = _weights("nvfp4", 8, 64, 16, torch.float32, device)
    with pytest.raises(ValueError, match="17 rows; allowed: at most 16"):
        w4a16_small_m(x, "nvfp4", w, ws, ws2)
    with pytest.raises(ValueError, match="format 'int8'"):
        w4a16_small_m(x[:2], "int8", w, ws, ws2)
    with pytest.raises(ValueError, match="nvfp4 needs"):
        w4a16_small_m(x[:2], "nvfp4", w, ws.float(), ws2)
    with pytest.raises(ValueError, match=r"weight must be uint8 \[N, 32\]"):
        w4a16_small_m(x[:2], "int4_awq", w[:, :16], torch.ones(8, 1, device=device))
    w, ws, ws2 = _weights("nvfp4", 8, 512, 16, torch.float32, device)
    with pytest.raises(ValueError, match="locks must be int32"):
        w4a16_small_m(torch.zeros(2, 512, device=device), "nvfp4", w, ws, ws2, split_k=2,
                      locks=torch.zeros(4, dtype=torch.int64, device=device))


class _Recorder:
    """Stands in for a KernelSet: records the variant keys asked for, launches nothing (-> JIT)."""

    def __init__(self):
        self.keys = set()

    def launch(self, key, grid, args):
        self.keys.add(key)
        return False


@pytest.mark.parametrize("engine", [LLAMA8B_NVFP4, SMOL_INT4], ids=["nvfp4", "int4"])
def test_aot_plan_covers_every_launched_variant(device, engine):
    planned = {v.key for v in aot.plan(engine)}
    mine = {v.key for v in aot.plan(engine) if v.fn is small.w4a16_small_m_kernel}
    assert mine and len(mine) == 1   # M = 1 and M = 16 share the tensor-core configuration by default
    fmt = "nvfp4" if engine.quant_format == "nvfp4" else "int4_awq"
    group = 16 if fmt == "nvfp4" else engine.group_size
    rec = _Recorder()
    w, ws, ws2 = _weights(fmt, 64, 512, group, torch.float32, device)
    for m in (1, 3, 16, 17):
        x = torch.randn(m, 512, device=device).bfloat16()
        w4a16_linear(x.float(), fmt, w, ws.to(torch.bfloat16) if fmt != "nvfp4" else ws, ws2, aot=rec,
                     split_k=2 if m <= MAX_M else None)   # the large-M tiles are tuned unsplit
    # the interpreter ran the fp32 calls; the keys do not depend on the dtype
    assert rec.keys and rec.keys <= planned, rec.keys - planned


def test_divisibility_follows_the_shapes():
    """Llama-3-8B's K (4096, 14336) are multiples of 16 in every stride; SmolLM2's K = 576 with groups of 64
    leaves a scale row of 9: stride_sn is not compiled as a multiple of 16 there."""
    assert set(w4a16_codes.divisible(LLAMA8B_NVFP4)) == {"K", "k_per_split", "stride_xm", "stride_wn", "stride_sn"}
    assert set(w4a16_codes.divisible(SMOL_INT4)) == {"K", "k_per_split", "stride_xm", "stride_wn"}
    for v in aot.plan(LLAMA8B_NVFP4):
        if v.fn in (small.w4a16_small_m_kernel, gemm_w4a16.w4a16_gemm_kernel):
            assert "stride_sn" in v.divisible, v.key


def test_launcher_refuses_a_call_that_breaks_the_hint():
    from plugins.launcher import pack_params
    v = next(v for v in aot.plan(LLAMA8B_NVFP4) if v.fn is small.w4a16_small_m_kernel)
    sig = v.signature()
    meta = {"key": v.key, "signature": [[n, t] for n, t in sig.items()],
            "params": [n for n, t in sig.items() if t != "constexpr"], "aligned": aot.aligned_params(sig),
            "aligned_pointers": 16, "divisible": list(v.divisible), "extra_params": 0}
    t = {n: torch.zeros(32, dtype={"*bf16": torch.bfloat16, "*u8": torch.uint8, "*fp8e4nv": torch.float8_e4m3fn,
                                   "*fp32": torch.float32, "*i32": torch.int32}[ty])
         for n, ty in sig.items() if ty.startswith("*")}
    good = dict(M=1, N=4096, K=4096, k_per_split=896, num_splits=5, stride_xm=4096, stride_wn=2048, stride_sn=256,
                stride_om=4096)
    args = lambda **kw: tuple(t[n] if n in t else {**good, **kw}[n] for n in meta["params"])  # noqa: E731
    pack_params(meta, args())
    with pytest.raises(ValueError, match="K=4104 is not a multiple of 16"):
        pack_params(meta, args(K=4104))


_COMPILE_CHILD = r"""
import json, re, sys
from plugins import aot, gemm_w4a16_small
from plugins.common import EngineShapes
e = EngineShapes(**json.loads(sys.argv[1]))
res = []
for v in aot.plan(e):
    if v.fn is gemm_w4a16_small.w4a16_small_m_kernel:
        k, meta = aot.compile_variant(v, 90)
        ptx = k.asm["ptx"]
        res.append({"key": v.key, "divisible": meta["divisible"], "pipelined": "cp.async" in ptx,
                    "byte_loads": len(re.findall(r"ld\.global(?:\.\w+)*\.[bu]8", ptx)), "mma": "mma" in ptx})
print(json.dumps(res))
"""


def test_aot_variants_compile_with_wide_loads():
    """sm_90 cubins, no GPU: with the engine's multiples of 16 declared, the packed weight and x are copied
    to shared memory in 16-byte pieces, pipelined (without the hints: 36 byte loads a tile, no cp.async),
    and the tile runs on tensor cores. What byte loads remain are NVFP4's e4m3 scales (8 a row a tile)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE_CHILD, json.dumps(dataclasses.asdict(LLAMA8B_NVFP4))],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res, "no small-M W4A16 variant planned"
    for r in res:
        assert r["divisible"] and r["pipelined"] and r["byte_loads"] <= 4 and r["mma"], r
