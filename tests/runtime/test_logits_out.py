"""Context and generation logits (TensorRT-LLM's return_context_logits / return_generation_logits,
backend/engine/logits_out.py) on the real SmolLM2 fp32 bundle, checked against Hugging Face's
logits for the same ids: through chunked prefill, both engine loops, the prefix cache (skipped for
such a request), preemption (positions not collected twice) and beside requests that ask nothing
(their tokens unchanged)."""
from __future__ import annotations

import pytest
import torch

from backend.engine.sampling_params import SamplingParams
from backend.speculative.accept import speculation_allowed

pytestmark = pytest.mark.slow

CTX = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, return_context_logits=True)
GEN = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, return_generation_logits=True)
PLAIN = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


def _hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0]


@pytest.fixture(scope="module")
def prompts(varied_prompts):
    # the long prompt (several chunks at max_num_tokens=32), a short one, a code one
    return [varied_prompts[10], varied_prompts[0], varied_prompts[9]]


@pytest.mark.parametrize("overlap", [False, True])
def test_context_and_generation_logits_are_hf_logits(make_executor, hf_model_fp32, prompts, overlap):
    ex = make_executor(start=False, max_kv_tokens=2048, max_num_tokens=32, overlap_scheduling=overlap)
    both = CTX.replace(return_generation_logits=True)
    plain_before = [r.token_ids for r in ex.generate(prompts, PLAIN)]
    results = ex.generate(prompts, [both, PLAIN, GEN])
    # requests that ask nothing are not changed by those that do
    assert [r.token_ids for r in results][1] == plain_before[1]
    for r, prompt in zip(results, prompts):
        assert r.token_ids == plain_before[prompts.index(prompt)]
    full = results[0]
    prompt = prompts[0]
    assert len(prompt) > 64      # really chunked at max_num_tokens=32
    ref = _hf_logits(hf_model_fp32, prompt + full.token_ids)
    assert full.context_logits.shape == (len(prompt), ex.vocab_size)
    torch.testing.assert_close(full.context_logits, ref[:len(prompt)], atol=1e-3, rtol=1e-3)
    # generation logits: the raw row each token came from (greedy: its argmax)
    assert full.generation_logits.shape == (5, ex.vocab_size)
    torch.testing.assert_close(full.generation_logits, ref[len(prompt) - 1:-1], atol=1e-3, rtol=1e-3)
    assert full.generation_logits.argmax(-1).tolist() == full.token_ids
    assert torch.equal(full.generation_logits[0], full.context_logits[-1])
    # only what was asked for
    assert results[1].context_logits is None and results[1].generation_logits is None
    assert results[2].context_logits is None and results[2].generation_logits.shape == (5, ex.vocab_size)
    ref2 = _hf_logits(hf_model_fp32, prompts[2] + results[2].token_ids)
    torch.testing.assert_close(results[2].generation_logits, ref2[len(prompts[2]) - 1:-1], atol=1e-3, rtol=1e-3)


def test_sampled_generation_logits_are_the_raw_logits(make_executor, hf_model_fp32, prompts):
    """Temperature, top-k and a logit bias change the draw, not the logits returned."""
    ex = make_executor(start=False, max_kv_tokens=2048)
    p = SamplingParams(max_tokens=4, temperature=1.5, top_k=5, seed=7, ignore_eos=True,
                       logit_bias=((11, 3.0),), return_generation_logits=True)
    r = ex.generate([prompts[1]], p)[0]
    ref = _hf_logits(hf_model_fp32, prompts[1] + r.token_ids)
    torch.testing.assert_close(r.generation_logits, ref[len(prompts[1]) - 1:-1], atol=1e-3, rtol=1e-3)


def test_streamed_events_carry_their_own_rows(make_executor, prompts):
    ex = make_executor(max_kv_tokens=2048)
    handle = ex.submit(prompts[1], CTX.replace(return_generation_logits=True, max_tokens=4))
    events = [ev for ev in handle if ev.token_ids]
    assert events[0].context_logits.shape == (len(prompts[1]), ex.vocab_size)
    assert all(ev.context_logits is None for ev in events[1:])      # sent once, with the first token
    assert [ev.generation_logits.shape[0] for ev in events] == [len(ev.token_ids) for ev in events]


def test_prefix_cache_is_skipped_and_preemption_collects_once(make_executor, prompts, varied_prompts):
    ex = make_executor(start=False, max_kv_tokens=2048)
    first, second = (ex.generate([prompts[0]], CTX)[0] for _ in range(2))
    # the second prompt was in the prefix cache: computed again anyway, same logits
    torch.testing.assert_close(second.context_logits, first.context_logits, atol=1e-4, rtol=1e-4)
    # a tiny pool preempts; recomputed prompts must not add rows
    many = [varied_prompts[i % 12][:24] + [30 + i] for i in range(16)]
    params = [CTX.replace(max_tokens=6 + i % 5) for i in range(16)]
    expected = [r.context_logits for r in ex.generate(many, params)]
    small = make_executor(start=False, max_kv_tokens=128, enable_prefix_caching=False)
    got = small.generate(many, params)
    assert small.stats()["preemptions"] > 0
    for r, e in zip(got, expected):
        assert r.context_logits.shape == e.shape
        torch.testing.assert_close(r.context_logits, e, atol=1e-4, rtol=1e-4)


def test_generation_logits_rule_out_drafts():
    assert speculation_allowed(PLAIN, 0)
    assert not speculation_allowed(GEN, 0)
    assert speculation_allowed(CTX, 0)   # context logits come from the prefill; drafts come later
