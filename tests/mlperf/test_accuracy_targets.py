"""Accuracy targets as data: levels, lower/upper limits, missing metrics."""
from harness.mlperf.accuracy import check_targets, compute_metrics
from harness.mlperf.settings import load_accuracy_targets

TARGETS = load_accuracy_targets()


def test_llama2_levels_and_tokens_per_sample_window():
    t = TARGETS["llama2-70b"]
    ok = {"rouge1": 44.2, "rouge2": 22.0, "rougeL": 28.6, "tokens_per_sample": 290.0}
    v = check_targets(ok, t)
    # 44.2 >= 0.99 * 44.4312 = 43.99 but < 0.999 * 44.4312 = 44.387: passes 99, fails 99.9
    assert v["99"] == [] and any(f.startswith("rouge1") for f in v["99.9"])
    too_long = dict(ok, tokens_per_sample=294.45 * 1.11)
    assert any("tokens_per_sample" in f and ">" in f for f in check_targets(too_long, t)["99"])
    too_short = dict(ok, tokens_per_sample=294.45 * 0.89)
    assert any("tokens_per_sample" in f and "<" in f for f in check_targets(too_short, t)["99"])


def test_llama31_gen_len_and_missing_metric():
    t = TARGETS["llama3.1-8b"]
    m = {"rouge1": 38.8, "rouge2": 15.91, "rougeL": 24.5, "rougeLsum": 35.8, "gen_len": 8167644}
    assert check_targets(m, t) == {"99": [], "99.9": []}
    del m["rougeLsum"]
    assert check_targets(m, t)["99"] == ["rougeLsum not computed"]


def test_metrics_per_benchmark_kind():
    m = compute_metrics("rouge_tokens_per_sample", ["a b c", "d"], ["a b c", "d"], [3, 1])
    assert "rougeLsum" not in m and m["rouge1"] == 100.0
    # gen_len is total characters ("a b c" = 5, "d" = 1), as llama3.1-8b's reference script counts
    assert (m["tokens_per_sample"], m["gen_len"], m["gen_num"]) == (2.0, 6, 2)
    m = compute_metrics("rouge_vs_reference", ["x"], [None], [1])
    assert "rouge1" not in m and m["gen_num"] == 1
    assert check_targets({"rougeL": 41.0}, TARGETS["smollm2"]) == {"default": []}
