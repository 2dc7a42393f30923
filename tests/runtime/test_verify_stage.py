"""builder/stages/verify.py: metrics, thresholds and the gate on the real SmolLM2."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from builder.config import BuildConfig
from builder.stages import verify
from builder.stages.base import StageContext, StageError, StageResult

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "smollm2-135m-fp8.yaml"


def _ctx(tmp_path, overrides=(), compile_dir=None, import_dir=None):
    cfg = BuildConfig.from_yaml(CONFIG, overrides=list(overrides))
    results = {"compile": StageResult("compile", "built", compile_dir, "k", {}),
               "import": StageResult("import", "built", import_dir, "k", {})}
    out = tmp_path / "verify.tmp"
    out.mkdir(parents=True)
    return StageContext(config=cfg, name="verify", root=tmp_path, out_dir=out, results=results,
                        log=lambda m: None)


def test_compare_counts_agreement_and_kl():
    # Its own generator: drawn from the global one, the logits followed whatever earlier tests left
    # in it, and a flat row 0 made the flipped row's KL as small as 0.43 (failed in one ordering).
    # Peaked rows (x4) make flipping one a large move for any seed.
    ref = torch.randn(6, 20, generator=torch.Generator().manual_seed(0)) * 4
    agree, kl, n = verify.compare(ref, ref.clone())
    assert (agree, n) == (6, 6) and abs(kl) < 1e-6
    other = ref.clone()
    other[0] = -other[0]  # flips the argmax of row 0 and moves its distribution a lot
    agree, kl, n = verify.compare(ref, other)
    assert agree == 5 and kl > 0.5


def test_thresholds_default_per_format_and_overrides(tmp_path):
    assert verify.thresholds(_ctx(tmp_path), "fp8") == verify.DEFAULT_THRESHOLDS["fp8"]
    ctx = _ctx(tmp_path / "b", ["verify.min_top1_agreement=0.5", "verify.max_mean_kl=1.0"])
    assert verify.thresholds(ctx, "nvfp4") == (0.5, 1.0)
    with pytest.raises(StageError, match="verify: no default thresholds for quantization.format 'fp6'"):
        verify.thresholds(_ctx(tmp_path / "c"), "fp6")


def test_skip_when_disabled(tmp_path):
    assert verify.skip_reason(_ctx(tmp_path, ["verify.enabled=false"])) == "verify.enabled is false"
    assert verify.skip_reason(_ctx(tmp_path / "b")) is None


@pytest.mark.slow
def test_unquantized_bundle_passes_and_garbage_fails(tmp_path, smollm2_bundle, smollm2_hf, monkeypatch):
    ctx = _ctx(tmp_path, ["verify.num_prompts=2"], smollm2_bundle, smollm2_hf)
    info = verify.run(ctx)
    # Same weights; only compute precision may differ (fp32 on CPUs without native bf16: exact).
    assert info["passed"] and info["top1_agreement"] >= 0.95 and info["mean_kl"] < 0.02
    assert info["num_prompts"] == 2 and info["num_positions"] > 20
    assert (ctx.out_dir / "verify.json").is_file()

    monkeypatch.setattr(verify, "prefill_logits", lambda runner, ids: torch.randn(len(ids), 49152))
    bad = verify.run(_ctx(tmp_path / "bad", ["verify.num_prompts=2"], smollm2_bundle, smollm2_hf))
    assert bad["passed"] is False and bad["top1_agreement"] < 0.2
