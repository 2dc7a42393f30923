"""harness.perf.step.eagle_cost: the per-pass cost of k drafts, measured through the real executor and
speculator (on CPU here; the --llama8b run needs a GPU), and the projection from a bench result."""
from __future__ import annotations

import json

import pytest
import torch

from harness.perf.lib import models
from harness.perf.step import eagle_cost as cost

TINY = dict(models.LLAMA31_8B, hidden_size=128, intermediate_size=256, num_layers=4, num_heads=4,
            num_kv_heads=2, head_dim=32, vocab_size=512, max_position_embeddings=512)


@pytest.fixture()
def tiny(tmp_path):
    """A Llama-3.1-shaped FP8 target and a random EAGLE-3 head, both tiny (what --llama8b builds)."""
    from backend.engine.executor import Executor
    engine = {"max_batch_size": 4, "max_num_tokens": 256, "max_seq_len": 128, "max_input_len": 64,
              "kv_block_size": 16, "kv_cache_dtype": "fp8_e4m3", "max_kv_tokens": 2048}
    ex = Executor(models.manifest_bundle(TINY, engine, tmp_path / "engine"), device="cpu",
                  weights=models.synthetic_fp8_weights(TINY, device="cpu"), verify_hashes=False, start=False)
    cfg, t = models.random_draft(TINY, 128)
    assert cfg.aux_layers == (0, 1)  # EAGLE-3's early/middle/late rule on 4 layers
    assert t["fc.weight"].shape == (128, len(cfg.aux_layers) * 128) and t["lm_head.weight"].shape == (128, 128)
    yield ex, cost.attach_draft(ex, cfg, t)
    ex.shutdown()


def test_every_pass_drafts_exactly_k_and_plain_is_the_baseline(tiny):
    ex, draft = tiny
    rows = cost.step_costs(ex, draft, (0, 1, 3), prompt_len=12, new_tokens=40, reps=1)
    by_k = {r["draft_len"]: r for r in rows}
    assert by_k[0]["cost_vs_plain"] == 1.0 and by_k[0]["drafted_per_step"] == 0
    # A random head's drafts are (almost) never accepted, so (almost) every pass is a full verify of
    # k drafts; only the last passes of a stream may draft fewer (few tokens left).
    assert 0.9 <= by_k[1]["drafted_per_step"] <= 1.0
    assert 2.7 <= by_k[3]["drafted_per_step"] <= 3.0
    assert all(r["ms_per_pass"] > 0 for r in rows)
    assert by_k[3][f"tokens_per_pass_for_{cost.GOAL}x"] == pytest.approx(cost.GOAL * by_k[3]["cost_vs_plain"], rel=1e-3)
    assert ex.speculator is None  # the executor is handed back as it was


def test_acceptance_from_a_chain_histogram(tmp_path):
    doc = {"modes": {"chain4": {"tree": "chain", "max_draft_len": 4, "min_draft_prob": 0.0},
                     "chain4p35": {"tree": "chain", "max_draft_len": 4, "min_draft_prob": 0.35}},
           "results": {"chain4@batch1": {"accepted_per_step_histogram": {"0": 6, "1": 2, "4": 2}},
                       "chain4p35@batch1": {"accepted_per_step_histogram": {"4": 10}}}}
    path = tmp_path / "eagle3.json"
    path.write_text(json.dumps(doc))
    acc, mode = cost.chain_acceptance(path)
    assert mode == "chain4"  # the cut chain's drafts depend on its threshold: not used
    # k=2: min(accepted, 2) = 0,1,2 with weights 6,2,2 -> 1 + 6/10
    assert acc == pytest.approx({0: 1.0, 1: 1.4, 2: 1.6, 3: 1.8, 4: 2.0})
    rows = [{"draft_len": 0, "cost_vs_plain": 1.0}, {"draft_len": 2, "cost_vs_plain": 1.25},
            {"draft_len": 6, "cost_vs_plain": 1.5}]
    cost.project(rows, acc)
    assert rows[1]["projected_speedup"] == pytest.approx(1.6 / 1.25) and "projected_speedup" not in rows[2]
    doc["modes"].pop("chain4")
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="no chain mode without min_draft_prob"):
        cost.chain_acceptance(path)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: --llama8b would run")
def test_cli_refuses_llama8b_without_a_gpu(capsys):
    assert cost.main(["--llama8b"]) == 2
    assert "needs an NVIDIA GPU" in capsys.readouterr().err


def test_cli_refuses_draft_lens_without_the_baseline(capsys):
    with pytest.raises(SystemExit):
        cost.main(["--llama8b", "--draft-lens", "1,2"])
    assert "must start with 0" in capsys.readouterr().err


@pytest.mark.parametrize("random_head", [False, True])
def test_cli_on_the_eagle_bundle(eagle_bundle, tmp_path, random_head):
    out = tmp_path / "cost.json"
    assert cost.main(["--engine", str(eagle_bundle), "--device", "cpu", "--dtype", "float32", "--draft-lens", "0,2",
                      "--reps", "1", "--new-tokens", "12", "--prompt-len", "16", "--acceptance", "",
                      "--out", str(out)] + (["--random-draft"] if random_head else [])) == 0
    res = json.loads(out.read_text())
    assert res["draft"] == ("random EAGLE-3 head of the target's shape" if random_head else "the bundle's trained draft")
    assert [r["draft_len"] for r in res["costs"]] == [0, 2]
    assert res["costs"][1]["drafted_per_step"] > 0


def test_breakdown_puts_the_draft_in_propose_and_the_forward_in_target(tiny):
    ex, draft = tiny
    rows = cost.step_costs(ex, draft, (0, 2), prompt_len=12, new_tokens=16, reps=1, breakdown=True)
    plain, spec = (r["parts_ms_per_pass"] for r in rows)
    assert set(plain) == set(cost._PartTimer.PARTS) | {"other"}
    assert plain["target"] > 0 and plain["propose"] == plain["verify"] == 0   # no speculator attached
    assert spec["target"] > 0 and spec["propose"] > 0 and spec["verify"] > 0
    # the parts are inside the pass: what is left ("other": scheduling, sampling) cannot be negative
    assert plain["other"] >= -0.01 and spec["other"] >= -0.01
    assert "execute" not in vars(ex.runner), "the timers are removed after the stream"
