"""Acceptance figures and speculation metrics without a server: tensors, parsing, pass-through.

The end-to-end behaviour (real server, real draft, counts equal to the executor's) is in
test_spec_serving.py; these pin the pure pieces and their error messages.
"""
from __future__ import annotations

import json
import types

import numpy as np
import pytest

from backend import bundle
from backend.serving.metrics.acceptance import ACCEPTANCE_OUTPUTS, acceptance_tensors, draft_counts, read_acceptance
from backend.serving.conversion.convert import EngineLimits, InvalidRequest
from backend.serving.engine_model.engine_request import parse_engine_request
from backend.serving.metrics.metrics import ServingMetrics, stats_counters, stats_gauges
from backend.serving.text_models.postprocess import postprocess_tensors
from backend.serving.text_models.preprocess import Preprocessor, preprocessing_outputs
from tests.serving.test_convert import MANIFEST

LIMITS = EngineLimits(max_input_len=32, max_seq_len=64)


def test_tensors_have_tensorrtllm_backend_names_dtypes_and_shapes():
    t = acceptance_tensors(proposed=8, accepted=3)
    assert list(t) == list(ACCEPTANCE_OUTPUTS)
    assert t["acceptance_rate"].dtype == np.float32 and t["acceptance_rate"].shape == (1,)
    assert t["acceptance_rate"][0] == pytest.approx(0.375)
    assert t["total_accepted_draft_tokens"].dtype == np.int32 and t["total_accepted_draft_tokens"].tolist() == [3]
    assert t["total_draft_tokens"].dtype == np.int32 and t["total_draft_tokens"].tolist() == [8]
    # nothing drafted: a rate of 0, not a division by zero
    assert acceptance_tensors(0, 0)["acceptance_rate"].tolist() == [0.0]


def test_read_back_from_tensors_batched_shapes_and_http_json():
    want = {"acceptance_rate": pytest.approx(0.5), "total_accepted_draft_tokens": 2, "total_draft_tokens": 4}
    assert read_acceptance(acceptance_tensors(4, 2)) == want
    batched = {k: v[None] for k, v in acceptance_tensors(4, 2).items()}  # [1, 1] from batching clients
    assert read_acceptance(batched) == want
    body = json.loads('{"text_output": "x", "acceptance_rate": 0.5, "total_accepted_draft_tokens": 2,'
                      ' "total_draft_tokens": [4]}')  # HTTP generate: scalars or lists
    assert read_acceptance(body) == want
    assert read_acceptance({"text_output": np.array([b"x"], dtype=object)}) is None
    prefixed = {"out_" + k: v for k, v in acceptance_tensors(4, 2).items()}
    assert read_acceptance(prefixed, prefix="out_") == want


def test_read_refuses_a_partial_or_multi_valued_set():
    partial = acceptance_tensors(4, 2)
    del partial["total_draft_tokens"]
    with pytest.raises(ValueError, match="not total_draft_tokens; the three acceptance outputs travel together"):
        read_acceptance(partial)
    wide = dict(acceptance_tensors(4, 2), total_draft_tokens=np.array([4, 5], np.int32))
    with pytest.raises(ValueError, match=r"output 'total_draft_tokens': expected one value, got shape \[2\]"):
        read_acceptance(wide)


def test_draft_counts_of_an_executor_without_a_speculator_are_zero():
    assert draft_counts(types.SimpleNamespace(speculator=None), "r1") == (0, 0)
    assert draft_counts(object(), "r1") == (0, 0)


def test_engine_request_flag_default_value_and_dtype(text_tokenizer):
    base = {"input_ids": np.array([1, 2, 3], np.int32)}
    assert parse_engine_request(base, LIMITS, 49152, text_tokenizer).return_perf_metrics is False
    on = dict(base, return_perf_metrics=np.array([True]))
    assert parse_engine_request(on, LIMITS, 49152, text_tokenizer).return_perf_metrics is True
    with pytest.raises(InvalidRequest, match="input 'return_perf_metrics': wrong dtype int32; expected BOOL"):
        parse_engine_request(dict(base, return_perf_metrics=np.array([1], np.int32)), LIMITS, 49152,
                             text_tokenizer)


def test_preprocessing_always_asks_the_engine_but_bls_passes_the_clients_choice(tokenizer_dir, tmp_path):
    bundle.write(tmp_path, MANIFEST)
    (tmp_path / "tokenizer").symlink_to(tokenizer_dir)
    prep = Preprocessor(tmp_path).prepare({"text_input": np.array([b"Hi"], dtype=object)})
    assert prep.engine_tensors()["return_perf_metrics"].tolist() == [False]   # bls: not asked
    assert preprocessing_outputs(prep)["out_return_perf_metrics"].tolist() == [[True]]  # ensemble: always


def test_postprocessing_passes_the_figures_through_or_zeros(text_tokenizer):
    resp = {"TOKENS_BATCH": np.array([[text_tokenizer.encode(" Paris")]], np.int32),
            "context_ids": np.zeros((1, 0), np.int32), "text_trim": np.array([[0]], np.int32)}
    out = postprocess_tensors(text_tokenizer, dict(resp, **acceptance_tensors(7, 5)))
    assert read_acceptance(out, prefix="out_") == {"acceptance_rate": pytest.approx(5 / 7),
                                                   "total_accepted_draft_tokens": 5, "total_draft_tokens": 7}
    assert out["out_total_draft_tokens"].dtype == np.int32 and out["out_acceptance_rate"].dtype == np.float32
    zeros = postprocess_tensors(text_tokenizer, resp)  # called without them (not through the ensemble)
    assert read_acceptance(zeros, prefix="out_") == {"acceptance_rate": 0.0, "total_accepted_draft_tokens": 0,
                                                     "total_draft_tokens": 0}


# Executor.stats() with an EAGLE speculator: the scheduler's totals plus SpecStats.as_dict()
SPEC_STATS = {"running": 1, "waiting": 0, "draft_tokens": 40, "accepted_draft_tokens": 12,
              "spec_verify_steps": 10, "draft_tokens_proposed": 40, "draft_tokens_accepted": 12,
              "acceptance_rate": 0.3, "mean_acceptance_length": 2.2,
              "accepted_per_step_histogram": {0: 4, 1: 2, 3: 4}}


def test_stats_to_speculation_gauges_and_counter_totals():
    g = stats_gauges(SPEC_STATS)
    assert g["kiln_spec_acceptance_rate"] == 0.3 and g["kiln_spec_mean_acceptance_length"] == 2.2
    assert stats_counters(SPEC_STATS) == {"kiln_spec_draft_tokens_proposed_total": 40.0,
                                          "kiln_spec_draft_tokens_accepted_total": 12.0}
    # a draft-less executor has only the scheduler's totals (0): the counters follow those
    assert stats_counters({"draft_tokens": 0, "accepted_draft_tokens": 0}) == {
        "kiln_spec_draft_tokens_proposed_total": 0.0, "kiln_spec_draft_tokens_accepted_total": 0.0}
    assert "kiln_spec_acceptance_rate" not in stats_gauges({"running": 0})


class _Family:
    """Stand-in for pb_utils.MetricFamily, which exists only inside Triton's Python backend stub
    (the real one is exercised by test_spec_serving.py through a real server)."""
    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
    made: dict[str, "_Family"] = {}

    def __init__(self, name, description, kind):
        self.name, self.kind, self.value = name, kind, 0.0
        _Family.made[name] = self

    def Metric(self, labels, buckets=None):  # noqa: N802 - Triton's spelling
        return self

    def increment(self, v):
        assert v >= 0, "a counter only goes up"
        self.value += v

    def set(self, v):
        self.value = v

    def observe(self, v):
        pass


def test_counters_add_the_growth_of_the_executor_totals():
    m = ServingMetrics(types.SimpleNamespace(MetricFamily=_Family), "engine", "0")
    fam = _Family.made
    assert fam["kiln_spec_draft_tokens_proposed_total"].kind == "counter"
    assert fam["kiln_spec_acceptance_rate"].kind == "gauge"
    m.update(SPEC_STATS)
    m.update(SPEC_STATS)  # no growth: no change
    assert fam["kiln_spec_draft_tokens_proposed_total"].value == 40
    m.update(dict(SPEC_STATS, draft_tokens_proposed=55, draft_tokens_accepted=20))
    assert fam["kiln_spec_draft_tokens_proposed_total"].value == 55
    assert fam["kiln_spec_draft_tokens_accepted_total"].value == 20
    # totals that shrank come from a new executor: counted from there, never decreasing
    m.update(dict(SPEC_STATS, draft_tokens_proposed=5, draft_tokens_accepted=1))
    m.update(dict(SPEC_STATS, draft_tokens_proposed=9, draft_tokens_accepted=2))
    assert fam["kiln_spec_draft_tokens_proposed_total"].value == 59
    assert fam["kiln_spec_draft_tokens_accepted_total"].value == 21
    assert fam["kiln_spec_mean_acceptance_length"].value == 2.2
