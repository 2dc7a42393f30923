"""The executor's speculation seam with an oracle drafter: multi-token steps keep greedy output exact.

The drafter is a test double for EAGLE (which lives in backend/speculative): it proposes the known greedy
continuation, with a wrong token planted every other step so rejection and KV rollback happen too.
"""
from __future__ import annotations

import pytest

from backend.engine.request import RequestStatus
from backend.engine.sampling_params import SamplingParams
from backend.engine.speculator_seam import Speculator

pytestmark = pytest.mark.slow
K = 3


class OracleSpeculator(Speculator):
    capture_hidden_layers = (5,)

    def __init__(self, reference: dict[str, list[int]]) -> None:
        self.reference = reference
        self.step = 0
        self.captured_shapes_ok = True
        self.verified_rows = 0

    def prepare(self, out, inputs) -> None:
        pass

    def verify(self, out, logits, rows, sampler):
        result, i = [], 0
        for s in out.scheduled:
            if not s.sample:
                continue
            n = 1 + s.num_spec_tokens
            greedy = logits[i:i + n].argmax(-1).tolist()
            i += n
            accepted = []
            for j, d in enumerate(s.request.spec_token_ids[:s.num_spec_tokens]):
                if greedy[j] != d:
                    break
                accepted.append(d)
            result.append(accepted + [greedy[len(accepted)]])
        assert i == logits.shape[0]
        self.verified_rows += i
        return result

    def propose(self, out, inputs, captured, finished) -> None:
        self.step += 1
        self.captured_shapes_ok &= all(t.shape[0] == inputs.num_tokens for t in captured.values())
        for s in out.scheduled:
            req = s.request
            if req.status is not RequestStatus.RUNNING or req.is_prefill:
                continue
            n = len(req.output_token_ids)
            drafts = list(self.reference[req.request_id][n:n + K])
            if drafts and self.step % 2:
                drafts[-1] = (drafts[-1] + 1) % 49152   # plant a wrong guess
            req.spec_token_ids = drafts


def test_oracle_speculation_is_exact_and_saves_steps(make_executor, varied_prompts):
    prompts = varied_prompts[:6]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    plain = make_executor(start=False)
    ref = [r.token_ids for r in plain.generate(prompts, params)]
    plain_steps = plain.stats()["steps"]

    oracle = OracleSpeculator({f"r{i}": toks for i, toks in enumerate(ref)})
    ex = make_executor(start=False)
    ex.speculator = oracle
    handles = [ex.submit(p, params, request_id=f"r{i}") for i, p in enumerate(prompts)]
    while not all(h.finished for h in handles):
        ex.step()
    got = [h.result().token_ids for h in handles]
    assert got == ref
    s = ex.stats()
    assert s["draft_tokens"] > 0 and 0 < s["accepted_draft_tokens"] < s["draft_tokens"]
    assert s["steps"] < plain_steps
    assert oracle.captured_shapes_ok and oracle.verified_rows > s["steps"]
    assert s["kv_blocks_used"] == 0
