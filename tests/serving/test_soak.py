"""``make soak`` at a CI size: the real server under mixed load with cancels and malformed requests.

The full run (1,000 requests at concurrency 64) is ``make soak``; here 48 requests at concurrency 12
with 25% cancelled and 10% malformed, the KV pool at 1/8 of demand. The tool itself judges the run:
every completed text equal to the prompt alone, every malformed request refused, no hang, the pool
and the stubs' threads back to idle, the server up and giving the same text afterwards."""
from __future__ import annotations

import json

import pytest

from harness.perf import soak
from harness.model_names import DEFAULT as NAMES

pytestmark = [pytest.mark.slow, pytest.mark.server]


def test_soak_passes_at_ci_size(tmp_path, smollm2_hf_dir):
    out = tmp_path / "soak.json"
    # the shared SmolLM2 import, as every test build links it (tests/conftest.py): same model section
    (tmp_path / "build" / "work").mkdir(parents=True)
    (tmp_path / "build" / "work" / "import").symlink_to(smollm2_hf_dir, target_is_directory=True)
    code = soak.main(["--requests", "48", "--concurrency", "12", "--cancel-fraction", "0.25",
                      "--malformed-fraction", "0.1", "--max-tokens", "12", "--deadline", "240",
                      "--output", str(tmp_path / "build"), "--out", str(out),
                      # a light calibration: the soak judges serving, not the quantization's quality
                      "--override", "quantization.calibration.num_samples=4",
                      "--override", "quantization.calibration.max_seq_len=64"])
    doc = json.loads(out.read_text())
    assert code == 0, json.dumps({k: doc[k] for k in ("checks", "outcomes", "failures")}, indent=1)
    kinds = {k.split(":")[0] for k in doc["outcomes"]}
    assert kinds == {"plain", "cancel", "malformed"}  # the seeded plan exercised every kind
    assert doc["kv_pool_tokens"] * 8 <= doc["kv_demand_tokens"] + 16 * 8


def test_kv_pool_is_a_fraction_of_demand_but_fits_one_request():
    assert soak.kv_tokens(64, 32, 0.125) == 768
    assert soak.kv_tokens(1, 32, 0.125) == soak.PROMPT_BUDGET + 32 + 16
    assert soak.kv_tokens(64, 32, 0.125) % 16 == 0


def test_plan_is_seeded_and_mixes_kinds():
    args = soak.parse_args(["--requests", "200", "--seed", "3"])
    a, b = soak.plan(args), soak.plan(args)
    assert a == b
    assert sum(r["kind"] == "cancel" for r in a) == 20      # the default 10%, exactly
    assert sum(r["kind"] == "malformed" for r in a) == 10   # the default 5%
    assert soak.plan(soak.parse_args(["--requests", "200", "--seed", "4"])) != a
    assert {r["model"] for r in a if r["kind"] == "cancel"} == {NAMES.bls, NAMES.engine}
