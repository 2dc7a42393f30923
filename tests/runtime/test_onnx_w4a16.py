"""The W4A16 GEMM plugin node (``kiln_w4a16_gemm``) in the decoder graph of 4-bit bundles (#21).

Real SmolLM2 nvfp4 and int4_awq bundles (real ModelOpt calibration, the LIGHT builds of
tests/builder/test_quantized_bundles.py, whose quantize stage they share) built by the real pipeline
with ``tensorrt.enabled=true``: every packed linear of the graph is a kiln_w4a16_gemm node whose inputs
are byte ranges of weights.safetensors in the plugin's SPECS order, onnx's checker accepts the graph with
its weights, the compile stage wrote the plugin's PTX and the registration picks that variant and
launches it as the native host wrapper does. Run by onnx's ReferenceEvaluator (engine.runtime
onnx-reference), the graph gives the native fp32 runner's logits over a prefill and a decode step, to
rounding, as the bf16 graph does in test_onnx_graph.py.

What "the native runner" is here: the graph computes what the native GPU path does, W4A16 (nvfp4's
activations stay 16-bit; its input_scale is for W4A4, which the CPU runner emulates when the bundle has
one), so the native runner is given the bundle's tensors without input_scale (its W4A16 mode,
backend/ops/linear.py NVFP4Linear). And both run a KV pool of the model dtype (an engine override;
the parity graph is the same export for that pool): the bundles' fp8 KV cache rounds the keys and
values, so a last-bit difference upstream flips an fp8 code now and then (test_onnx_graph.py's fp8 test
measures that band), which would hide what this test is about: the 4-bit linears.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from tests.runtime.graph_helpers import LIGHT, TEXT, decode_meta, prefill_parity, runners, share_quantize

CONFIGS = {"nvfp4": "smollm2-135m-nvfp4", "int4_awq": "smollm2-135m-int4-awq"}
GROUP = {"nvfp4": 16, "int4_awq": 64}            # configs/smollm2-135m-int4-awq.yaml group_size
LINEARS = ("qkv", "o", "gate_up", "down")


@pytest.fixture(scope="module", params=list(CONFIGS))
def w4_bundle(request, build_bundle) -> tuple[str, Path]:
    fmt, config = request.param, CONFIGS[request.param]
    trt = LIGHT + ["tensorrt.enabled=true"]
    share_quantize(Path(build_bundle(config, LIGHT)), config, trt)   # one calibration for both builds
    return fmt, Path(build_bundle(config, trt))


def test_formats_of_config_export_and_kernel_agree():
    from builder.config_tensorrt import TRT_FORMATS
    from builder.tensorrt.onnx_export import FORMATS
    from plugins.gemm_w4a16 import FORMATS as KERNEL_FORMATS
    from plugins.tensorrt.variants import W4A16
    assert TRT_FORMATS == FORMATS and set(W4A16) <= set(FORMATS)
    assert {f: w.fmt for f, w in W4A16.items()} == KERNEL_FORMATS


@pytest.mark.slow
def test_packed_linears_are_w4a16_nodes_and_the_graph_checks(w4_bundle):
    import onnx
    from backend import bundle as b
    from plugins.tensorrt.convention import SPECS
    from plugins.tensorrt.variants import GRAPH_IO, W4A16
    fmt, path = w4_bundle
    m = b.read(path)
    b.load_bundle(path, verify_hashes=True)
    assert m.quantization.format == fmt and m.tensorrt is not None
    onnx.checker.check_model(str(path / "decoder.onnx"), full_check=True)   # external data included
    model = onnx.load(str(path / "decoder.onnx"), load_external_data=False)
    n = m.model.num_layers
    nodes = [x for x in model.graph.node if x.op_type == "kiln_w4a16_gemm"]
    assert [x.name for x in nodes] == [f"layers.{i}.{lin}.w4a16_gemm" for i in range(n) for lin in LINEARS]
    # no dense product for those linears: the only MatMul left is the (tied, bf16) lm_head's
    assert [x.name for x in model.graph.node if x.op_type == "MatMul"] == ["lm_head.matmul"]
    producer = {o: x for x in model.graph.node for o in x.output}
    refs = _header(path / "weights.safetensors")
    io = GRAPH_IO["kiln_w4a16_gemm"]
    assert tuple(p for p, _, _ in io.inputs) == SPECS["w4a16_gemm"].inputs
    for node in nodes:
        p = node.name.removesuffix(".w4a16_gemm")
        assert node.domain == "kiln" and len(node.output) == 1
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs == {"plugin_namespace": b"kiln", "aot": 1, "fmt": W4A16[fmt].fmt, "group_size": GROUP[fmt]}
        assert [a.name for a in node.attribute if a.name not in ("plugin_namespace", "aot")] == list(io.attrs)
        x, w, s, s2 = node.input
        assert w == f"{p}.weight" and refs[w]["dtype"] == "U8"
        if fmt == "nvfp4":    # fp8 block scales and the fp32 global scale, straight from the file
            assert (s, s2) == (f"{p}.weight_scale", f"{p}.weight_scale_2")
            assert not producer[x].name.endswith("pre_quant_scale.mul")
        else:                 # bf16 group scales (cast to the compute dtype), fed twice: FMT 0 never reads the second
            assert s == s2 == f"{p}.weight_scale.cast" and producer[s].input[0] == f"{p}.weight_scale"
            smoothed = f"{p}.pre_quant_scale" in refs
            assert (producer[x].name == f"{p}.pre_quant_scale.mul") == smoothed, p
            if smoothed:
                assert producer[producer[x].input[1]].input[0] == f"{p}.pre_quant_scale"
    assert any(f"{p}.pre_quant_scale" in refs for p in ("layers.0.o", "layers.0.down")) == (fmt == "int4_awq")
    # the packed weights and scales are byte ranges of weights.safetensors, not copies
    inits = {t.name: t for t in model.graph.initializer}
    assert not any(name.endswith(".input_scale") for name in inits)       # W4A16: no activation scale
    for name in ("layers.0.qkv.weight", "layers.29.down.weight", "layers.7.gate_up.weight_scale"):
        ext = {e.key: e.value for e in inits[name].external_data}
        assert ext["location"] == "weights.safetensors"
        assert (int(ext["offset"]), int(ext["length"])) == refs[name]["range"]
        assert list(inits[name].dims) == refs[name]["shape"]


def _header(path: Path) -> dict:
    """Each tensor of a safetensors file: dtype, shape and its absolute byte range, read independently of
    builder/tensorrt/safetensors_refs.py."""
    with path.open("rb") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(size))
    return {k: {"dtype": v["dtype"], "shape": v["shape"],
                "range": (8 + size + v["data_offsets"][0], v["data_offsets"][1] - v["data_offsets"][0])}
            for k, v in header.items() if k != "__metadata__"}


@pytest.mark.slow
def test_compile_stage_writes_the_plugin_and_registration_launches_it(w4_bundle, monkeypatch):
    """engine.json lists the plugin; its PTX is there per SM (checked by the convention and ptxas at the
    build); the registration picks it from the bundle's manifest alone and, through a MOCK of TensorRT
    (tests/runtime/fake_tensorrt.py), hands TensorRT the launch the native host wrapper makes for the
    same tensors (its launch intercepted, no kernel run)."""
    from safetensors import safe_open

    from backend import bundle as b
    from backend.runtime import trt_files
    from plugins import gemm_w4a16, w4a16_codes
    from plugins.tensorrt import register as R
    from plugins.tensorrt.variants import W4A16, GraphConsts, VariantError, io_types, launch, parse_key, w4a16_of
    from tests.runtime import fake_tensorrt
    fmt, path = w4_bundle
    m = b.read(path)
    assert m.tensorrt.plugins == ("kiln_rope_kv_write", "kiln_paged_prefill", "kiln_w4a16_gemm")
    plugins = path / m.tensorrt.dir / "plugins"
    for sm in m.tensorrt.sms:
        metas = [json.loads(f.read_text()) for f in (plugins / f"sm{sm}").glob("kiln_w4a16_gemm-*.json")]
        assert len(metas) == 1 and metas[0]["plugin"] == "kiln_w4a16_gemm"
        assert any(f.startswith(f"{m.tensorrt.dir}/plugins/sm{sm}/kiln_w4a16_gemm-") for f in m.files)   # hashed
        cx = parse_key(metas[0]["key"])
        assert (cx["FMT"], cx["GROUP"], cx["SPLIT"]) == (w4a16_codes.FORMATS[fmt], GROUP[fmt], 0)
    sm = m.tensorrt.sms[0]
    graph = trt_files.graph_consts(m, trt_files.load_profiles(path / m.tensorrt.dir / trt_files.PROFILES))
    assert graph.w4a16 == fmt and w4a16_of(graph) == (W4A16[fmt], GROUP[fmt])
    fake = fake_tensorrt.install(monkeypatch)
    meta = R.register(plugins, sm, ["kiln_w4a16_gemm"], graph)["kiln_w4a16_gemm"]
    with pytest.raises(VariantError, match="4-bit format is None"):   # a graph without 4-bit linears has no variant
        R.choose(plugins, sm, ["kiln_w4a16_gemm"], GraphConsts(**{**graph.__dict__, "w4a16": None}))

    # the native wrapper on the bundle's own down projection, M above the small-M kernel's rows
    f = safe_open(str(path / "weights.safetensors"), "pt")
    t = {k: f.get_tensor(f"layers.3.down.{k}") for k in ("weight", "weight_scale", "weight_scale_2")
         if f"layers.3.down.{k}" in f.keys()}
    n, k = t["weight"].shape[0], 2 * t["weight"].shape[1]
    m_rows = gemm_w4a16.SMALL_M + 21
    x = torch.zeros(m_rows, k, dtype=torch.bfloat16)
    seen = {}
    monkeypatch.setattr(gemm_w4a16, "launch", lambda fn, grid, args, cx, num_warps=4, num_stages=3, aot=None:
                        seen.update(grid=tuple(grid), args=args, cx={c: int(v) for c, v in cx.items()}))
    gemm_w4a16.w4a16_linear(x, fmt, t["weight"], t["weight_scale"].to(torch.bfloat16) if fmt == "int4_awq"
                            else t["weight_scale"], t.get("weight_scale_2"))
    assert parse_key(meta["key"]) == seen["cx"]                     # the variant the native wrapper runs
    want = launch(meta, {"x": tuple(x.shape), "weight": tuple(t["weight"].shape),
                         "weight_scale": tuple(t["weight_scale"].shape)})
    assert want.grid == seen["grid"] and want.scalars == tuple(seen["args"][5:13])
    scale_type = {"nvfp4": "FP8", "int4_awq": "BF16"}[fmt]
    shapes = {"x": ((m_rows, k), "BF16"), "weight": (tuple(t["weight"].shape), "UINT8"),
              "weight_scale": (tuple(t["weight_scale"].shape), scale_type),
              "weight_scale_2": (((), "FLOAT") if fmt == "nvfp4" else (tuple(t["weight_scale"].shape), "BF16"))}
    (out,), combos, (entry, code, params, extra) = fake_tensorrt.build_time_calls(
        fake, "kiln::kiln_w4a16_gemm", shapes, {"fmt": w4a16_codes.FORMATS[fmt], "group_size": GROUP[fmt]})
    value = lambda v: getattr(v, "value", v)     # noqa: E731
    assert [value(d) for d in out.shape_expr] == [m_rows, n] and out.dtype is fake.trt.DataType.BF16
    assert [c.io_types for c in combos] == [io_types("kiln_w4a16_gemm", graph)]
    assert combos[0].io_types == f"BF16,UINT8,{scale_type},{'FP32' if fmt == 'nvfp4' else 'BF16'},BF16"
    assert entry == meta["entry"].encode() and code == meta["_ptx_bytes"]
    assert tuple(value(getattr(params, f"grid_{a}")) for a in "xyz") == want.grid
    assert tuple(value(s) for s in extra) == want.scalars
    with pytest.raises(VariantError, match=r"aot_impl got node attributes \{'fmt': \d, 'group_size': 32\}"):
        fake_tensorrt.build_time_calls(fake, "kiln::kiln_w4a16_gemm", shapes,
                                       {"fmt": w4a16_codes.FORMATS[fmt], "group_size": 32})


@pytest.mark.slow
def test_graph_equals_native_w4a16_over_prefill_and_decode(w4_bundle, tmp_path):
    import onnx
    from backend import bundle as b
    from backend.runtime.native import load_weights
    from backend.serving.conversion.tokenizer import load_tokenizer
    from builder.tensorrt.onnx_export import decoder_model
    fmt, path = w4_bundle
    m = b.read(path)
    kv = dict(kv_cache_dtype=m.model.dtype)   # a model-dtype pool: see the module docstring
    model = decoder_model(path, m.replace(engine=m.engine.override(**kv)))
    assert sum(x.op_type == "kiln_w4a16_gemm" for x in model.graph.node) == 4 * m.model.num_layers
    onnx.save_model(model, tmp_path / "decoder.onnx")
    w4a16 = {k: v for k, v in load_weights(path, torch.device("cpu")).items() if not k.endswith(".input_scale")}
    native, graph = runners(path, tmp_path / "decoder.onnx", weights=w4a16, **kv)
    assert graph.dtype == torch.float32 and graph.kv_dtype == native.kv_dtype == torch.float32
    ids = load_tokenizer(path / "tokenizer").encode(TEXT)[:20]   # 2 KV blocks
    want = prefill_parity(native, graph, ids)
    step = torch.tensor([int(want[-1].argmax())])
    dmeta = decode_meta(len(ids), native.block_size)
    want_d, _ = native.execute(step, dmeta, torch.arange(1))
    got_d, _ = graph.execute(step, dmeta, torch.arange(1))
    assert (got_d - want_d).abs().max() < 2e-3 and torch.equal(got_d.argmax(-1), want_d.argmax(-1))
