"""The TensorRT plan builder (builder/tensorrt_build.py) and the plugin registration it runs
(plugins/tensorrt/register.py, plugins/tensorrt/variants.py), with no TensorRT and no GPU.

TensorRT cannot be installed here: tests that need it run against tests/runtime/fake_tensorrt.py, a
MOCK of its Python API that records what Kiln asks of it (each such test says so). What is real: the
bundles (tests/runtime/trt_bundle.py: engine.json through backend.bundle, profiles.json from
graph_io.profiles(), plugin PTX compiled and ptxas-checked by plugins.tensorrt.compile), the variant
choice, and the launch of each plugin, compared with what the native host wrappers compute for the
same tensors (their launch intercepted, no kernel run).
"""
from __future__ import annotations

import json

import pytest
import torch

from backend import bundle as B
from backend.runtime import graph_io
from builder import tensorrt_build
from plugins import paged_prefill, rope_kv
from plugins.tensorrt import register as R
from plugins.tensorrt.variants import (GRAPH_IO, GraphConsts, VariantError, io_types, launch, load_metas, parse_key,
                                       select)
from tests.runtime import fake_tensorrt, trt_bundle
from tests.runtime.trt_bundle import ENGINE, MODEL, SM, make_bundle

GRAPH = GraphConsts(num_heads=4, num_kv_heads=2, head_dim=32, block_size=16, act="bf16", kv="fp8e4nv", tree=True)


@pytest.fixture(scope="module")
def ptx():
    return trt_bundle.plugin_ptx()


@pytest.fixture
def engine_dir(tmp_path, ptx):
    """A bundle with the build's own decoder.onnx and profiles.json (trt_bundle.make_bundle)."""
    return make_bundle(tmp_path / "engine", ptx)


def _run(capsys, *argv) -> tuple[int, list[str]]:
    rc = tensorrt_build.main([str(a) for a in argv])
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("[tensorrt_build]")]
    return rc, err


def test_help(capsys):
    with pytest.raises(SystemExit) as exc:
        tensorrt_build.main(["--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0
    assert all(opt in out for opt in ("bundle", "--sm", "--workspace-gib", "--timing-cache", "tensorrt.enabled=true"))


def test_without_tensorrt_one_line_exit_2(engine_dir, monkeypatch, capsys):
    fake_tensorrt.uninstall(monkeypatch)
    rc, err = _run(capsys, engine_dir)
    assert rc == 2 and len(err) == 1, err
    for part in ("TensorRT is not installed", "nvcr.io/nvidia/tensorrt", "pip install tensorrt",
                 f"python -m builder.tensorrt_build {engine_dir}", "make engine-plan"):
        assert part in err[0], (part, err[0])


def test_refusals_before_tensorrt(tmp_path, engine_dir, monkeypatch, capsys):
    fake_tensorrt.uninstall(monkeypatch)
    plain = make_bundle(tmp_path / "plain", None, trt_section=False)
    rc, err = _run(capsys, plain)
    assert rc == 2 and len(err) == 1 and 'OVERRIDES="tensorrt.enabled=true"' in err[0], err
    (engine_dir / "tensorrt" / "profiles.json").write_text("{}")
    rc, err = _run(capsys, engine_dir)
    assert rc == 2 and len(err) == 1 and "profiles.json: changed since the build" in err[0], err


def _expected_shapes(draft: int) -> list[dict]:
    """Each profile's (min, opt, max) per input, straight from graph_io (not from profiles.json)."""
    e, m = ENGINE, MODEL
    out = []
    for p in graph_io.profiles(e["max_batch_size"], e["max_num_tokens"], e["max_seq_len"], e["kv_block_size"], draft):
        fixed = {"block_size": e["kv_block_size"], "kv_heads": m["num_kv_heads"], "head_dim": m["head_dim"]}
        rng = lambda d: (fixed[d],) * 3 if d in fixed else p.dims[d]      # noqa: E731
        dims = {n: ds for n, _, ds in graph_io.STEP_INPUTS}
        dims.update({f(i): graph_io.KV_DIMS for i in range(m["num_layers"])
                     for f in (graph_io.k_cache, graph_io.v_cache)})
        out.append({n: tuple(tuple(rng(d)[k] for d in ds) for k in range(3)) for n, ds in dims.items()})
    return out


def test_build_with_mock_tensorrt(engine_dir, tmp_path, monkeypatch, capsys):
    """MOCK TensorRT (fake_tensorrt): what the builder asks of TensorRT, and the bundle it leaves."""
    fake = fake_tensorrt.install(monkeypatch)
    cache = tmp_path / "timing.cache"
    cache.write_bytes(b"old")
    rc, err = _run(capsys, engine_dir, "--sm", SM, "--workspace-gib", "2", "--timing-cache", cache)
    assert rc == 0, err
    flags = fake.trt.NetworkDefinitionCreationFlag
    assert fake.called("create_network") == [(1 << flags.STRONGLY_TYPED) | (1 << flags.PREFER_AOT_PYTHON_PLUGINS)]
    graph = engine_dir / "decoder.onnx"
    assert fake.called("parse") == [{"bytes": graph.read_bytes(), "path": str(graph)}]
    assert fake.called("build_serialized_network") == [_expected_shapes(0)]
    assert fake.called("set_memory_pool_limit") == [("WORKSPACE", 2 << 30)]
    assert fake.called("set_preview_feature") == [("ALIASED_PLUGIN_IO_10_03", True)]
    assert fake.called("create_timing_cache") == [b"old"] and cache.read_bytes() == b"old+tuned"
    assert set(fake.plugins) == {"kiln::kiln_rope_kv_write", "kiln::kiln_paged_prefill"}
    plan = engine_dir / "tensorrt" / "engine.plan"
    assert json.loads(plan.read_bytes())["mock_plan"] == fake.version
    assert sorted(p.name for p in plan.parent.iterdir()) == ["engine.plan", "plugins", "profiles.json"]
    loaded = B.load_bundle(engine_dir, verify_hashes=True)      # hashes refreshed, plan listed
    assert loaded.manifest.tensorrt.plan == "tensorrt/engine.plan"
    assert loaded.manifest.tensorrt.version == fake.version
    assert loaded.manifest.files["tensorrt/engine.plan"] == B.sha256_file(plan)


def test_build_defaults_from_the_bundle(engine_dir, monkeypatch, capsys):
    """MOCK TensorRT (fake_tensorrt): without flags, the workspace and timing cache of engine.json's
    tensorrt section (the build config's): 8 GiB, and a cache in the bundle, hashed with the plan."""
    fake = fake_tensorrt.install(monkeypatch)
    rc, err = _run(capsys, engine_dir, "--sm", SM)
    assert rc == 0, err
    assert fake.called("set_memory_pool_limit") == [("WORKSPACE", 8 << 30)]
    assert fake.called("create_timing_cache") == [b""]
    cache = engine_dir / "tensorrt" / "timing.cache"
    assert cache.read_bytes() == b"+tuned" and B.load_bundle(engine_dir).manifest.files["tensorrt/timing.cache"]
    rc, err = _run(capsys, engine_dir, "--sm", SM)      # a rebuild reads the cache and re-records both
    assert rc == 0 and fake.called("create_timing_cache")[-1] == b"+tuned"
    B.load_bundle(engine_dir, verify_hashes=True)


@pytest.mark.parametrize("failure", ["fail_build", "fail_parse"])
def test_failed_build_leaves_no_plan(engine_dir, monkeypatch, capsys, failure):
    """MOCK TensorRT (fake_tensorrt) that fails the parse or the build: exit 1, no plan, engine.json as it was."""
    fake_tensorrt.install(monkeypatch, **{failure: True})
    before = (engine_dir / "engine.json").read_bytes()
    rc, err = _run(capsys, engine_dir, "--sm", SM)
    assert rc == 1 and len(err) == 1, err
    assert ("mock parse failure" if failure == "fail_parse" else "TensorRT built no plan") in err[0]
    assert sorted(p.name for p in (engine_dir / "tensorrt").iterdir()) == ["plugins", "profiles.json"]
    assert (engine_dir / "engine.json").read_bytes() == before


def test_sm_and_inputs_refused(engine_dir, monkeypatch, capsys):
    """MOCK TensorRT (fake_tensorrt): an SM the bundle has no PTX for, no GPU and no --sm, and profiles
    that miss a graph input are refused in one line (exit 2) before anything is built."""
    fake = fake_tensorrt.install(monkeypatch)
    rc, err = _run(capsys, engine_dir, "--sm", 100)
    assert rc == 2 and "tensorrt.sms is [90], not sm_100" in err[0] and len(err) == 1
    if not torch.cuda.is_available():
        rc, err = _run(capsys, engine_dir)
        assert rc == 2 and "no CUDA GPU visible and no --sm" in err[0]
    doc = json.loads((engine_dir / "tensorrt" / "profiles.json").read_text())
    del doc["inputs"]["tree_mask"]
    (engine_dir / "tensorrt" / "profiles.json").write_text(json.dumps(doc))
    B.write(engine_dir, B.read(engine_dir).replace(files=B.file_hashes(engine_dir)))
    rc, err = _run(capsys, engine_dir, "--sm", SM)
    assert rc == 2 and "no shapes for ['tree_mask']" in err[0], err
    assert not fake.called("build_serialized_network")


# ---- plugin variants and their launch ------------------------------------------------------------

def test_graph_io_is_the_convention(engine_dir):
    """GRAPH_IO against SPECS, and against the exported graph's kiln nodes: their inputs and outputs, and
    their int attributes in the order TensorRT will hand them to aot_impl (by position)."""
    import onnx
    from plugins.tensorrt.convention import SPECS
    for node in onnx.load(str(engine_dir / "decoder.onnx"), load_external_data=False).graph.node:
        if node.domain == "kiln":
            io = GRAPH_IO[node.op_type]
            assert (len(node.input), len(node.output)) == (len(io.inputs), len(io.outputs))
            assert [a.name for a in node.attribute if a.name not in ("plugin_namespace", "aot")] == list(io.attrs)
    for key in ("rope_kv_write", "paged_prefill"):
        spec, io = SPECS[key], GRAPH_IO[SPECS[key].plugin]
        assert tuple(p for p, _, _ in io.inputs) == spec.inputs and tuple(p for p, _, _ in io.outputs) == spec.outputs
    # the in-place outputs alias, in order, the inputs register.py's descriptor aliases (qkv, k_cache, v_cache)
    spec, io = SPECS["rope_kv_write"], GRAPH_IO["kiln_rope_kv_write"]
    graph_name = {p: g for p, g, _ in io.inputs}
    assert [graph_name[spec.aliases[o]] for o, _, _ in io.outputs] == ["qkv", "k_cache", "v_cache"]


def test_select_picks_the_graph_variant(ptx):
    metas = load_metas(ptx, SM)
    tree = select(metas, "kiln_paged_prefill", SM, GRAPH)
    plain = select(metas, "kiln_paged_prefill", SM, GraphConsts(**{**GRAPH.__dict__, "tree": False}))
    assert parse_key(tree["key"])["HAS_TREE"] == 1 and parse_key(plain["key"])["HAS_TREE"] == 0
    assert parse_key(select(metas, "kiln_rope_kv_write", SM, GRAPH)["key"])["KV_FP8"] == 1
    with pytest.raises(VariantError) as exc:
        select(metas, "kiln_paged_prefill", SM, GraphConsts(**{**GRAPH.__dict__, "kv": "bf16"}))
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith("kiln_paged_prefill for sm_90: no compiled variant with")
    assert "KV_FP8=0" in msg and "has KV_FP8=1" in msg and "k_cache *fp8e4nv" in msg
    with pytest.raises(VariantError, match=r"kiln_rope_kv_write for sm_100: .* the bundle has no variant of it"):
        select(load_metas(ptx, 100), "kiln_rope_kv_write", 100, GRAPH)
    with pytest.raises(VariantError, match=r"has HEAD_DIM=32"):
        select(metas, "kiln_paged_prefill", SM, GraphConsts(**{**GRAPH.__dict__, "head_dim": 64}))


def _capture(monkeypatch, module):
    """Intercept a native wrapper's launch (grid, runtime args, constexprs); no kernel runs."""
    seen = {}
    monkeypatch.setattr(module, "launch", lambda fn, grid, args, cx, num_warps=4, num_stages=3, aot=None:
                        seen.update(grid=tuple(grid), args=args, cx={k: int(v) for k, v in cx.items()}))
    return seen


@pytest.mark.parametrize("lens,ctx,tree", [((37,), (0,), False), ((5, 1, 12), (16, 40, 0), False),
                                           ((4, 4), (30, 7), True), ((1, 1, 1, 1), (3, 99, 17, 64), True)])
def test_prefill_launch_equals_the_native_wrapper(ptx, monkeypatch, lens, ctx, tree):
    monkeypatch.setattr(paged_prefill, "CPU_TILES", paged_prefill.gpu_tiles())   # the GPU's tiles on CPU tensors
    seen = _capture(monkeypatch, paged_prefill)
    t, b, width, table = sum(lens), len(lens), (max(lens) if tree else 0), 9
    qkv = torch.zeros(t, (4 + 2 * 2) * 32, dtype=torch.bfloat16)
    cache = torch.zeros(20, 16, 2, 32, dtype=torch.float8_e4m3fn)
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    tables = torch.zeros(b, table, dtype=torch.int32)
    mask = torch.ones(t, width, dtype=torch.bool) if tree else None
    paged_prefill.paged_prefill(qkv[:, :128].view(t, 4, 32), cache, cache, tables, qsl,
                                torch.tensor(ctx, dtype=torch.int32), 0.17, tree_mask=mask, max_query_len=max(lens))
    meta = select(load_metas(ptx, SM), "kiln_paged_prefill", SM, GraphConsts(**{**GRAPH.__dict__, "tree": tree}))
    got = launch(meta, {"q": qkv.shape, "block_tables": tables.shape, "context_lens": (b,),
                        "tree_mask": (t, width)})
    assert parse_key(meta["key"]) == seen["cx"]                        # the variant the native wrapper runs
    assert got.scalars == tuple(seen["args"][-6:])                     # strides: q, out, block table, tree mask
    assert got.grid[1:] == seen["grid"][1:] and got.grid[0] * seen["cx"]["BLOCK"] >= t
    assert got.grid[0] == seen["grid"][0] if b == 1 else got.grid[0] >= seen["grid"][0]
    assert got.block == (meta["block"][0], 1, 1) == (32 * 4, 1, 1) and got.shared == meta["shared"]


@pytest.mark.parametrize("t", [1, 7, 64])
def test_rope_launch_equals_the_native_wrapper(ptx, monkeypatch, t):
    monkeypatch.setattr(rope_kv, "CPU_TOKENS", rope_kv.GPU_TOKENS)
    seen = _capture(monkeypatch, rope_kv)
    qkv = torch.zeros(t, 256, dtype=torch.bfloat16)
    cache = torch.zeros(8, 16, 2, 32, dtype=torch.float8_e4m3fn)
    idx = torch.arange(t)
    rope_kv.rope_write_kv(qkv, idx, torch.zeros(512, 2, 16), cache, cache, idx, 4, 2)
    meta = select(load_metas(ptx, SM), "kiln_rope_kv_write", SM, GRAPH)
    got = launch(meta, {"qkv": qkv.shape})
    assert parse_key(meta["key"]) == seen["cx"]
    assert got.grid == seen["grid"] + (1, 1) and got.scalars == tuple(seen["args"][-2:]) == (t, 256)


def test_register_through_mock_tensorrt(ptx, monkeypatch):
    """MOCK TensorRT (fake_tensorrt): the register / autotune / aot_impl functions TensorRT would call
    while building, called as it would with symbolic shapes; their answers equal `launch` on ints."""
    fake = fake_tensorrt.install(monkeypatch)
    chosen = R.register(ptx, SM, list(trt_bundle.PLUGINS), GRAPH)
    R.register(ptx, SM, list(trt_bundle.PLUGINS), GRAPH)     # once per process: the second is a no-op
    attrs = {"head_dim": 32, "num_heads": 4, "num_kv_heads": 2}     # the ONNX node's order (sorted)
    t, width = 11, 4
    shapes = {"q": ((t, 256), "BF16"), "k_cache": ((30, 16, 2, 32), "FP8"), "v_cache": ((30, 16, 2, 32), "FP8"),
              "block_tables": ((3, 9), "INT32"), "query_start_loc": ((4,), "INT32"), "context_lens": ((3,), "INT32"),
              "tree_mask": ((t, width), "BOOL"), "k_scale": ((1,), "FLOAT"), "v_scale": ((1,), "FLOAT"),
              "sm_scale": ((1,), "FLOAT")}
    (out,), combos, (entry, code, params, extra) = fake_tensorrt.build_time_calls(
        fake, "kiln::kiln_paged_prefill", shapes, attrs)
    meta = chosen["kiln_paged_prefill"]
    assert [d.value for d in out.shape_expr] == [t, 128] and out.dtype is fake.trt.DataType.BF16
    assert [(c.io_types, c.layouts) for c in combos] == [(io_types("kiln_paged_prefill", GRAPH), "LINEAR")]
    assert combos[0].io_types == "BF16,FP8,FP8,INT32,INT32,INT32,BOOL,FP32,FP32,FP32,BF16"
    want = launch(meta, {n: s for n, (s, _) in shapes.items()})
    value = lambda x: getattr(x, "value", x)     # noqa: E731
    assert (entry, code) == (meta["entry"].encode(), (ptx / "sm90" / (meta["_ptx"].rsplit("/", 1)[1])).read_bytes())
    assert tuple(value(getattr(params, f"grid_{a}")) for a in "xyz") == want.grid
    assert (params.block_x, params.block_y, params.block_z, params.shared_mem) == (*want.block, want.shared)
    assert tuple(value(s) for s in extra) == want.scalars
    rope_shapes = {"qkv": ((t, 256), "BF16"), "k_cache": ((30, 16, 2, 32), "FP8"), "v_cache": ((30, 16, 2, 32), "FP8"),
                   "positions": ((t,), "INT64"), "slot_mapping": ((t,), "INT64"), "cos_sin": ((512, 2, 16), "FLOAT"),
                   "k_scale": ((1,), "FLOAT"), "v_scale": ((1,), "FLOAT")}
    outs, _, (_, _, params, extra) = fake_tensorrt.build_time_calls(fake, "kiln::kiln_rope_kv_write", rope_shapes,
                                                                    attrs)
    assert [o.alias_of.shape_expr[1].value for o in outs] == [256, 16, 16]      # qkv, k_cache, v_cache in place
    assert (value(params.grid_x), [value(s) for s in extra]) == (t, [t, 256])
    rope_shapes["k_cache"] = ((30, 16, 2, 32), "BF16")
    with pytest.raises(VariantError, match="input k_cache is DataType.BF16, the plugin's PTX .* takes FP8"):
        fake_tensorrt.build_time_calls(fake, "kiln::kiln_rope_kv_write", rope_shapes, attrs)
    with pytest.raises(VariantError, match="already registered in this process with another variant"):
        R.register(ptx, SM, ["kiln_paged_prefill"], GraphConsts(**{**GRAPH.__dict__, "tree": False}))
