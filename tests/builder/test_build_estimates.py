"""Time estimates per stage (builder/estimates.py) and the offline per-config table (builder/estimate.py).

The formulas are fitted to committed measurements; these tests keep them tied: the estimate for the
measured random Llamas must land near docs/perf's seconds, grow with depth, and the tables written
into the 70B/8B configs and docs/build-at-scale.md must be what `python -m builder.estimate` prints.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from builder import estimate, estimates
from builder.config import BuildConfig

REPO = Path(__file__).resolve().parents[2]
PERF = REPO / "docs" / "perf"
SCALE_CONFIGS = ("llama70b-fp8", "llama3.1-8b-fp8", "llama3.1-8b-nvfp4", "qwen3-8b-fp8", "qwen3-32b-fp8",
                 "gemma3-27b-fp8")
# the random Llamas of docs/perf/build-memory*.json (hidden 2048), as header-only checkpoints
MEASURED_SHAPE = dict(estimate.SHAPES["llama-3.1-8b"], hidden_size=2048, intermediate_size=5632,
                      num_attention_heads=16, num_key_value_heads=4, vocab_size=49152)


def _light_cfg(*extra):
    return BuildConfig.from_yaml(REPO / "configs" / "smollm2-135m-fp8.yaml", [
        "quantization.calibration.num_samples=8", "quantization.calibration.max_seq_len=256", *extra])


def test_estimates_grow_with_depth(tmp_path, smollm2_hf_dir):
    from harness.perf.lib.models import write_random_llama

    cfg = _light_cfg()
    t = {}
    for layers in (2, 4):
        hf = write_random_llama(tmp_path / f"l{layers}", smollm2_hf_dir, hidden=64, layers=layers, heads=4,
                                kv_heads=2, intermediate=128)
        t[layers] = [estimates.quantize_time(hf, cfg.quantization, cuda=False),
                     estimates.quantize_time(hf, cfg.quantization, cuda=True),
                     estimates.compile_time(hf), estimates.verify_time(hf, "whole", 8),
                     estimates.verify_time(hf, "streamed", 8)]
    for shallow, deep in zip(t[2], t[4]):
        assert deep.seconds > shallow.seconds > 0, (shallow, deep)
    assert t[2][1].device == "cuda" and t[2][0].device == "cpu"


@pytest.mark.parametrize("layers", [12, 24])
def test_estimates_reproduce_the_measured_stage_seconds(tmp_path, layers):
    """Within 20% of docs/perf/build-memory-verify.json (the run the constants were fitted to)."""
    hf = estimate.header_checkpoint(dict(MEASURED_SHAPE, num_hidden_layers=layers), tmp_path / "hf")
    measured = json.loads((PERF / "build-memory-verify.json").read_text())["models"][str(layers)]
    # the same shape as measured (its bytes count the safetensors headers too)
    assert estimates._shape(hf)[0] * 2 == pytest.approx(measured["checkpoint_bf16_bytes"], rel=1e-4)

    def built_s(stage):  # the pipeline's own figure, "<stage> built <s>" / "[verify] built in <s> s"
        tail = " ".join(measured["stages"][stage]["log_tail"])
        return float(re.search(rf"(?:{stage}\s+built|\[{stage}\] built in)\s+([\d.]+)", tail).group(1))

    cfg = _light_cfg("verify.path=streamed")
    got = {"quantize": estimates.quantize_time(hf, cfg.quantization, cuda=False).seconds,
           "compile": estimates.compile_time(hf).seconds,
           "verify": estimates.verify_time(hf, "streamed", 8).seconds}
    for stage, seconds in got.items():
        assert seconds == pytest.approx(built_s(stage), rel=0.2), stage


def test_gpu_quantize_estimate_reproduces_the_h100_run(tmp_path):
    run = json.loads((PERF / "quant-gpu-h100.json").read_text())
    hf = estimate.header_checkpoint(estimate.SHAPES["llama-3.1-8b"], tmp_path / "hf")
    cfg = _light_cfg()   # 8 samples of 256 tokens, as on the H100
    est = estimates.quantize_time(hf, cfg.quantization, cuda=True)
    assert est.seconds == pytest.approx(run["phases"]["quantize"]["seconds"], rel=0.1)
    assert est.detail.startswith("streamed: 32 layers x 218 M parameters")


def test_the_pipeline_prints_the_time_of_a_stage_without_a_memory_estimate(tiny_llama_dir, tmp_path):
    from builder.pipeline import run_pipeline

    cfg = BuildConfig.from_yaml(REPO / "configs" / "smollm2-135m-fp8.yaml", [f"model.source={tiny_llama_dir}"])
    lines: list[str] = []
    run_pipeline(cfg, tmp_path / "out", until="import", log=lines.append)
    assert any(line.startswith("[import] estimated time ~") and " on cpu (sha256 of " in line for line in lines), lines


def test_scale_configs_and_docs_carry_the_estimator_output():
    doc = (REPO / "docs" / "build-at-scale.md").read_text()
    for name in SCALE_CONFIGS:
        path = REPO / "configs" / f"{name}.yaml"
        block = "\n".join(estimate.estimate(str(path), ["h200", "8xh100"], prefix="# "))
        assert block in path.read_text(), f"{path}: rerun python -m builder.estimate {path} --comment"
        plain = "\n".join(estimate.estimate(str(path), ["h200", "8xh100"]))
        assert plain in doc, f"docs/build-at-scale.md: rerun python -m builder.estimate {path}"
    # the 70B FP8 engine fits one H200 and not one H100, and two H100s with tensor parallelism (#20)
    cfg = str(REPO / "configs/llama70b-fp8.yaml")
    h200, h100 = (estimate.estimate(cfg, [d]) for d in ("h200", "8xh100"))
    assert h200[-1].endswith("fits one GPU") and h100[-1].endswith("too little: build with engine.tp_size 2")
    tp2 = estimate.estimate(cfg, ["8xh100"], overrides=["engine.tp_size=2"])
    assert tp2[-1].endswith("fits 2 GPUs (engine.tp_size 2)") and "~35 GB of fp8 weights per GPU" in tp2[-1]


def test_estimate_cli_refuses_an_unknown_shape(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text((REPO / "configs" / "llama3.1-8b-fp8.yaml").read_text().replace(
        "checkpoints/Llama-3.1-8B-Instruct", "checkpoints/Some-Other-Model"))
    with pytest.raises(SystemExit, match="names no known shape; allowed: --shape llama-2-70b"):
        estimate.main([str(cfg)])
    assert estimate.main([str(cfg), "--shape", "llama-3.1-8b", "--device", "cpu"]) == 0
    assert "quantize" in capsys.readouterr().out


@pytest.mark.parametrize("name,billions", [("qwen3-8b", 8.19), ("qwen3-32b", 32.76), ("llama-3.1-8b", 8.03),
                                           ("llama-2-70b", 68.98), ("gemma3-27b", 27.01)])
def test_header_checkpoints_hold_each_familys_tensors_and_the_published_size(tmp_path, name, billions):
    # the parameter count of each shape's published checkpoint (model cards: 8.2B, 32.8B, 8.0B, 69B; Gemma 3
    # 27B's 27.4B less its SigLIP vision tower and projector, ~0.42B, which the import leaves out)
    from safetensors import safe_open

    hf = estimate.header_checkpoint(estimate.SHAPES[name], tmp_path)
    shapes = {}
    for f in hf.glob("*.safetensors"):
        with safe_open(str(f), "pt") as s:
            shapes.update({k: s.get_slice(k).get_shape() for k in s.keys()})
    total = sum(math.prod(v) for v in shapes.values())
    assert abs(total / 1e9 - billions) < 0.01, total
    assert ("model.layers.0.self_attn.q_norm.weight" in shapes) == name.startswith(("qwen3", "gemma3"))
    assert ("model.layers.0.pre_feedforward_layernorm.weight" in shapes) == name.startswith("gemma3")
    if name.startswith(("qwen3", "gemma3")):
        assert shapes["model.layers.0.self_attn.q_norm.weight"] == [128]


def test_kv_room_counts_one_replicated_kv_head_per_gpu():
    """Llama-3.1-8B's 8 KV heads over 16 GPUs: each holds one (replicated on two), as at 8 GPUs, so the
    KV room per GPU is about tp_size 8's (a little more: half the weights), not a division by 8 // 16 = 0."""
    cfg = str(REPO / "configs/llama3.1-8b-fp8.yaml")
    room = [int(re.search(r"KV room ~(\d+)k tokens", estimate.estimate(cfg, ["8xh100"], overrides=[
        f"engine.tp_size={tp}"])[-1])[1]) for tp in (8, 16)]
    assert room[0] <= room[1] < 1.02 * room[0]
