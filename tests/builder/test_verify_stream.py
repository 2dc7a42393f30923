"""verify.path streamed (one decoder layer resident at a time) gives the whole-model comparison's figures.

On the real SmolLM2 fp8 bundle (fp8 weights, fp8 KV cache: the runtime formats the stream must run
as serving does) against the real HF checkpoint. Both paths run every prompt as one forward of the
same shapes, so the logits agree bit for bit today; the KL tolerance (1e-6 relative) allows only
fp32 summation-order differences, far below a quantization effect (fp8 costs ~0.06 nats here).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from backend.runtime.spec import EngineError, load_engine_spec
from builder.config import BuildConfig
from builder.stages import verify
from builder.stages.base import StageContext, StageResult

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "smollm2-135m-fp8.yaml"
# the fp8 bundle the quantized-bundle, batch-invariance and MLPerf tests already build (one cached build)
LIGHT = ["quantization.calibration.num_samples=4", "quantization.calibration.max_seq_len=64", "verify.enabled=false"]
PROMPTS = 2   # 2 of the 8 held-out prompts (31 positions): loading both models whole is most of the time


def _ctx(tmp_path: Path, overrides, compile_dir=None, import_dir=None) -> StageContext:
    cfg = BuildConfig.from_yaml(CONFIG, overrides=list(overrides))
    results = {"compile": StageResult("compile", "built", compile_dir, "k", {}),
               "import": StageResult("import", "built", import_dir, "k", {})}
    out = tmp_path / "verify.tmp"
    out.mkdir(parents=True)
    return StageContext(config=cfg, name="verify", root=tmp_path, out_dir=out, results=results, log=lambda m: None)


@pytest.mark.slow
def test_streamed_verify_equals_whole_on_smollm2(build_bundle, smollm2_hf_dir, tmp_path):
    bundle = Path(build_bundle("smollm2-135m-fp8", LIGHT))
    ctx = _ctx(tmp_path, [f"verify.num_prompts={PROMPTS}", "verify.path=streamed"], bundle, smollm2_hf_dir)
    streamed = verify.run(ctx)
    record = json.loads((ctx.out_dir / "verify.json").read_text())
    assert record["path"] == "streamed" and record["device"] == "cpu"   # auto, and no GPU here

    spec = load_engine_spec(bundle, {"max_kv_tokens": verify.MAX_PROMPT_TOKENS + 16})
    from backend.serving.conversion.tokenizer import load_tokenizer
    tok = load_tokenizer(bundle)
    prompts = [tok.encode(t)[:verify.MAX_PROMPT_TOKENS] for t in verify.load_prompts(PROMPTS)]
    agree, kl_sum, positions = verify.whole_compare(smollm2_hf_dir, spec, prompts, ctx.progress)

    assert streamed["num_positions"] == positions > 20
    assert round(streamed["top1_agreement"] * positions) == agree      # the exact count of agreeing positions
    assert streamed["mean_kl"] == pytest.approx(kl_sum / positions, rel=1e-6, abs=1e-6)  # rounded to 6 digits
    # a real comparison: fp8 moves the distributions, and the two paths saw it alike
    assert 0 < agree < positions and streamed["mean_kl"] > 1e-3


def test_path_auto_streams_only_above_the_threshold(tiny_llama_dir, tmp_path, monkeypatch):
    assert verify.choose_path(_ctx(tmp_path / "a", [], import_dir=tiny_llama_dir)) == "whole"
    assert verify.choose_path(_ctx(tmp_path / "b", ["verify.path=streamed"], import_dir=tiny_llama_dir)) == "streamed"
    monkeypatch.setattr(verify, "STREAM_ABOVE_BYTES", 0)
    ctx = _ctx(tmp_path / "c", [], import_dir=tiny_llama_dir)
    assert verify.choose_path(ctx) == "streamed"
    assert verify.memory_estimate(ctx).detail.startswith("streamed: one layer of ")
    assert verify.choose_path(_ctx(tmp_path / "d", ["verify.path=whole"], import_dir=tiny_llama_dir)) == "whole"


def test_streamed_estimate_does_not_grow_with_depth(tmp_path, smollm2_hf_dir):
    """The estimate reads one layer's size: a checkpoint twice as deep gets the same figure."""
    from harness.perf.lib.models import write_random_llama

    est = {}
    for layers in (2, 4):
        hf = write_random_llama(tmp_path / f"l{layers}", smollm2_hf_dir, hidden=64, layers=layers, heads=4,
                                kv_heads=2, intermediate=128)
        ctx = _ctx(tmp_path / f"c{layers}", ["verify.path=streamed"], import_dir=hf)
        est[layers] = verify.memory_estimate(ctx).host_bytes
    assert est[2] == est[4]
    whole = {n: verify.memory_estimate(_ctx(tmp_path / f"w{n}", ["verify.path=whole"], import_dir=tmp_path / f"l{n}"))
             for n in (2, 4)}
    assert whole[4].host_bytes > whole[2].host_bytes and "verify.path=streamed" in whole[2].advice


def test_bad_path_is_refused_and_the_default_keeps_build_hashes():
    from builder.config import ConfigError, _sha256_json
    with pytest.raises(ConfigError, match=r"verify\.path: invalid value 'layered'; allowed: auto \| whole \| streamed"):
        BuildConfig.from_yaml(CONFIG, ["verify.path=layered"])
    # added after bundles were built: auto leaves the hashes (and every cached build) as they were
    base = BuildConfig.from_yaml(CONFIG)
    d = base.to_dict()["verify"]
    del d["path"], d["device"]
    assert base.section_hash("verify") == _sha256_json(d)
    assert BuildConfig.from_yaml(CONFIG, ["verify.path=streamed"]).section_hash("verify") != _sha256_json(d)


@pytest.mark.slow
def test_layerwise_runner_refuses_the_fused_backend(build_bundle):
    """The stream runs decoder_layer (the torch backend's ops); the triton backend's fused kernels
    would compute other numbers than it, so it says so instead of running them."""
    from backend.runtime.layerwise import LayerwiseRunner

    spec = load_engine_spec(Path(build_bundle("smollm2-135m-fp8", LIGHT)), {"attention_backend": "triton"})
    with pytest.raises(EngineError, match="engine.attention_backend: triton .* allowed here: auto"):
        LayerwiseRunner(spec)


def test_verify_device_picks_the_gpu_only_when_there_is_one(monkeypatch):
    """verify.device auto runs the streamed comparison on a visible GPU, else the CPU; cuda without a
    GPU is refused naming the key, and a bad value is refused by the config."""
    import torch

    from builder.config import ConfigError
    from builder.stages.base import StageError
    assert verify.verify_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    assert verify.verify_device("cpu") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(StageError, match="verify.device: cuda, but no NVIDIA GPU is visible.*allowed here: auto, cpu"):
        verify.verify_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)   # what a GPU host answers
    assert verify.verify_device("auto") == "cuda" == verify.verify_device("cuda")
    with pytest.raises(ConfigError, match=r"verify\.device: invalid value 'gpu'; allowed: auto \| cpu \| cuda"):
        BuildConfig.from_yaml(CONFIG, ["verify.device=gpu"])
    # (its default leaving the build hashes as they were: test_bad_path_is_refused_and_the_default_keeps_build_hashes)
