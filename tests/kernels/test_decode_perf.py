"""harness.perf.step.decode_perf (part perf of harness/gpucheck/device.sh) works before it reaches a GPU:
without one it refuses with status 2, and its --dry-run runs the whole script on a tiny model in the
interpreter (fused and unfused steps, the profile)."""
import pytest
import torch

from harness.perf.step import decode_perf


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_refuses_without_gpu(capsys):
    assert decode_perf.main(["--skip-tests"]) == 2
    assert "no NVIDIA GPU visible" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is the CPU stand-in")
def test_dry_run(tmp_path):
    out = tmp_path / "perf.json"
    assert decode_perf.main(["--dry-run", "--out", str(out)]) == 0
    import json
    res = json.loads(out.read_text())
    assert {"fused_b1", "unfused_b1", "speedup_b1", "profile_fused_b1", "profile_fused_b2"} <= set(res)
