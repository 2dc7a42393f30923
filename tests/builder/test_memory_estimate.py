"""A stage whose peak-memory estimate exceeds the limit refuses before doing any work."""
from __future__ import annotations

import pytest

from builder.config import BuildConfig
from builder.pipeline import run_pipeline
from builder.stages.base import StageError


def test_quantize_refuses_over_the_limit_and_says_what_to_change(tiny_llama_dir, tmp_path):
    cfg = BuildConfig.from_yaml("configs/smollm2-135m-fp8.yaml", [f"model.source={tiny_llama_dir}"])
    lines: list[str] = []
    with pytest.raises(StageError) as err:
        run_pipeline(cfg, tmp_path / "out", until="quantize", log=lines.append, memory_limit=256 << 20)
    msg = str(err.value)
    assert msg.startswith("quantize: needs an estimated ") and "--memory-limit is 0.2 GiB" in msg
    assert "allowed: " in msg and "calibration" in msg
    assert any(line.startswith("[quantize] estimated peak memory: host ") for line in lines)
    assert not (tmp_path / "out" / "work" / "quantize").exists()
    assert (tmp_path / "out" / "work" / "import" / "stage.json").is_file()  # import has no model to hold


def test_estimates_are_printed_and_a_fitting_build_runs(tiny_llama_dir, tmp_path):
    cfg = BuildConfig.from_yaml("configs/smollm2-135m-fp8.yaml", [
        f"model.source={tiny_llama_dir}", "quantization.calibration.num_samples=2",
        "quantization.calibration.max_seq_len=32", "verify.enabled=false"])
    lines: list[str] = []
    result = run_pipeline(cfg, tmp_path / "out", until="compile", log=lines.append, memory_limit=64 << 30)
    for stage in ("quantize", "compile"):
        assert any(line.startswith(f"[{stage}] estimated peak memory: host ") and "--memory-limit 64.0 GiB; time ~"
                   in line and " on cpu (" in line for line in lines), stage
    from backend.bundle import load_bundle

    assert load_bundle(result.bundle).manifest.quantization.format == "fp8"

    # verify (a model this small takes the whole path: the fp32 reference beside the bundle) refuses
    # under a lowered limit and names the streamed path; the stages before it are cached, so their
    # estimates are not checked again
    cfg = BuildConfig.from_yaml("configs/smollm2-135m-fp8.yaml", [
        f"model.source={tiny_llama_dir}", "quantization.calibration.num_samples=2",
        "quantization.calibration.max_seq_len=32", "verify.enabled=true"])
    with pytest.raises(StageError, match=r"^verify: needs an estimated .*\(whole: .* allowed: verify.path=streamed .* or verify.enabled=false$"):
        run_pipeline(cfg, tmp_path / "out", until="verify", log=lines.append, memory_limit=256 << 20)
