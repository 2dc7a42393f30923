"""harness.perf.throughput.eagle's measurement loop on the CI-sized EAGLE bundle: interleaved repeats with
medians, every run checked token for token against plain decoding, batch > 1 only for the modes
asked for, and the CLI's refusal of unknown modes (the MT-bench download is not needed for these)."""
from __future__ import annotations

import statistics

import pytest

from harness.perf.throughput import eagle as bench


def test_measure_repeats_modes_round_robin_and_reports_medians(eagle_bundle, monkeypatch):
    from safetensors.torch import load_file
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(eagle_bundle / "tokenizer" / "tokenizer.json"))
    prompts = [tok.encode(t).ids for t in ("The capital of France is", "def add(a, b):")]
    order = []
    real = bench.MODES

    class Spy(dict):
        def __getitem__(self, k):
            order.append(k)
            return real[k]
    monkeypatch.setattr(bench, "MODES", Spy(real))
    res = bench.measure(eagle_bundle, load_file(str(eagle_bundle / "weights.safetensors")), prompts,
                        ["off", "chain4", "chain2"], [1, 2], {"chain4"}, max_tokens=6, dtype="float32", reps=2)
    assert set(res) == {"off@batch1", "chain4@batch1", "chain2@batch1", "off@batch2", "chain4@batch2"}
    assert order == ["chain4", "chain2", "chain4", "chain2", "chain4", "chain4"]  # round robin, not A A B B
    for key, r in res.items():
        assert r["identical_to_off"], key
        assert len(r["tokens_per_s_runs"]) == 2
        assert r["tokens_per_s"] == pytest.approx(statistics.median(r["tokens_per_s_runs"]), abs=0.01)
        assert r["generated_tokens"] == 2 * 6
    assert res["chain4@batch1"]["speedup_vs_off"] == pytest.approx(
        res["chain4@batch1"]["tokens_per_s"] / res["off@batch1"]["tokens_per_s"], abs=1e-3)
    assert res["chain4@batch1"]["draft_tokens_proposed"] > 0


def test_cli_refuses_unknown_modes_and_reps(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--modes", "chain4,chain9"])
    assert "unknown chain9" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--reps", "0"])
    assert "must be at least 1" in capsys.readouterr().err
