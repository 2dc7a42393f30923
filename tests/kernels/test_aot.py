"""Ahead-of-time compilation with no GPU: sm_90 and sm_100 cubins + PTX + metadata for every kernel a
SmolLM2-shaped engine uses; metadata agrees with the kernel signatures and the launcher's packing;
hashes match; the plan covers every variant the runtime launches; bad shapes are refused. The caller
(builder/stages/compile.py: kernel_shapes) builds the shapes from the bundle's manifest."""
import dataclasses
import hashlib
import json
import os

import pytest
import torch

from plugins import aot, kv_write, paged_prefill
from plugins.common import EngineShapes
from plugins.launcher import KernelSet, pack_params, ptx_types_of

ENGINE = EngineShapes(  # SmolLM2-135M, NVFP4 + fp8 KV + EAGLE (bf16 activations)
    act="bf16", kv="fp8e4nv", num_heads=9, num_kv_heads=3, head_dim=64, hidden_size=576, intermediate_size=1536,
    block_size=16, quant_format="nvfp4", group_size=None, speculative=True)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    root = tmp_path_factory.mktemp("bundle")
    entries = aot.compile_for_bundle(ENGINE, [90, 100], root / "kernels")
    return root, entries


def test_every_variant_compiled_for_both_sms(bundle):
    root, entries = bundle
    keys = {v.key for v in aot.plan(ENGINE)}
    assert any("HAS_TREE=1" in k for k in keys) and any(k.startswith("w4a16_gemm_kernel") for k in keys)
    for sm in (90, 100):
        assert {e["key"] for e in entries if e["sm"] == sm} == keys
    for e in entries:
        cubin = (root / e["cubin"]).read_bytes()
        ptx = (root / e["ptx"]).read_text()
        assert len(cubin) > 1000 and cubin[:4] == b"\x7fELF", e["cubin"]
        assert f".target sm_{e['sm']}" in ptx
        assert e["cubin"].startswith(f"kernels/sm{e['sm']}/")


def test_metadata_matches_signature_and_hashes(bundle):
    root, entries = bundle
    variants = {v.key: v for v in aot.plan(ENGINE)}
    for e in entries:
        meta_bytes = (root / e["meta"]).read_bytes()
        meta = json.loads(meta_bytes)
        v = variants[meta["key"]]
        assert meta["params"] == [n for n in v.fn.arg_names if n not in v.constexprs]
        assert meta["constexprs"] == {k: int(x) for k, x in v.constexprs.items()}
        assert meta["num_warps"] == v.num_warps and meta["shared"] >= 0
        # what the launcher will pass is exactly what the compiled entry point declares
        assert ptx_types_of(meta) == meta["ptx_param_types"], meta["key"]
        assert meta["extra_params"] == 2   # Triton 3.7: global + profile scratch pointers
        for kind in ("cubin", "ptx"):
            digest = hashlib.sha256((root / e[kind]).read_bytes()).hexdigest()
            assert digest == e["sha256"][kind] == meta["sha256"][kind]
        assert hashlib.sha256(meta_bytes).hexdigest() == e["sha256"]["meta"]
        assert meta["triton_version"] and meta["sm"] == e["sm"]


def test_pack_params_follows_metadata(bundle):
    root, entries = bundle
    meta = json.loads((root / next(e for e in entries if "kv_write" in e["key"])["meta"]).read_text())
    act, kv = torch.zeros(64, dtype=torch.bfloat16), torch.zeros(64, dtype=torch.float8_e4m3fn)
    args = (act, act, kv, kv, torch.zeros(4, dtype=torch.int64), torch.ones(1), torch.ones(1), 4, 1, 2, 3, 4)
    params = pack_params(meta, args)
    assert len(params) == len(meta["ptx_param_types"])
    with pytest.raises(ValueError, match="arguments"):
        pack_params(meta, args[:-1])
    with pytest.raises(ValueError, match="aligned"):
        pack_params(meta, (act[1:],) + args[1:])
    with pytest.raises(ValueError, match="compiled for"):
        pack_params(meta, (act.float(),) + args[1:])   # fp32 k where the engine's kernels take bf16
    # per-step metadata is sliced by the runtime (seq_lens[num_prefills:]): never required aligned
    assert "slot_ptr" not in meta["aligned"] and "k_cache_ptr" in meta["aligned"]
    pack_params(meta, args[:4] + (args[4][1:],) + args[5:])


def test_no_gpu_means_jit_with_a_warning(bundle):
    root, entries = bundle
    with pytest.warns(RuntimeWarning, match="using Triton JIT"):
        ks = KernelSet.from_bundle(root, entries, "cpu")
    assert ks.launch(entries[0]["key"], (1,), ()) is False


class _Recorder:
    """Stands in for a KernelSet: records each variant the runtime asks for, then lets it JIT."""
    def __init__(self):
        self.keys = set()
        self.calls = []

    def launch(self, key, grid, args):
        self.keys.add(key)
        self.calls.append((key, args))
        return False


def test_plan_covers_what_the_backend_launches(monkeypatch, device):
    # the interpreter uses its own tile sizes; give it the GPU ones so keys are the GPU's
    monkeypatch.setattr(paged_prefill, "CPU_TILES", paged_prefill.gpu_tiles())
    monkeypatch.setattr(kv_write, "CPU_TOKENS", kv_write.GPU_TOKENS)
    from backend.ops.attention.triton_backend import TritonAttentionBackend
    from tests.kernels.test_triton_backend import _step
    rec = _Recorder()
    be = TritonAttentionBackend(aot=rec)
    kv = torch.float8_e4m3fn
    for ctx, qlens, p, tree in (([0, 40, 7], [5, 1, 1], 1, None),
                                ([30], [3], 0, torch.ones(3, 3, dtype=torch.bool, device=device))):
        meta, nb = _step(ctx, qlens, p, 16, device, tree=tree)
        kc = torch.zeros(nb, 16, 3, 64, device=device).to(kv)
        vc = torch.zeros_like(kc)
        q = torch.randn(sum(qlens), 9, 64, device=device).bfloat16()
        k = torch.randn(sum(qlens), 3, 64, device=device).bfloat16()
        s = torch.tensor(0.1, device=device)
        be.write_kv(k, k, kc, vc, meta.slot_mapping, s, s)
        for splits in (1, 3):
            monkeypatch.setattr("plugins.paged_decode._target_programs", lambda dev, fp8=False, n=splits: n * 1000)
            be.forward(q, kc, vc, meta, 0.125, s, s)
    planned = {v.key for v in aot.plan(ENGINE)}
    assert rec.keys and rec.keys <= planned, rec.keys - planned
    # what the variants are compiled to assume (multiples of 16) holds for the backend's real calls, so
    # its cubins launch rather than falling back to JIT
    variants = {v.key: v for v in aot.plan(ENGINE)}
    for key, args in rec.calls:
        v = variants[key]
        params = [n for n in v.fn.arg_names if n not in v.constexprs]
        bad = {n: int(a) for n, a in zip(params, args) if n in v.divisible and int(a) % 16}
        assert not bad, f"{key}: {bad} break the compiled divisibility"
    assert any(variants[k].divisible for k in rec.keys)


def test_bad_shapes_are_refused(tmp_path):
    broken = dataclasses.replace(ENGINE, head_dim=0)
    with pytest.raises(aot.AotError, match="shapes.head_dim: 0; allowed: a positive integer"):
        aot.compile_for_bundle(broken, [90], tmp_path / "k")
    with pytest.raises(aot.AotError, match="shapes.kv: 'fp16'"):
        aot.compile_for_bundle(dataclasses.replace(ENGINE, kv="fp16"), [90], tmp_path / "k")
    with pytest.raises(aot.AotError, match="target_sms: 75"):
        aot.compile_for_bundle(ENGINE, [75], tmp_path / "k")
    assert not os.path.exists(tmp_path / "k")


def test_cli_reports_bad_shapes(tmp_path, capsys):
    bad = dict(dataclasses.asdict(ENGINE), act="fp64")
    (tmp_path / "shapes.json").write_text(json.dumps(bad))
    assert aot.main([str(tmp_path / "shapes.json"), str(tmp_path / "k"), "--sms", "90"]) == 2
    assert "shapes.act: 'fp64'; allowed: bf16, fp16, fp32" in capsys.readouterr().err
    del bad["head_dim"]
    (tmp_path / "shapes.json").write_text(json.dumps(bad))
    assert aot.main([str(tmp_path / "shapes.json"), str(tmp_path / "k"), "--sms", "90"]) == 2
    assert "fields ['head_dim'] missing" in capsys.readouterr().err
    assert not (tmp_path / "k").exists()


def test_unusable_cubins_fall_back_to_jit_with_correct_results(bundle, recwarn, device):
    """A KernelSet whose variant does not fit the call (dtype), or whose cubin cannot be loaded (no driver
    at all under the interpreter; on a GPU the driver refuses the bytes), warns and lets the wrapper
    JIT; the result is the reference's either way."""
    from plugins.launcher import AotKernel
    from plugins.reference.norm import rms_norm_ref
    from plugins.rmsnorm import rms_norm
    root, entries = bundle
    e = next(x for x in entries if x["key"].startswith("rms_norm_kernel") and "HAS_RESIDUAL=0" in x["key"])
    meta = json.loads((root / e["meta"]).read_text())
    ks = KernelSet({meta["key"]: AotKernel(meta, b"not a cubin", None)}, device)
    x, w = torch.randn(3, 576, device=device), torch.randn(576, device=device)
    torch.testing.assert_close(rms_norm(x, w, 1e-5, aot=ks), rms_norm_ref(x, w, 1e-5))
    assert "compiled for *bf16" in str(recwarn.pop(RuntimeWarning).message) and meta["key"] in ks.kernels
    fp32_meta = dict(meta, signature=[[n, "*fp32" if t == "*bf16" else t] for n, t in meta["signature"]])
    ks = KernelSet({meta["key"]: AotKernel(fp32_meta, b"not a cubin", None)}, device)
    torch.testing.assert_close(rms_norm(x, w, 1e-5, aot=ks), rms_norm_ref(x, w, 1e-5))
    assert "using Triton JIT" in str(recwarn.pop(RuntimeWarning).message)
    assert meta["key"] not in ks.kernels and not ks.launched   # never retried, never counted


def test_a_tensor_parallel_bundle_compiles_one_ranks_shapes():
    """engine.tp_size 3 (SmolLM2: 9 heads, 3 KV heads, intermediate 1536): the kernels are planned for
    what each rank launches (3 heads, 1 KV head, 512 MLP columns, hidden whole), so a rank finds
    its cubins and compiles nothing at start; tp 1 plans the whole model's, as before."""
    from types import SimpleNamespace

    from builder.stages.compile import kernel_shapes

    def manifest(tp: int):
        return SimpleNamespace(
            model=SimpleNamespace(dtype="bfloat16", num_heads=9, num_kv_heads=3, head_dim=64, hidden_size=576,
                                  intermediate_size=1536),
            quantization=SimpleNamespace(format="nvfp4", group_size=None),
            engine=SimpleNamespace(kv_cache_dtype="fp8_e4m3", kv_block_size=16, tp_size=tp), speculative=object())
    assert kernel_shapes(manifest(1)) == ENGINE
    rank = kernel_shapes(manifest(3))
    assert (rank.num_heads, rank.num_kv_heads, rank.intermediate_size, rank.hidden_size) == (3, 1, 512, 576)
    assert {v.key for v in aot.plan(rank)} != {v.key for v in aot.plan(ENGINE)}


GEMMA3 = EngineShapes(  # Gemma 3 270M: head dim 256, 4 heads over 1 KV head, 5 sliding : 1 global, q/k (1 + w) norms
    act="bf16", kv="fp8e4nv", num_heads=4, num_kv_heads=1, head_dim=256, hidden_size=640, intermediate_size=2048,
    block_size=16, quant_format="fp8", group_size=None, speculative=True, sliding_window=True, qk_norm="rms_1p")


def test_window_and_qk_norm_variants_are_planned_only_where_needed():
    names = {v.fn.__name__ for v in aot.plan(GEMMA3)}
    assert {"paged_decode_window_kernel", "paged_decode_kernel", "paged_prefill_window_kernel",
            "paged_prefill_kernel", "rope_kv_norm_write_kernel"} <= names
    assert "rope_kv_write_kernel" not in names   # the model always norms q and k
    plain = {v.fn.__name__ for v in aot.plan(ENGINE)}
    assert not {n for n in plain if "window" in n or "norm_write" in n}
    assert any(v.constexprs.get("QK_NORM") == 2 for v in aot.plan(GEMMA3))
    qwen = dataclasses.replace(GEMMA3, qk_norm="rms", sliding_window=False)
    assert any(v.constexprs.get("QK_NORM") == 1 for v in aot.plan(qwen))
    with pytest.raises(aot.AotError, match="shapes.qk_norm: 'gemma'; allowed: none, rms, rms_1p"):
        aot.plan(dataclasses.replace(GEMMA3, qk_norm="gemma"))


def test_window_and_qk_norm_launches_are_planned(monkeypatch, device):
    """What the wrappers launch for a windowed, q/k-normed, head-256 engine (decode split or not,
    prefill with and without a tree, the fused norm + rope + KV write) is in its plan, so its cubins
    are found rather than compiled at start."""
    from plugins import rope_kv
    from plugins.paged_decode import paged_decode
    monkeypatch.setattr(paged_prefill, "CPU_TILES", paged_prefill.gpu_tiles(256))
    monkeypatch.setattr(rope_kv, "CPU_TOKENS", rope_kv.GPU_TOKENS)
    rec = _Recorder()
    d, bs, s = 256, 16, torch.tensor(0.1)
    kc = torch.zeros(16, bs, 1, d).to(torch.float8_e4m3fn)
    tables = torch.arange(16, dtype=torch.int32).view(1, 16)
    q = torch.randn(3, 4, d).bfloat16()
    for window in (None, 150):   # a window of more than one 128-token tile: two splits of it
        for splits in (1, 2):
            paged_decode(q[:1], kc, kc, tables, torch.tensor([200], dtype=torch.int32), 0.0625, s, s,
                         num_splits=splits, aot=rec, window=window)
        qsl, ctx = torch.tensor([0, 3], dtype=torch.int32), torch.tensor([30], dtype=torch.int32)
        for tree in (None, torch.ones(3, 3, dtype=torch.bool)):
            paged_prefill.paged_prefill(q, kc, kc, tables, qsl, ctx, 0.0625, s, s, tree_mask=tree, aot=rec,
                                        window=window)
    qkv = torch.randn(2, 6 * d).bfloat16()
    w = torch.zeros(d).bfloat16()
    cs = torch.zeros(8, 2, d // 2)
    idx = torch.zeros(2, dtype=torch.long)
    rope_kv.rope_write_kv(qkv, idx, cs, kc, kc.clone(), idx, 4, 1, s, s, aot=rec, q_norm=w, k_norm=w, qk_norm="rms_1p")
    planned = {v.key for v in aot.plan(GEMMA3)}
    # decode: 2 kernels x (split or not) + one reduction; prefill: 2 kernels x (tree or not); the norm write
    assert len(rec.keys) == 10 and rec.keys <= planned, rec.keys - planned


_COMPILE_NEW_VARIANTS = r"""
import json, sys
from plugins import aot, paged_decode, paged_prefill, rope_kv
from plugins.common import EngineShapes
e = EngineShapes(**json.loads(sys.argv[1]))
# one variant per new kind: window decode (split) and prefill (tree), the fused q/k norm, head dim 256 plain
pick = [next(v for v in paged_decode.aot_variants(e) if v.fn is paged_decode.paged_decode_window_kernel
             and v.constexprs["SPLIT"]),
        next(v for v in paged_prefill.aot_variants(e) if v.fn is paged_prefill.paged_prefill_window_kernel
             and v.constexprs["HAS_TREE"]),
        rope_kv.aot_variants(e)[0],
        next(v for v in paged_decode.aot_variants(e) if v.fn is paged_decode.paged_decode_kernel)]
res = []
for v in pick:
    for sm in (90, 100):
        k, meta = aot.compile_variant(v, sm)
        res.append({"kernel": v.fn.__name__, "sm": sm, "elf": k.asm["cubin"][:4] == b"\x7fELF",
                    "ptx_target": f".target sm_{sm}" in k.asm["ptx"], "shared": meta["shared"],
                    "params": meta["params"], "extra": meta["extra_params"]})
print(json.dumps(res))
"""


def test_window_qk_norm_and_head_256_variants_compile_for_both_sms():
    """sm_90 and sm_100 cubins with no GPU for each new kind, within the 227 KB of shared memory a
    block may have on both (the head-256 prefill with a tree is the largest)."""
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE_NEW_VARIANTS, json.dumps(dataclasses.asdict(GEMMA3))],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {(r["kernel"], r["sm"]) for r in res} == {
        (k, sm) for k in ("paged_decode_window_kernel", "paged_prefill_window_kernel", "rope_kv_norm_write_kernel",
                          "paged_decode_kernel") for sm in (90, 100)}
    for r in res:
        assert r["elf"] and r["ptx_target"] and r["extra"] == 2, r
        assert 0 < r["shared"] <= 227 * 1024 or r["kernel"] == "rope_kv_norm_write_kernel", r
        if "window" in r["kernel"]:
            assert r["params"][-1] == "window", r   # the runtime window is the last argument
        if r["kernel"] == "rope_kv_norm_write_kernel":
            assert {"q_norm_ptr", "k_norm_ptr", "eps"} <= set(r["params"]), r
