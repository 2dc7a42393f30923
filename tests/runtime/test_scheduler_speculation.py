"""Scheduler with speculative drafts: scoring, rollback of rejections, the token budget, and random
speculation under KV pressure giving exactly the plain greedy output. Pure Python."""
import random

import pytest

from backend.engine.kv_cache import BlockManager
from backend.engine.scheduler import POLICIES, Scheduler
from tests.runtime.scheduler_helpers import make, next_token, random_requests, reference_output, step


def test_speculative_drafts_are_scored_and_rejections_rolled_back():
    bm = BlockManager(32, 4)
    sched = Scheduler(bm, max_batch_size=2, max_num_tokens=64)
    r = make("s", [5, 6, 7], max_tokens=12, ignore_eos=True)
    sched.add(r)
    step(sched)                                    # prefill, 1 token sampled
    r.spec_token_ids = [50, 51, 52, 53]
    out = sched.schedule()
    (s,) = out.scheduled
    assert (s.start_pos, s.num_new_tokens, s.num_spec_tokens, s.sample) == (3, 5, 4, True)
    assert r.num_slots == 8 and r.num_tentative_tokens == 4
    sched.update(out, [[50, 51, 60]])              # 2 drafts accepted, then a corrected token
    assert r.output_token_ids[1:] == [50, 51, 60]
    assert r.num_computed_tokens == 6 and r.num_slots == 6 and len(r.block_ids) == 2
    assert (r.num_draft_tokens, r.num_accepted_draft_tokens) == (4, 2) and r.spec_token_ids == []
    bm.check_invariants()
    # Drafts never run past max_tokens: 12 - 4 = 8 tokens left -> at most 7 drafts (+1 sampled).
    r.spec_token_ids = [1] * 9
    out = sched.schedule()
    assert out.scheduled[0].num_spec_tokens == 7 and out.scheduled[0].num_new_tokens == 8
    finished = sched.update(out, [[1] * 7 + [9]])
    assert finished == [r] and r.num_output_tokens == 12 and r.finish_reason == "length"
    assert bm.num_free_blocks == 32 and sched.num_accepted_draft_tokens == 9
    bm.check_invariants()


def test_speculative_drafts_are_cut_to_the_token_budget():
    bm = BlockManager(32, 4)
    sched = Scheduler(bm, max_batch_size=2, max_num_tokens=4)
    r = make("s", [5, 6, 7], max_tokens=20, ignore_eos=True)
    sched.add(r)
    step(sched)
    r.spec_token_ids = [8] * 6
    out = sched.schedule()
    assert out.scheduled[0].num_spec_tokens == 3 and out.num_tokens == 4
    sched.update(out, [[4]])                       # every draft rejected
    assert r.num_computed_tokens == 4 and r.num_slots == 4 and len(r.block_ids) == 1
    bm.check_invariants()


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("caching", [True, False])
def test_random_speculation_under_pressure_gives_the_plain_greedy_output(seed, policy, caching):
    """Greedy speculative decoding with a stand-in target: drafts are partly right, partly wrong;
    verification keeps the matching prefix plus one target token. Outputs must equal plain greedy
    decoding, with preemptions, chunked prefill and rollbacks along the way, and nothing leaks.
    Without prefix caching the scheduler's decode fast path may reserve up to the last held block's
    end, so a rollback that gives back a drafts' block must take that room back too."""
    rng = random.Random(seed)
    bm = BlockManager(30, 4, enable_prefix_caching=caching)
    sched = Scheduler(bm, max_batch_size=5, max_num_tokens=24, policy=policy, max_seq_len=96)
    reqs = random_requests(rng, 14, max_prompt=40, max_out=25)
    for r in reqs:
        sched.add(r)

    def verify(s):
        seq = list(s.request.all_token_ids)
        got = []
        for d in s.request.spec_token_ids[:s.num_spec_tokens]:
            want = next_token(seq)
            if d != want:
                break
            got.append(d)
            seq.append(d)
        return got + [next_token(seq)]

    steps = 0
    while sched.has_unfinished():
        out = sched.schedule()
        assert out.num_tokens == sum(s.num_new_tokens for s in out.scheduled) <= 24
        assert out.num_spec_tokens == sum(s.num_spec_tokens for s in out.scheduled)
        sampled = [verify(s) if s.num_spec_tokens else next_token(s.request.all_token_ids)
                   for s in out.scheduled if s.sample]
        sched.update(out, sampled)
        bm.check_invariants()
        for r in sched.running:                    # propose drafts for the next step
            if not r.is_prefill and r.output_token_ids and rng.random() < 0.8:
                seq, drafts = list(r.all_token_ids), []
                for _ in range(rng.randrange(1, 6)):
                    t = next_token(seq) if rng.random() < 0.7 else 1
                    drafts.append(t)
                    seq.append(t)
                r.spec_token_ids = drafts
        steps += 1
        assert steps < 3000
    for r in reqs:
        assert r.output_token_ids == reference_output(r.prompt_token_ids, r.params.max_tokens), r
    assert bm.num_free_blocks == bm.num_blocks and bm.num_holders == 0
    assert sched.num_draft_tokens > 0 and 0 < sched.num_accepted_draft_tokens < sched.num_draft_tokens
    # The pool is small on purpose: max_utilization must have preempted speculating requests.
    assert (sched.num_preemptions == 0) if policy == "guaranteed_no_evict" else sched.num_preemptions > 0
