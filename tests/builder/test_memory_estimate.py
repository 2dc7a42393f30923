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
