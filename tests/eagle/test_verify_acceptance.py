"""The build's verify stage measures the EAGLE-3 draft on held-out prompts and records the figures in
engine.json (real pipeline, real SmolLM2 bundle, CI-sized draft trained by ModelOpt)."""
import json

import pytest

from builder.config import BuildConfig
from builder.pipeline import run_pipeline
from builder.stages import verify as verify_stage
from builder.stages.base import StageContext
from tests.conftest import REPO
from tests.eagle.conftest import eagle_overrides


@pytest.mark.slow
def test_verify_stage_records_acceptance_in_engine_json(eagle_bundle):
    # The verify section is not part of the bundle: re-running the pipeline with verify on, into the
    # shared bundle's folder, reuses its draft and compile stages and runs only verify (and package).
    cfg = BuildConfig.from_yaml(REPO / "configs" / "smollm2-135m-bf16-eagle3.yaml", eagle_overrides(verify=True))
    result = run_pipeline(cfg, eagle_bundle.parent, log=lambda m: None)
    assert result.results["draft"].status == "cached" and result.results["compile"].status == "cached"
    assert result.results["verify"].status in ("built", "cached")
    bundle = result.bundle
    doc = json.loads((bundle / "engine.json").read_text())
    v = doc["verify"]
    assert v["passed"] is True and v["num_prompts"] == 2     # the accuracy gate still ran
    acc = v["speculative"]
    assert acc["num_prompts"] == 2 and acc["max_tokens"] == verify_stage.ACCEPT_TOKENS
    assert acc["tree"] == doc["speculative"]["tree"] and doc["speculative"]["min_draft_prob"] == 0.0
    assert acc["draft_tokens_proposed"] > 0 and acc["spec_verify_steps"] > 0
    assert 0 <= acc["draft_tokens_accepted"] <= acc["draft_tokens_proposed"]
    # Tokens per verifying pass: the bonus token plus the accepted drafts, at most 1 + max_draft_len.
    assert 1.0 <= acc["mean_acceptance_length"] <= 1 + doc["speculative"]["max_draft_len"]
    assert acc["spec_undrafted_steps"] == 0 and acc["tokens_per_target_pass"] == acc["mean_acceptance_length"]
    assert acc["acceptance_rate"] == pytest.approx(acc["draft_tokens_accepted"] / acc["draft_tokens_proposed"],
                                                   abs=1e-4)
    assert sum(acc["accepted_per_step_histogram"].values()) == acc["spec_verify_steps"]
    # The same figures the stage wrote in its own output folder.
    stage_out = bundle.parent / "work" / "verify" / "verify.json"
    assert json.loads(stage_out.read_text())["speculative"] == acc


def test_no_acceptance_figures_without_a_draft(tmp_path):
    cfg = BuildConfig.from_yaml(REPO / "configs" / "smollm2-135m-bf16.yaml")
    ctx = StageContext(config=cfg, name="verify", root=tmp_path, out_dir=tmp_path, results={})
    assert verify_stage.draft_acceptance(ctx, tmp_path, ["unused"], None) is None
