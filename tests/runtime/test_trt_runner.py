"""engine.runtime=tensorrt (backend/runtime/trt_runner.py, trt_session.py) with no TensorRT and no GPU.

The runner's refusals are real up to the TensorRT call; past it, tests run against
tests/runtime/fake_tensorrt.py, a MOCK of TensorRT's Python API (TensorRT cannot be installed here;
each test that uses it says so): the plan is the mock builder's, and the execution context records
every profile switch, input shape and tensor address the session sets. The session is device-agnostic
(addresses are all it passes), so it runs here on CPU tensors; on a GPU the runner gives it CUDA ones.
"""
from __future__ import annotations

import pytest
import torch

from backend.runtime import graph_io
from backend.runtime.spec import EngineError, load_engine_spec
from backend.runtime.trt_files import load_profiles
from backend.runtime.trt_runner import TensorRTRunner
from backend.runtime.trt_session import PlanSession, choose_profile, step_dims
from backend.ops.attention.metadata import AttentionMetadata
from builder import tensorrt_build
from tests.runtime import fake_tensorrt, trt_bundle
from tests.runtime.trt_bundle import MODEL, SM, make_bundle


@pytest.fixture(scope="module")
def ptx():
    return trt_bundle.plugin_ptx()


def _planned(tmp_path, ptx, monkeypatch, draft: int = 3):
    """A bundle with a plan built by the MOCK TensorRT; -> (bundle, the mock)."""
    path = make_bundle(tmp_path / "engine", ptx, draft=draft)
    fake = fake_tensorrt.install(monkeypatch)
    assert tensorrt_build.main([str(path), "--sm", str(SM)]) == 0
    return path, fake


def _refusal(path, device="cuda") -> str:
    with pytest.raises(EngineError) as exc:
        TensorRTRunner(load_engine_spec(path), device=device)
    msg = str(exc.value)
    assert "\n" not in msg
    return msg


def test_refuses_a_cpu_device_and_a_bundle_without_a_plan(tmp_path, ptx, monkeypatch):
    fake_tensorrt.uninstall(monkeypatch)
    path = make_bundle(tmp_path / "engine", ptx)
    assert "device 'cpu' is not a CUDA GPU" in _refusal(path, "cpu")
    msg = _refusal(path)
    assert "tensorrt.plan is null" in msg and f"make engine-plan OUT={tmp_path}" in msg
    plain = make_bundle(tmp_path / "plain", None, trt_section=False)
    assert 'no tensorrt section' in _refusal(plain) and 'OVERRIDES="tensorrt.enabled=true"' in _refusal(plain)


def test_refuses_without_tensorrt_or_with_another_version(tmp_path, ptx, monkeypatch):
    """MOCK TensorRT (fake_tensorrt) builds the plan; then TensorRT is missing, then another version."""
    path, fake = _planned(tmp_path, ptx, monkeypatch)
    fake_tensorrt.uninstall(monkeypatch)
    msg = _refusal(path)
    assert "TensorRT is not installed" in msg and "nvcr.io/nvidia/tensorrt" in msg and "engine.runtime=tensorrt" in msg
    fake_tensorrt.install(monkeypatch, version="10.13.0")
    msg = _refusal(path)
    assert f"built by TensorRT {fake.version}, this host has 10.13.0" in msg and "make engine-plan" in msg
    if not torch.cuda.is_available():
        fake_tensorrt.install(monkeypatch, version=fake.version)
        assert "no CUDA GPU is visible" in _refusal(path)


def _session(path, fake, blocks: int = 12) -> tuple[PlanSession, list]:
    spec = load_engine_spec(path)
    engine = fake.trt.Runtime(None).deserialize_cuda_engine((path / spec.manifest.tensorrt.plan).read_bytes())
    shape = (blocks, 16, MODEL["num_kv_heads"], MODEL["head_dim"])
    pool = [(torch.zeros(shape, dtype=torch.float8_e4m3fn), torch.zeros(shape, dtype=torch.float8_e4m3fn))
            for _ in range(MODEL["num_layers"])]
    session = PlanSession(engine, engine.create_execution_context(), load_profiles(path / "tensorrt/profiles.json"),
                          pool, MODEL["vocab_size"], MODEL["hidden_size"], torch.bfloat16, torch.device("cpu"))
    return session, pool


def _step(lens: list[int], ctx: list[int], tree: bool = False, ids_dtype=torch.int64):
    """A step of ``lens`` new tokens per sequence after ``ctx`` cached ones (blocks 0.. per sequence)."""
    i32 = torch.int32
    t = sum(lens)
    pos = torch.cat([torch.arange(c, c + n) for n, c in zip(lens, ctx)])
    meta = AttentionMetadata(
        positions=pos, slot_mapping=pos.clone(), block_tables=torch.zeros(len(lens), 9, dtype=i32),
        seq_lens=torch.tensor([n + c for n, c in zip(lens, ctx)], dtype=i32),
        query_start_loc=torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=i32),
        context_lens=torch.tensor(ctx, dtype=i32), num_prefills=sum(n > 1 for n in lens),
        num_prefill_tokens=sum(n for n in lens if n > 1), num_decode_tokens=sum(n for n in lens if n == 1),
        max_query_len=max(lens), max_seq_len=max(n + c for n, c in zip(lens, ctx)),
        tree_mask=torch.ones(t, max(lens), dtype=torch.bool).tril() if tree else None)
    ids = torch.arange(t, dtype=ids_dtype)
    rows = torch.tensor(list(torch.tensor(lens).cumsum(0) - 1))
    return graph_io.step_feeds(ids, meta, rows), meta


def test_session_binds_every_input_and_output_by_name(tmp_path, ptx, monkeypatch):
    """MOCK TensorRT (fake_tensorrt): a prefill step's bindings as the execution context records them."""
    path, fake = _planned(tmp_path, ptx, monkeypatch)
    session, pool = _session(path, fake)
    feeds, meta = _step([13, 7], [0, 16], ids_dtype=torch.int32)
    out = session.run(feeds, meta.max_query_len, stream=7)
    run = fake.executed[-1]
    engine = session.engine
    assert set(run["addresses"]) == set(engine.names) and run["stream"] == 7
    assert run["profile"] == session.profiles.index("context")
    for i, (k, v) in enumerate(pool):    # the graph writes the pool in place: outputs alias the inputs
        assert run["addresses"][f"k_cache.{i}"] == run["addresses"][f"k_cache_out.{i}"] == k.data_ptr()
        assert run["addresses"][f"v_cache.{i}"] == run["addresses"][f"v_cache_out.{i}"] == v.data_ptr()
    assert run["addresses"]["logits"] == session.logits.data_ptr() and out.logits.shape == (2, MODEL["vocab_size"])
    assert run["addresses"]["hidden.0"] == session.hidden["hidden.0"].data_ptr() and out.hidden[0].shape == (20, 128)
    for name, t in feeds.items():
        assert run["shapes"][name] == tuple(t.shape)
    assert run["shapes"]["k_cache.1"] == tuple(pool[1][0].shape)
    # int32 ids converted to the plan's int64; the step's tensors are bound themselves where they fit
    held = session._held["input_ids"]
    assert held.dtype == torch.int64
    assert run["addresses"]["input_ids"] == held.data_ptr() != feeds["input_ids"].data_ptr()
    assert run["addresses"]["positions"] == feeds["positions"].data_ptr()
    # no tree: the [T, 0] mask is bound to the all-True buffer, never to a null pointer
    assert run["shapes"]["tree_mask"] == (20, 0) and run["addresses"]["tree_mask"] == session.all_true.data_ptr()


def test_profile_choice(tmp_path, ptx, monkeypatch):
    """MOCK TensorRT (fake_tensorrt): generation for decode and verify steps (<= 1 + 3 draft tokens per
    sequence), context otherwise, one profile switch per change; a step no profile holds is refused."""
    path, fake = _planned(tmp_path, ptx, monkeypatch)
    session, _ = _session(path, fake)
    ctx, gen = session.profiles.index("context"), session.profiles.index("generation")
    for lens, tree, want in (([1, 1, 1], False, gen), ([4, 4], True, gen), ([5], False, ctx), ([1, 1], False, gen),
                             ([4, 1], True, gen), ([30, 2, 1, 1], False, ctx)):
        feeds, meta = _step(lens, [20] * len(lens), tree)
        session.run(feeds, meta.max_query_len, stream=0)
        assert fake.executed[-1]["profile"] == want, (lens, tree)
    assert fake.called("set_optimization_profile_async") == [gen, ctx, gen, ctx]
    feeds, meta = _step([33, 32], [0, 0])
    with pytest.raises(EngineError, match=r"fits no optimization profile .*context: tokens=65 outside \[1, 64\]"):
        session.run(feeds, meta.max_query_len, stream=0)


def test_capture_and_shapes_refused(tmp_path, ptx, monkeypatch):
    """MOCK TensorRT (fake_tensorrt): capturing a layer the plan does not output, and a pool whose block
    size the plan does not have, are refused in one line."""
    path, fake = _planned(tmp_path, ptx, monkeypatch)
    session, _ = _session(path, fake)
    session.check_capture((0,))
    with pytest.raises(EngineError, match=r"capture of hidden layers \[1\]: the TensorRT plan outputs only \[0\]"):
        session.check_capture((0, 1))
    profiles = session.profiles
    feeds, _ = _step([3], [0])
    shapes = {n: tuple(t.shape) for n, t in feeds.items()}
    shapes.update({n: (12, 16, 2, 32) for n in profiles.inputs if "cache" in n})
    assert step_dims(profiles, shapes)["tokens"] == 3
    shapes["v_cache.1"] = (12, 8, 2, 32)
    with pytest.raises(EngineError, match=r"input v_cache.1: dim 1 is 8, the plan fixes it at 16"):
        step_dims(profiles, shapes)


def test_choose_profile_without_speculation(tmp_path, ptx):
    """No draft tokens: generation takes exactly one token per sequence and no tree (pure, no TensorRT)."""
    profiles = load_profiles(make_bundle(tmp_path / "engine", ptx, draft=0) / "tensorrt/profiles.json")
    base = {"seqs": 2, "seqs_plus_1": 3, "table": 9, "tree": 0, "blocks": 12}
    assert choose_profile(profiles, dict(base, tokens=2, rows=2), 1) == profiles.index("generation")
    assert choose_profile(profiles, dict(base, tokens=3, rows=2), 2) == profiles.index("context")
    with pytest.raises(EngineError, match="tree=2 outside"):
        choose_profile(profiles, dict(base, tokens=4, rows=2, tree=2), 2)
