"""Two builds of one config and checkpoint are the same bytes: the engine's weights, engine.json, the
tokenizer and the Triton model repository, with ``SOURCE_DATE_EPOCH`` fixing the times they record.
What may differ is only what a build measures about itself, each stage's durations (the records'
``seconds`` and the quantize stage's ``*_s`` phase times).

This is how a change meant to leave engines alone (a refactor) is checked: build before and after
and compare the same way. Real SmolLM2, quantized FP8 with an FP8 KV cache by ModelOpt (the default
config's format), so calibration and export are covered, not only the copy of bf16 weights."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from builder.config import BuildConfig
from builder.pipeline import run_pipeline
from builder.stages.base import StageError, build_time

pytestmark = pytest.mark.slow
EPOCH = 1764633600           # 2025-12-02T00:00:00Z


def durations_apart(a, b, where: str = "") -> list[str]:
    """The leaves where JSON values ``a`` and ``b`` differ, other than measured durations."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{where}.{k}" for k in sorted(set(a) ^ set(b))]
        for k in sorted(set(a) & set(b)):
            if not (k == "seconds" or k.endswith("_s")) or not isinstance(a[k], (int, float)):
                out += durations_apart(a[k], b[k], f"{where}.{k}")
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in durations_apart(x, y, f"{where}[{i}]")]
    return [] if a == b else [where or "."]


def differences(a: Path, b: Path) -> list[str]:
    files_a = {p.relative_to(a).as_posix() for p in a.rglob("*") if p.is_file()}
    files_b = {p.relative_to(b).as_posix() for p in b.rglob("*") if p.is_file()}
    out = [f"only in one build: {f}" for f in sorted(files_a ^ files_b)]
    for rel in sorted(files_a & files_b):
        x, y = (a / rel).read_bytes(), (b / rel).read_bytes()
        if x == y:
            continue
        if rel.endswith(".json"):
            out += [f"{rel}: {leaf}" for leaf in durations_apart(json.loads(x), json.loads(y))]
        else:
            out.append(f"{rel}: bytes differ")
    return out


def test_two_builds_are_the_same_bytes(smollm2_hf_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", str(EPOCH))
    overrides = [f"model.source={smollm2_hf_dir}", "quantization.format=fp8", "quantization.kv_cache=fp8",
                 "quantization.calibration.num_samples=8", "verify.enabled=false"]
    for name in ("a", "b"):
        run_pipeline(BuildConfig.from_dict({}, "test.yaml", overrides), tmp_path / name, log=lambda m: None)
    a, b = tmp_path / "a", tmp_path / "b"
    assert differences(a, b) == []
    manifest = json.loads((a / "engine" / "engine.json").read_text())
    assert manifest["created"] == "2025-12-02T00:00:00+00:00"
    assert manifest["quantization"]["format"] == "fp8"
    # the comparison sees what it must: a changed weight byte, a changed record field
    weights = next((a / "engine").glob("*.safetensors"))
    raw = bytearray(weights.read_bytes())
    raw[-1] ^= 1
    weights.write_bytes(bytes(raw))
    stage = json.loads((b / "engine" / "stage.json").read_text())
    stage["seconds"] += 1.0                       # a duration: allowed to differ
    stage["key"] = "other"                        # not a duration
    (b / "engine" / "stage.json").write_text(json.dumps(stage))
    assert differences(a, b) == ["engine/stage.json: .key", f"engine/{weights.name}: bytes differ"]


def test_source_date_epoch_is_checked(monkeypatch):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "yesterday")
    with pytest.raises(StageError, match="SOURCE_DATE_EPOCH='yesterday': not a whole number of seconds"):
        build_time()
    monkeypatch.setenv("SOURCE_DATE_EPOCH", str(EPOCH))
    assert build_time().isoformat() == "2025-12-02T00:00:00+00:00"
    monkeypatch.delenv("SOURCE_DATE_EPOCH")
    assert build_time().year >= 2026
