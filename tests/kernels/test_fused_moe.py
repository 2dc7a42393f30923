"""The fused MoE kernel (plugins/fused_moe.py) and its align step (plugins/moe_align.py) against the
reference (plugins/reference/moe.py), in the interpreter: uneven expert loads with experts that get no
token, top-k 1 to 8, up to 128 experts, decode (T = 1) and an odd T, fp32 / fp16 / bf16 activations and
fp8 e4m3 experts with per-expert scales; outputs and scratch poisoned so an unwritten row fails. Shapes
are tiny (H, I in 16..64): every program costs Python time here. bf16 runs its dots in fp32 in the
interpreter (its bf16 tl.dot is wrong); the bf16 tensor-core path is checked on a GPU
(KILN_KERNEL_TESTS_ON_GPU=1)."""
import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from plugins import aot, registry
from plugins.common import EngineShapes
from plugins.fused_moe import fused_moe, moe_config
from plugins.moe_align import max_padded, moe_align
from plugins.reference.moe import align_ref, moe_ref
from tests.kernels.kernel_utils import assert_close, poison


def routing(T: int, k: int, E: int, device: str):
    """Top-k ids drawn with a skewed load (expert e weighted 1 / (e + 1)^2, the upper half of the experts
    never chosen where k allows it: experts with no token) and positive weights."""
    used = max(k, E // 2)
    p = torch.zeros(E)
    p[:used] = 1.0 / (torch.arange(used, dtype=torch.float32) + 1) ** 2
    p = p[torch.randperm(E)]                       # the empty experts anywhere, not only at the end
    ids = torch.stack([torch.multinomial(p, k) for _ in range(T)]) if T else torch.zeros(0, k, dtype=torch.long)
    return ids.to(device), torch.rand(T, k, device=device) + 0.05


def experts(E: int, H: int, I: int, dtype, device, fp8: bool = False):
    gu = torch.randn(E, 2 * I, H, device=device) / H ** 0.5
    dn = torch.randn(E, H, I, device=device) / I ** 0.5
    if not fp8:
        return gu.to(dtype), dn.to(dtype), None, None
    gus, ds = torch.rand(E, device=device) * 0.01 + 0.002, torch.rand(E, device=device) * 0.01 + 0.002
    q = lambda w, s: (w / s[:, None, None]).clamp(-448, 448).to(torch.float8_e4m3fn)  # noqa: E731
    return q(gu, gus), q(dn, ds), gus, ds


def run(x, ids, w, gu, dn, gus=None, ds=None, block_m=None):
    """fused_moe into poisoned output and scratch buffers."""
    T, H = x.shape
    n, inter = ids.numel(), gu.shape[1] // 2
    out = poison(torch.empty(T, H, dtype=x.dtype, device=x.device))
    scratch = (poison(torch.empty(n, inter, dtype=x.dtype, device=x.device)),
               poison(torch.empty(n, H, dtype=torch.float32, device=x.device)))
    got = fused_moe(x, ids, w, gu, dn, gus, ds, block_m=block_m, out=out, scratch=scratch)
    assert got is out
    return got


@pytest.mark.parametrize("T,k,E,block", [(37, 2, 8, 16), (1, 8, 128, 16), (5, 1, 3, 4), (9, 4, 16, 64), (0, 2, 4, 16)])
def test_align_matches_reference_and_brute_force(device, T, k, E, block):
    ids, _ = routing(T, k, E, device)
    s_ref, e_ref, P = align_ref(ids, E, block)
    flat = ids.reshape(-1).tolist()
    n = len(flat)
    # brute force: each expert's slots, in order, then padding, in ceil(count / block) blocks of its own
    at = 0
    for e in range(E):
        slots = [s for s, x in enumerate(flat) if x == e]
        nb = -(-len(slots) // block)
        assert s_ref[at:at + len(slots)].tolist() == slots
        assert (s_ref[at + len(slots):at + nb * block] == n).all()
        assert (e_ref[at // block:at // block + nb] == e).all()
        at += nb * block
    assert P == at == len(s_ref) == len(e_ref) * block
    sorted_ids, expert_ids, npad = moe_align(ids, E, block)
    size = max_padded(n, E, block)
    assert sorted_ids.shape == (size,) and expert_ids.shape == (size // block,) and size >= P
    assert npad.tolist() == [P]
    assert torch.equal(sorted_ids[:P], s_ref) and (sorted_ids[P:] == n).all()
    assert torch.equal(expert_ids[:P // block], e_ref)


CASES = [  # T, k, E, H, I, dtype
    (37, 1, 8, 32, 48, torch.float32),       # top-1, row block 64 (37 slots over 8 experts)
    (37, 2, 4, 32, 16, torch.float32),
    (37, 4, 16, 64, 32, torch.bfloat16),
    (37, 8, 128, 32, 32, torch.float32),     # 296 slots over 128 experts: the decode block (16)
    (1, 8, 128, 32, 16, torch.bfloat16),     # decode: 8 blocks of 16, not 128 experts' worth
    (1, 1, 128, 16, 16, torch.float32),
    (1, 2, 8, 64, 64, torch.float16),
    (3, 4, 4, 16, 32, torch.float16),        # every expert in use, N tiles partly masked
]


@pytest.mark.parametrize("T,k,E,H,I,dtype", CASES)
def test_fused_moe_matches_reference(device, fresh_seed, T, k, E, H, I, dtype):
    x = torch.randn(T, H, device=device).to(dtype)
    ids, w = routing(T, k, E, device)
    gu, dn, _, _ = experts(E, H, I, dtype, device)
    assert_close(run(x, ids, w, gu, dn), moe_ref(x, ids, w, gu, dn), dtype, f"moe T{T} k{k} E{E}", fresh_seed)


@pytest.mark.parametrize("block_m", [16, 64])
def test_either_row_block_gives_the_reference(device, fresh_seed, block_m):
    """The row block is a tuning choice: decode forced onto 64 (its blocks mostly padding) and a prefill
    onto 16 give the reference's numbers."""
    for T, k, E in ((1, 4, 32), (21, 2, 6)):
        x = torch.randn(T, 32, device=device)
        ids, w = routing(T, k, E, device)
        gu, dn, _, _ = experts(E, 32, 32, torch.float32, device)
        assert_close(run(x, ids, w, gu, dn, block_m=block_m), moe_ref(x, ids, w, gu, dn), torch.float32,
                     f"block_m {block_m} T{T}", fresh_seed)


def test_decode_does_not_pad_every_expert():
    """T = 1, top-8 of 128 experts: the small row block, and a grid of 8 blocks (one per chosen expert at
    most), not 128 x 64 rows."""
    cfg = moe_config(8, 128)
    assert cfg["block_m"] == 16 and max_padded(8, 128, 16) // 16 == 8
    assert moe_config(37 * 2, 4)["block_m"] == 64


@pytest.mark.parametrize("T,k,E,dtype", [(37, 2, 8, torch.float32), (1, 8, 128, torch.float16),
                                         (5, 4, 16, torch.bfloat16)])
def test_fp8_experts_with_per_expert_scales(device, fresh_seed, T, k, E, dtype):
    x = torch.randn(T, 32, device=device).to(dtype)
    ids, w = routing(T, k, E, device)
    gu, dn, gus, ds = experts(E, 32, 32, dtype, device, fp8=True)
    assert_close(run(x, ids, w, gu, dn, gus, ds), moe_ref(x, ids, w, gu, dn, gus, ds), dtype, "fp8 moe", fresh_seed)


def test_refuses_mismatched_shapes(device):
    x = torch.zeros(2, 16, device=device)
    ids, w = torch.zeros(2, 2, dtype=torch.long, device=device), torch.ones(2, 2, device=device)
    gu, dn = torch.zeros(4, 32, 16, device=device), torch.zeros(4, 16, 16, device=device)
    with pytest.raises(ValueError, match="are not"):
        fused_moe(x, ids, w, gu, dn[:, :8])
    with pytest.raises(ValueError, match="need fp32"):
        fused_moe(x, ids, w, gu.to(torch.float8_e4m3fn), dn.to(torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="do not agree on T"):
        fused_moe(x, ids[:1], w[:1], gu, dn)


def test_registered_in_the_table(device):
    assert registry.get("fused_moe", device, torch.float32) is fused_moe
    assert registry.get("fused_moe", "cpu", torch.float32, kind="torch") is moe_ref


MOE = EngineShapes(  # a small MoE (Qwen3-30B-A3B-like proportions, tiny): bf16, fp8 experts
    act="bf16", kv="bf16", num_heads=4, num_kv_heads=2, head_dim=64, hidden_size=256, intermediate_size=512,
    block_size=16, quant_format="fp8", group_size=None, speculative=False, num_experts=128, moe_intermediate_size=64)

_COMPILE = r"""
import json, sys
from plugins import aot, fused_moe
from plugins.common import EngineShapes
res = []
for shapes in json.loads(sys.argv[1]):
    for v in fused_moe.aot_variants(EngineShapes(**shapes)):
        for sm in (90, 100):
            k, meta = aot.compile_variant(v, sm)
            res.append({"key": v.key, "sm": sm, "elf": k.asm["cubin"][:4] == b"\x7fELF",
                        "ptx_target": f".target sm_{sm}" in k.asm["ptx"], "shared": meta["shared"],
                        "extra": meta["extra_params"]})
print(json.dumps(res))
"""


def test_planned_only_with_experts_and_compiled_for_both_sms():
    """No variant for a dense engine; an MoE engine plans both GEMMs at both row blocks, fp8 experts in
    an fp8 engine, and each compiles for sm_90 and sm_100 with no GPU (in a child process: the
    interpreter's kernels cannot be compiled)."""
    dense = dataclasses.replace(MOE, num_experts=0, moe_intermediate_size=0)
    assert not [v for v in aot.plan(dense) if v.fn.__name__ == "moe_gemm_kernel"]
    moe = [v for v in aot.plan(MOE) if v.fn.__name__ == "moe_gemm_kernel"]
    assert len(moe) == 4 and all(v.constexprs["FP8_W"] for v in moe)
    assert {v.constexprs["BLOCK_M"] for v in moe} == {16, 64}
    bf16 = dataclasses.replace(MOE, quant_format="none")
    with pytest.raises(aot.AotError, match="moe_intermediate_size: 0"):
        aot.plan(dataclasses.replace(MOE, moe_intermediate_size=0))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    arg = json.dumps([dataclasses.asdict(MOE), dataclasses.asdict(bf16)])
    proc = subprocess.run([sys.executable, "-c", _COMPILE, arg], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(res) == 16 and {r["sm"] for r in res} == {90, 100}
    for r in res:
        assert r["elf"] and r["ptx_target"] and r["extra"] == 2 and 0 < r["shared"] <= 227 * 1024, r


class _Recorder:
    """Stands in for a KernelSet: records the variants the wrapper asks for, then lets it JIT."""
    def __init__(self):
        self.keys = set()

    def launch(self, key, grid, args):
        self.keys.add(key)
        return False


def test_plan_covers_what_the_wrapper_launches(device):
    """Decode and prefill launches of an fp8-expert engine (fp32 activations: the interpreter's bf16
    stand-in compiles another variant) ask for planned variants, so a bundle's cubins are found."""
    shapes = dataclasses.replace(MOE, act="fp32", kv="fp32", hidden_size=32, moe_intermediate_size=32, num_experts=16)
    rec = _Recorder()
    gu, dn, gus, ds = experts(16, 32, 32, torch.float32, device, fp8=True)
    for T in (1, 64):
        ids, w = routing(T, 4, 16, device)
        fused_moe(torch.randn(T, 32, device=device), ids, w, gu, dn, gus, ds, aot=rec)
    planned = {v.key for v in aot.plan(shapes)}
    assert len(rec.keys) == 4 and rec.keys <= planned, rec.keys - planned
