"""TensorRT calling convention of the plugin PTX, with no TensorRT and no GPU: real compiles of the
SmolLM2-shaped engine's plugin variants (plugins.tensorrt), each `.entry` parsed and checked against
(input pointers, int32 scalars, output pointers), each assembled with ptxas for sm_90a and sm_100a; and
one failing case per check (extra parameter, float scalar left in, scratch memory, scratch pointer
used, wrong target, PTX that ptxas rejects), each naming the problem. No TensorRT call runs here.

The negative-case kernels below are compiled in a child process (`python <this file> OUT`): the kernel
tests run under TRITON_INTERPRET=1, where @triton.jit functions cannot be compiled in process."""
import dataclasses
import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import triton
import triton.language as tl

from plugins import aot
from plugins.common import EngineShapes, Variant
from plugins.paged_prefill import paged_prefill_kernel
from plugins.tensorrt import convention as C
from plugins.tensorrt.compile import compile_all, file_stem
from plugins.tensorrt.ptx import ConventionError, check_entry, entry_params, instructions, strip_scratch
from plugins.tensorrt.ptxas import PtxasError, assemble

ENGINE = EngineShapes(  # SmolLM2-135M, NVFP4 + fp8 KV + EAGLE (bf16), as tests/kernels/test_aot.py
    act="bf16", kv="fp8e4nv", num_heads=9, num_kv_heads=3, head_dim=64, hidden_size=576, intermediate_size=1536,
    block_size=16, quant_format="nvfp4", group_size=None, speculative=True)
FP8_ENGINE = dataclasses.replace(ENGINE, quant_format="fp8")   # adds fp8-writing decode and quantizing norms
FLOATS = C.TrtFloats(rms_eps=1e-5)   # SmolLM2's rms_norm_eps
ROOT = Path(__file__).resolve().parents[2]
PLUGINS = {"kiln_paged_decode", "kiln_paged_decode_split", "kiln_paged_decode_reduce", "kiln_paged_prefill",
           "kiln_rope_kv_write", "kiln_w4a16_gemm", "kiln_add_rms_norm_quant", "kiln_rms_norm_quant"}


@triton.jit
def scratch_kernel(x_ptr, n, out_ptr, BLOCK: tl.constexpr):
    # a device-side tensor descriptor: Triton builds it in global scratch memory
    d = tl.make_tensor_descriptor(x_ptr, shape=[n], strides=[1], block_shape=[BLOCK])
    tl.store(out_ptr + tl.arange(0, BLOCK), d.load([0]))


@triton.jit
def float_kernel(x_ptr, eps, n, out_ptr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(out_ptr + i, tl.load(x_ptr + i, mask=i < n) + eps, mask=i < n)


@triton.jit
def wide_kernel(x_ptr, n, out_ptr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(out_ptr + i, tl.load(x_ptr + i, mask=i < n), mask=i < n)


NEGATIVE = {"scratch": (scratch_kernel, {"x_ptr": "*fp32", "n": "i32", "out_ptr": "*fp32"}),
            "float": (float_kernel, {"x_ptr": "*fp32", "eps": "fp32", "n": "i32", "out_ptr": "*fp32"}),
            "wide": (wide_kernel, {"x_ptr": "*fp32", "n": "i64", "out_ptr": "*fp32"}),
            "plain": (wide_kernel, {"x_ptr": "*fp32", "n": "i32", "out_ptr": "*fp32"})}


def _emit_negative(out: Path) -> None:
    """Child process: compile the negative-case kernels for sm_90, write PTX + the metadata checked."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    for name, (fn, types) in NEGATIVE.items():
        attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(types.values()) if t.startswith("*")}
        k = triton.compile(ASTSource(fn, dict(types, BLOCK="constexpr"), {"BLOCK": 64}, attrs),
                           target=GPUTarget("cuda", 90, 32))
        md = k.metadata
        (out / f"{name}.ptx").write_text(k.asm["ptx"])
        (out / f"{name}.json").write_text(json.dumps({
            "name": md.name, "num_warps": md.num_warps, "num_ctas": md.num_ctas, "shared": md.shared,
            "global_scratch_size": md.global_scratch_size, "profile_scratch_size": md.profile_scratch_size}))
    # the native variants the plugins wrap, for comparing the compiled code
    for tv in C.trt_plan(ENGINE, FLOATS):
        k, meta = aot.compile_variant(tv.native, 90)
        (out / "native").mkdir(exist_ok=True)
        (out / "native" / f"{aot.variant_file_stem(tv.native)}.ptx").write_text(k.asm["ptx"])


@pytest.fixture(scope="module")
def plugins(tmp_path_factory):
    """Both SMs for the NVFP4 engine; sm_90 only for the FP8 engine's extra variants (CI time)."""
    out = tmp_path_factory.mktemp("trt")
    metas = compile_all(ENGINE, FLOATS, [90, 100], out / "nvfp4")
    fp8 = [dict(m, dir="fp8") for m in compile_all(FP8_ENGINE, FLOATS, [90], out / "fp8")]
    return [dict(m, dir="nvfp4") for m in metas] + fp8, out


def _ptx(out: Path, meta: dict) -> str:
    return (out / meta["dir"] / f"sm{meta['sm']}" / f"{file_stem(meta)}.ptx").read_text()


@pytest.fixture(scope="module")
def negative(tmp_path_factory):
    out = tmp_path_factory.mktemp("trt_neg")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, __file__, str(out)], env=env, cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    found = {n: ((out / f"{n}.ptx").read_text(), json.loads((out / f"{n}.json").read_text())) for n in NEGATIVE}
    return dict(found, native=out / "native")


def test_plan_names_the_ops_of_the_issue():
    tvs = C.trt_plan(ENGINE, FLOATS)
    assert {tv.spec.plugin for tv in tvs} == PLUGINS
    prefill = [tv for tv in tvs if tv.spec.plugin == "kiln_paged_prefill"]
    assert sorted(tv.constexprs["HAS_TREE"] for tv in prefill) == [False, True]
    # the floats are constexprs of the variant (one PTX per bundle config), never parameters
    for tv in tvs:
        assert not any(t.startswith("fp") for t in tv.types.values()), tv.key
        assert all(tv.constexprs[c] == getattr(FLOATS, f) for c, f in tv.spec.floats.items())
    # the variants are the native plan's: same constexprs, same launch configuration
    native = {v.key: v for v in aot.plan(ENGINE)}
    for tv in tvs:
        assert tv.native.key in native
        assert {k: x for k, x in tv.constexprs.items() if k not in tv.spec.floats} == tv.native.constexprs


def test_fp8_engine_adds_the_quantizing_norm_and_fp8_output():
    tvs = C.trt_plan(FP8_ENGINE, FLOATS)
    norm = [tv for tv in tvs if tv.spec.plugin in ("kiln_add_rms_norm_quant", "kiln_rms_norm_quant")]
    assert sorted((tv.constexprs["HAS_RESIDUAL"], tv.constexprs["QUANT"]) for tv in norm) == [
        (False, False), (False, True), (True, False), (True, True)]
    quant = next(tv for tv in norm if tv.constexprs["QUANT"])
    assert quant.types["out_ptr"] == "*fp8e4nv" and quant.spec.unused(quant.constexprs) == ()
    assert not any(tv.spec.plugin == "kiln_w4a16_gemm" for tv in tvs)


def test_every_entry_is_exactly_what_tensorrt_passes(plugins):
    metas, out = plugins
    nvfp4 = {(m["plugin"], m["sm"]) for m in metas if m["dir"] == "nvfp4"}
    assert nvfp4 == {(p, sm) for p in PLUGINS for sm in (90, 100)}
    fp8 = [m for m in metas if m["dir"] == "fp8"]
    assert any(m["outputs"] == [["out_ptr", "*fp8e4nv"]] and m["plugin"] == "kiln_paged_decode" for m in fp8)
    assert any(m["outputs"][0] == ["out_ptr", "*fp8e4nv"] and m["plugin"] == "kiln_add_rms_norm_quant" for m in fp8)
    for m in metas:
        ptx = _ptx(out, m)
        name, params = entry_params(ptx, m["entry"])
        n_in, n_sc, n_out = len(m["inputs"]), len(m["scalars"]), len(m["outputs"])
        assert [p.kind for p in params] == ["ptr"] * n_in + ["u32"] * n_sc + ["ptr"] * n_out, m["key"]
        assert [p.name for p in params] == [f"{name}_param_{i}" for i in range(len(params))]
        check_entry(ptx, name, n_in, n_sc, n_out)
        assert len(m["stripped_params"]) == 2 and f".target sm_{m['sm']}a" in ptx
        # the launch TensorRT is told (block = num_warps * 32) is the one the PTX requires
        assert re.search(rf"\.reqntid {m['block'][0]}\b", ptx), m["key"]
        assert set(m["unused_inputs"]) <= {n for n, _ in m["inputs"]}
        assert all(m["aliases"][o] in {n for n, _ in m["inputs"]} for o in m["aliases"])


def test_floats_are_baked_into_the_ptx(plugins):
    metas, out = plugins
    eps = "0f3727C5AC"   # fp32(1e-5): the PTX immediate the norm adds, where the native kernel loads a param
    for m in metas:
        if "EPS" in m["floats"]:
            assert eps in _ptx(out, m) and m["floats"]["EPS"] == 1e-5, m["key"]
        if m["plugin"] in ("kiln_paged_decode", "kiln_paged_decode_split", "kiln_paged_prefill"):
            # the softmax scale is an input (fp32[1]) TensorRT passes like any tensor, never an .f32 param
            assert ["sm_scale_ptr", "*fp32"] in m["inputs"] and not m["floats"], m["key"]


def test_plugin_code_is_the_native_kernels(plugins, negative):
    """Same instructions as the natively compiled variant (sm_90), parameter loads aside: reordering the
    parameters and baking eps in changed nothing else; the softmax scale input adds its one load."""
    metas, out = plugins
    natives = {v.key: v for v in aot.plan(ENGINE)}
    for m in [m for m in metas if m["sm"] == 90 and m["dir"] == "nvfp4"]:
        v = natives[m["native_key"]]
        native_ptx = (negative["native"] / f"{aot.variant_file_stem(v)}.ptx").read_text()
        ours, theirs = instructions(_ptx(out, m), m["entry"]), instructions(native_ptx, v.fn.__name__)
        extra = Counter({"ld.global.b32": 1, "mov.u32": 1}) if ["sm_scale_ptr", "*fp32"] in m["inputs"] else Counter()
        assert ours == theirs + extra, (m["key"], ours - theirs, theirs - ours)


@pytest.mark.parametrize("sm", [90, 100])
def test_ptxas_assembles_every_plugin(plugins, sm):
    metas, out = plugins
    for m in [m for m in metas if m["sm"] == sm]:
        cubin = assemble(_ptx(out, m), sm, m["key"])
        assert cubin[:4] == b"\x7fELF" and len(cubin) == m["ptxas"]["cubin_bytes"], m["key"]


def test_w4a16_variant_is_chosen_from_the_node_attributes_and_launched_as_natively(plugins, monkeypatch):
    """The registration's choice (variants.select) for a graph of 4-bit linears: the compiled W4A16 plugin
    whose FMT and GROUP are the node's ``fmt`` / ``group_size`` attributes (variants.node_attrs), its PTX
    types those of the node's inputs; another format is refused in one line naming what differs. Its
    launch for concrete shapes is the native host wrapper's (its launch intercepted, no kernel runs)."""
    import torch

    from plugins import gemm_w4a16, w4a16_codes
    from plugins.tensorrt.variants import GraphConsts, VariantError, launch, load_metas, node_attrs, parse_key, select
    _, out = plugins
    g = GraphConsts(num_heads=9, num_kv_heads=3, head_dim=64, block_size=16, act="bf16", kv="fp8e4nv", tree=True,
                    w4a16="nvfp4")
    metas = load_metas(out / "nvfp4", 90)
    meta = select(metas, "kiln_w4a16_gemm", 90, g)
    assert node_attrs("kiln_w4a16_gemm", g) == {"fmt": w4a16_codes.FMT_NVFP4, "group_size": 16}
    cx = parse_key(meta["key"])
    assert (cx["FMT"], cx["GROUP"], cx["SPLIT"]) == (w4a16_codes.FMT_NVFP4, 16, 0)
    assert meta["inputs"] == [["x_ptr", "*bf16"], ["w_ptr", "*u8"], ["ws_ptr", "*fp8e4nv"], ["ws2_ptr", "*fp32"]]
    int4 = GraphConsts(**{**g.__dict__, "w4a16": "int4_awq", "group_size": 64})
    with pytest.raises(VariantError, match=r"^kiln_w4a16_gemm for sm_90: no compiled variant with FMT=0, GROUP=64, "
                                           r"SPLIT=0 .* has FMT=1, GROUP=16, weight_scale \*fp8e4nv, "
                                           r"weight_scale_2 \*fp32;"):
        select(metas, "kiln_w4a16_gemm", 90, int4)
    for m, n, k in ((17, 576, 1536), (200, 3072, 576)):   # M above the small-M kernel's (native) rows
        seen = {}
        monkeypatch.setattr(gemm_w4a16, "launch", lambda fn, grid, args, cx, num_warps=4, num_stages=3, aot=None:
                            seen.update(grid=tuple(grid), args=args, cx={c: int(v) for c, v in cx.items()},
                                        warps=num_warps))
        gemm_w4a16.w4a16_linear(torch.zeros(m, k, dtype=torch.bfloat16), "nvfp4",
                                torch.zeros(n, k // 2, dtype=torch.uint8),
                                torch.ones(n, k // 16).to(torch.float8_e4m3fn), torch.ones(()))
        got = launch(meta, {"x": (m, k), "weight": (n, k // 2), "weight_scale": (n, k // 16)})
        assert parse_key(meta["key"]) == seen["cx"] and got.grid == seen["grid"]
        assert got.scalars == tuple(seen["args"][5:13]) and got.block == (32 * seen["warps"], 1, 1)
    # a decode row: the plugin runs this variant for every M (natively M <= 16 has its own kernel)
    assert launch(meta, {"x": (1, 576), "weight": (3072, 288), "weight_scale": (3072, 36)}).grid == (1, 48, 1)


def test_extra_parameter_is_refused(plugins):
    metas, out = plugins
    m = next(m for m in metas if m["plugin"] == "kiln_add_rms_norm_quant" and m["sm"] == 90)
    ptx = _ptx(out, m)
    last = entry_params(ptx, m["entry"])[1][-1].text
    bad = ptx.replace(last, last + ",\n\t.param .u32 extra_param", 1)
    with pytest.raises(ConventionError, match=r"declares 11 parameters, TensorRT passes 10 .*extra: extra_param"):
        check_entry(bad, m["entry"], 4, 4, 2)
    assert assemble(bad, 90)[:4] == b"\x7fELF"   # ptxas accepts it: only the convention check catches it


def test_scratch_pointers_left_in_are_refused(negative):
    ptx, md = negative["plain"]
    with pytest.raises(ConventionError, match="declares 5 parameters, TensorRT passes 3 .*scratch pointers still"):
        check_entry(ptx, md["name"], 1, 1, 1)
    check_entry(strip_scratch(ptx, md["name"]), md["name"], 1, 1, 1)


def test_float_parameter_is_refused(negative):
    ptx, md = negative["float"]
    stripped = strip_scratch(ptx, md["name"])
    with pytest.raises(ConventionError, match=r"parameter 1 \(eps\) is \.f32: TensorRT passes no float scalars"):
        check_entry(stripped, md["name"], 1, 2, 1, ["x_ptr", "eps", "n", "out_ptr"])
    # and before any compile: a planned variant whose scalar is not int32
    v = next(v for v in aot.plan(ENGINE) if v.fn is paged_prefill_kernel)
    bad = dataclasses.replace(v, types=dict(v.types, stride_qt="fp32"))
    with pytest.raises(ConventionError, match="scalar stride_qt is fp32; TensorRT passes only int32"):
        C.trt_variant(C.SPECS["paged_prefill"], bad, FLOATS)


def test_64_bit_scalar_is_refused(negative):
    ptx, md = negative["wide"]
    with pytest.raises(ConventionError, match=r"parameter 1 \(n, int32 scalar\) is \.u64"):
        check_entry(strip_scratch(ptx, md["name"]), md["name"], 1, 1, 1, ["x_ptr", "n", "out_ptr"])


def test_kernel_needing_scratch_is_refused(negative):
    ptx, md = negative["scratch"]
    assert md["global_scratch_size"] > 0
    types = {"x_ptr": "*fp32", "n": "i32", "out_ptr": "*fp32"}
    spec = C.TrtSpec("test_scratch", scratch_kernel, ("x_ptr",), ("n",), ("out_ptr",))
    tv = C.TrtVariant(spec, Variant(scratch_kernel, types, {"BLOCK": 64}), types, {"BLOCK": 64})
    with pytest.raises(ConventionError, match=r"scratch_kernel\[BLOCK=64\]w4s3 for sm_90: needs 128 bytes of "
                                              r"global scratch memory; TensorRT passes no scratch pointer"):
        C.finish(tv, 90, ptx, SimpleNamespace(**md))
    # and its PTX really uses the pointer, so stripping the declaration is refused too
    with pytest.raises(ConventionError, match="uses scratch parameter scratch_kernel_param_3"):
        strip_scratch(ptx, md["name"])


def test_ptxas_errors_name_the_kernel_and_carry_its_message(negative):
    ptx, md = negative["float"]
    with pytest.raises(PtxasError, match=r"k1: PTX targets sm_90a, not sm_100a"):
        assemble(ptx, 100, "k1")
    first = entry_params(ptx, md["name"])[1][0].text
    broken = ptx.replace(first + ",", "", 1)   # a declaration removed that the body still loads
    with pytest.raises(PtxasError, match=rf"k2: ptxas --gpu-name=sm_90a failed .*{md['name']}_param_0"):
        assemble(broken, 90, "k2")


def test_cli_refuses_bad_shapes_in_one_line(tmp_path, capsys):
    from plugins.tensorrt.compile import main
    bad = tmp_path / "shapes.json"
    bad.write_text(json.dumps({"act": "bf16"}))
    assert main([str(bad), str(tmp_path / "out"), "--rms-eps", "1e-5"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: shapes: fields") and "\n" not in err and not (tmp_path / "out").exists()


def test_no_tensorrt_import_in_the_package():
    """Importing any module of plugins/tensorrt never imports tensorrt (register.py does, lazily, inside
    the function a TensorRT host calls): checked in a child where importing tensorrt raises."""
    mods = [f"plugins.tensorrt.{f.stem}" for f in sorted((ROOT / "plugins" / "tensorrt").glob("*.py"))]
    assert "plugins.tensorrt.register" in mods
    code = ("import importlib, sys\n"
            "class Refuse:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'tensorrt' or name.startswith('tensorrt.'):\n"
            "            raise ImportError('tensorrt imported at module level')\n"
            "sys.meta_path.insert(0, Refuse())\n"
            f"for m in {mods!r}: importlib.import_module(m)\n"
            "assert not any(k == 'tensorrt' or k.startswith('tensorrt.') for k in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


if __name__ == "__main__":
    _emit_negative(Path(sys.argv[1]))
