"""The ``tensorrt`` config section and ``engine.runtime`` (#21): what they refuse, and that leaving them
off changes nothing (hash-neutral: the build key and engine.json of every other build are as before)."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from builder.config import BuildConfig, ConfigError

REPO = Path(__file__).resolve().parents[2]
FP8 = REPO / "configs" / "smollm2-135m-fp8.yaml"
BF16 = REPO / "configs" / "smollm2-135m-bf16.yaml"


def _cfg(path, *overrides):
    return BuildConfig.from_yaml(path, list(overrides))


@pytest.mark.parametrize("fmt", ["nvfp4", "int4_awq"])
def test_4bit_formats_take_the_tensorrt_target(fmt):
    """Their packed linears are kiln_w4a16_gemm nodes in the graph (tests/runtime/test_onnx_w4a16.py)."""
    cfg = _cfg(FP8, "tensorrt.enabled=true", f"quantization.format={fmt}", "engine.runtime=onnx-reference")
    assert cfg.tensorrt.enabled and cfg.quantization.format == fmt


def test_defaults_are_off_and_native():
    cfg = _cfg(FP8)
    assert cfg.tensorrt.enabled is False and cfg.engine.runtime == "native"
    assert cfg.tensorrt.workspace_gib == 8.0 and cfg.tensorrt.timing_cache is None


@pytest.mark.parametrize("overrides, match", [
    (["engine.runtime=onnx-reference"], r"engine\.runtime: onnx-reference runs the bundle's decoder graph.*"
                                        r"allowed: native, or tensorrt\.enabled=true"),
    (["engine.runtime=tensorrt"], r"engine\.runtime: tensorrt runs the bundle's decoder graph"),
    (["engine.runtime=vllm"], r"engine\.runtime.*allowed: native \| onnx-reference \| tensorrt"),
    (["tensorrt.enabled=true", "quantization.format=int8_sq"], r"tensorrt\.enabled: quantization\.format=int8_sq has "
                                                               r"no ONNX export yet.*allowed: false, or quantization"
                                                               r"\.format none \| fp8 \| int4_awq \| nvfp4$"),
    (["tensorrt.enabled=true", "quantization.format=w4a8_awq"], r"quantization\.format=w4a8_awq has no ONNX export"),
    (["tensorrt.enabled=true", "engine.tp_size=3"], r"tensorrt\.enabled: engine\.tp_size=3: the graph is exported "
                                                    r"for one device; allowed: false, or engine\.tp_size=1"),
    (["tensorrt.enabled=true", "tensorrt.workspace_gib=0"], r"tensorrt\.workspace_gib"),
])
def test_refusals_name_the_key_and_what_is_allowed(overrides, match):
    with pytest.raises(ConfigError, match=match):
        _cfg(FP8, *overrides)


def test_eagle_draft_exports_and_what_runs_it():
    """tensorrt.enabled with an EAGLE-3 draft builds (the draft becomes draft.onnx), also for the
    onnx-reference runtime with a chain; the TensorRT runtime (no draft plan) and other tree shapes on
    onnx-reference are refused at the build, one line naming the key and the allowed values."""
    eagle = REPO / "configs" / "smollm2-135m-bf16-eagle3.yaml"
    cfg = _cfg(eagle, "tensorrt.enabled=true")
    assert cfg.tensorrt.enabled and cfg.speculative.method == "eagle3" and cfg.engine.runtime == "native"
    assert _cfg(eagle, "tensorrt.enabled=true", "engine.runtime=onnx-reference").speculative.tree == "chain"
    with pytest.raises(ConfigError, match=r"engine\.runtime: tensorrt with speculative\.method=eagle3: the draft has "
                                          r"no plan yet; allowed: native or onnx-reference, or speculative\.method=none$"):
        _cfg(eagle, "tensorrt.enabled=true", "engine.runtime=tensorrt")
    with pytest.raises(ConfigError, match=r"speculative\.tree: dynamic with engine\.runtime=onnx-reference: "
                                          r"draft\.onnx runs chains only; allowed: chain, or engine\.runtime=native$"):
        _cfg(eagle, "tensorrt.enabled=true", "engine.runtime=onnx-reference", "speculative.tree=dynamic",
             "speculative.min_draft_prob=0")


def test_disabled_section_and_native_runtime_leave_every_hash_as_before():
    """The compile stage's engine.json ``hashes.config`` by the formula used before the section existed
    (its four sections, nothing else): a build without tensorrt gets the same value, so its engine.json
    and cache key are unchanged; enabling it (or another runtime) changes both."""
    def before(cfg):
        parts = {s: cfg.section_hash(s) for s in ("model", "quantization", "speculative", "engine")}
        return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()
    from builder.stages.compile import _engine_section, _sections_hash
    plain = _cfg(BF16, "tensorrt.workspace_gib=16")          # off: its other keys shape nothing either
    assert _sections_hash(plain, "compile") == before(plain)
    assert plain.config_hash() == _cfg(BF16).config_hash()
    assert "runtime" in _engine_section(plain)               # written as native, omitted by the manifest
    on = _cfg(BF16, "tensorrt.enabled=true")
    assert _sections_hash(on, "compile") != before(on) and on.config_hash() != plain.config_hash()
    graph = _cfg(BF16, "tensorrt.enabled=true", "engine.runtime=onnx-reference")
    assert graph.section_hash("engine") != on.section_hash("engine")
