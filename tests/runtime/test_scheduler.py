"""Scheduler: continuous batching, chunked prefill, policies, preemption, priorities, abort, finish
rules (speculative bookkeeping: test_scheduler_speculation.py). Pure Python: the "model" is a deterministic function of the
sequence so far, so a request's output must not depend on batching, chunking or preemption."""
import random

import pytest

from backend.engine.kv_cache import BlockManager
from backend.engine.request import Request, RequestStatus
from backend.engine.sampling_params import SamplingParams
from backend.engine.scheduler import POLICIES, Scheduler
from tests.runtime.scheduler_helpers import EOS, make, next_token, random_requests, reference_output, run, step  # noqa: F401

@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("chunked,caching", [(True, True), (True, False), (False, True)])
def test_random_workloads_complete_correctly_and_free_everything(seed, policy, chunked, caching):
    rng = random.Random(seed)
    bm = BlockManager(40, 4, enable_prefix_caching=caching)
    budget = 64 if chunked else 96                # unchunked: the longest prompt must fit a step
    sched = Scheduler(bm, max_batch_size=6, max_num_tokens=budget, policy=policy,
                      enable_chunked_prefill=chunked, max_seq_len=128)
    shared = [[rng.randrange(3, 50) for _ in range(24)] for _ in range(2)]
    reqs = random_requests(rng, 30, shared=shared)
    pending = list(reqs)
    for _ in range(5):                            # some arrive before the first step
        sched.add(pending.pop(0))
    steps = 0
    while sched.has_unfinished() or pending:
        if pending and rng.random() < 0.4:
            sched.add(pending.pop(0))
        out, _ = step(sched)
        steps += 1
        assert out.num_tokens <= budget and len(out.scheduled) <= 6
        bm.check_invariants()
        assert steps < 5000
    for r in reqs:
        assert r.status is RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == reference_output(r.prompt_token_ids, r.params.max_tokens), r
    assert bm.num_free_blocks == bm.num_blocks and bm.num_holders == 0
    assert sched.num_waiting == 0 and not sched.running
    if policy == "guaranteed_no_evict":
        assert sched.num_preemptions == 0


def test_chunked_prefill_splits_a_long_prompt_and_completes_it():
    bm = BlockManager(64, 4)
    sched = Scheduler(bm, max_batch_size=4, max_num_tokens=32)
    r = make("long", range(3, 103), max_tokens=3, ignore_eos=True)   # 100 tokens
    sched.add(r)
    chunks = []
    while r.num_output_tokens == 0:
        out, _ = step(sched)
        (s,) = out.scheduled
        chunks.append((s.start_pos, s.num_new_tokens, s.is_prefill, s.sample))
    assert chunks == [(0, 32, True, False), (32, 32, True, False), (64, 32, True, False),
                      (96, 4, True, True)]
    out, _ = step(sched)
    assert [(s.start_pos, s.num_new_tokens, s.is_prefill) for s in out.scheduled] == [(100, 1, False)]
    run(sched)
    assert r.output_token_ids == reference_output(r.prompt_token_ids, 3)
    assert sched.num_prefill_tokens_computed == 100


def test_decodes_first_then_continuing_prefill_then_new_request_within_budget():
    bm = BlockManager(128, 4)
    sched = Scheduler(bm, max_batch_size=8, max_num_tokens=16)
    decoders = [make(f"d{i}", [5 + i, 6, 7], max_tokens=50, ignore_eos=True) for i in range(3)]
    for r in decoders:
        sched.add(r)
    step(sched)                                   # 3 short prefills
    long = make("long", range(3, 43), max_tokens=2, ignore_eos=True)   # 40 tokens
    sched.add(long)
    out, _ = step(sched)
    # Decodes keep going (3 tokens) while the new prompt takes the rest of the budget (13).
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == \
        [("long", 13), ("d0", 1), ("d1", 1), ("d2", 1)]
    assert out.num_prefills == 1 and out.num_prefill_tokens == 13 and out.num_decode_tokens == 3
    late = make("late", [9, 9, 9, 9], max_tokens=2, ignore_eos=True)
    sched.add(late)
    for _ in range(2):
        out, _ = step(sched)
        # The continuing chunk takes what the decodes leave; the newcomer waits for budget.
        assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == \
            [("long", 13), ("d0", 1), ("d1", 1), ("d2", 1)]
        assert late.status is RequestStatus.WAITING
    out, _ = step(sched)
    # The last prompt token is still a prefill (nothing sampled yet) and comes before the newcomer.
    assert [(s.request.request_id, s.num_new_tokens, s.is_prefill, s.sample)
            for s in out.scheduled] == [("long", 1, True, True), ("late", 4, True, True),
                                        ("d0", 1, False, True), ("d1", 1, False, True),
                                        ("d2", 1, False, True)]
    assert out.num_prefills == 2 and out.num_tokens == 8
    run(sched)
    assert sched.num_prefill_tokens_computed == 3 * 3 + 40 + 4


def test_token_budget_and_batch_size_are_never_exceeded_under_load():
    rng = random.Random(7)
    bm = BlockManager(400, 8)
    sched = Scheduler(bm, max_batch_size=5, max_num_tokens=20, max_seq_len=200)
    for r in random_requests(rng, 25, max_prompt=90, max_out=30):
        sched.add(r)
    outputs = run(sched)
    assert max(o.num_tokens for o in outputs) == 20          # the budget is actually used
    assert max(len(o.scheduled) for o in outputs) == 5


def test_priority_then_fcfs_admission_order():
    bm = BlockManager(64, 4)
    sched = Scheduler(bm, max_batch_size=1, max_num_tokens=64)
    order = []
    for rid, prio in [("a", 0), ("b", 2), ("c", 1), ("d", 2), ("e", 0)]:
        sched.add(make(rid, [7, 8, 9], max_tokens=2, ignore_eos=True, priority=prio))
    while sched.has_unfinished():
        out, finished = step(sched)
        order += [r.request_id for r in finished]
    assert order == ["b", "d", "c", "a", "e"]


def test_preemption_under_pressure_then_identical_completion_and_free_pool():
    prompts = [[(i * 13 + j) % 90 + 3 for j in range(10 + i % 7)] for i in range(12)]

    def serve(num_blocks, policy="max_utilization", caching=True):
        bm = BlockManager(num_blocks, 4, enable_prefix_caching=caching)
        sched = Scheduler(bm, max_batch_size=12, max_num_tokens=256, policy=policy)
        reqs = [make(f"r{i}", p, max_tokens=24, ignore_eos=True) for i, p in enumerate(prompts)]
        for r in reqs:
            sched.add(r)
        run(sched)
        assert bm.num_free_blocks == num_blocks
        return [r.output_token_ids for r in reqs], sched, reqs

    big, big_sched, _ = serve(1000)
    assert big_sched.num_preemptions == 0
    for caching in (True, False):
        small, small_sched, reqs = serve(12, caching=caching)     # 48 tokens for 12 requests of ~40
        assert small_sched.num_preemptions > 0
        assert any(r.num_preemptions for r in reqs)
        assert small == big
    safe, safe_sched, _ = serve(12, policy="guaranteed_no_evict")
    assert safe_sched.num_preemptions == 0 and safe == big


def test_guaranteed_no_evict_admits_only_what_can_finish():
    bm = BlockManager(10, 4)                      # 40 tokens
    sched = Scheduler(bm, max_batch_size=8, max_num_tokens=64, policy="guaranteed_no_evict")
    a = make("a", range(3, 11), max_tokens=12, ignore_eos=True)   # life 20 tokens = 5 blocks
    b = make("b", range(20, 28), max_tokens=12, ignore_eos=True)  # 5 blocks
    c = make("c", range(40, 44), max_tokens=4, ignore_eos=True)   # 2 blocks
    for r in (a, b, c):
        sched.add(r)
    out, _ = step(sched)
    assert [s.request.request_id for s in out.scheduled] == ["a", "b"]   # c must wait
    assert c.status is RequestStatus.WAITING
    run(sched)
    assert sched.num_preemptions == 0 and bm.num_free_blocks == 10


@pytest.mark.parametrize("when", ["waiting", "prefilling", "decoding", "preempted", "finished"])
def test_abort_at_every_state_frees_blocks(when):
    bm = BlockManager(8, 4)
    sched = Scheduler(bm, max_batch_size=4, max_num_tokens=8)
    victim = make("v", range(3, 23), max_tokens=30, ignore_eos=True)    # 20 tokens: 3 chunks
    sched.add(victim)
    if when == "prefilling":
        step(sched)
        assert victim.status is RequestStatus.RUNNING and victim.is_prefill
    elif when == "decoding":
        for _ in range(4):
            step(sched)
        assert victim.num_output_tokens >= 1 and not victim.is_prefill
    elif when == "preempted":
        for _ in range(4):
            step(sched)
        # A higher-priority request that needs most of the pool forces the victim out.
        hog = make("hog", range(50, 70), max_tokens=10, ignore_eos=True, priority=5)
        sched.add(hog)
        while victim.status is not RequestStatus.PREEMPTED:
            step(sched)
            assert sched.has_unfinished()
    elif when == "finished":
        run(sched)
    if when in ("waiting", "finished", "preempted"):
        assert victim.block_ids == []
    else:
        assert victim.block_ids and bm.ref_counts[victim.block_ids[0]] == 1
    got = sched.abort("v")
    if when == "finished":
        assert got is None
    else:
        assert got is victim and victim.status is RequestStatus.FINISHED_ABORTED
        assert victim.finish_reason == "cancelled" and victim.block_ids == []
        assert sched.abort("v") is None
        out = sched.schedule()
        assert "v" in out.finished_request_ids
        assert all(s.request is not victim for s in out.scheduled)
        if out.scheduled:
            sched.update(out, [next_token(s.request.all_token_ids) for s in out.scheduled if s.sample])
    run(sched)
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks and bm.num_holders == 0


def test_abort_during_a_step_ignores_its_results():
    bm = BlockManager(8, 4)
    sched = Scheduler(bm, max_batch_size=4, max_num_tokens=16)
    a, b = make("a", [5, 6, 7]), make("b", [8, 9])
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    sched.abort("a", RequestStatus.FINISHED_ERROR, error="model failed")
    finished = sched.update(out, [11, 12])
    assert a.output_token_ids == [] and a.finish_reason == "error" and a.error == "model failed"
    assert b.output_token_ids == [12] and finished == []
    run(sched)
    assert bm.num_free_blocks == 8


def test_finish_rules_stop_eos_ignore_eos_min_tokens_max_seq_len():
    def model_emitting(seq):
        it = iter(seq)
        return lambda toks: next(it)

    def one(params, tokens, eos=(EOS,), max_seq_len=None, prompt=(5, 6)):
        bm = BlockManager(32, 4)
        sched = Scheduler(bm, 2, 64, eos_token_ids=eos, max_seq_len=max_seq_len)
        r = Request("x", list(prompt), params)
        sched.add(r)
        run(sched, model=model_emitting(tokens))
        return r

    r = one(SamplingParams(max_tokens=10), [9, 9, EOS, 9])
    assert (r.output_token_ids, r.finish_reason, r.stop_token) == ([9, 9, EOS], "stop", EOS)
    r = one(SamplingParams(max_tokens=4, ignore_eos=True), [9, EOS, 9, 9, 9])
    assert (r.output_token_ids, r.finish_reason) == ([9, EOS, 9, 9], "length")
    r = one(SamplingParams(max_tokens=10, stop_token_ids=(42,), ignore_eos=True), [9, EOS, 42, 9])
    assert (r.output_token_ids, r.finish_reason, r.stop_token) == ([9, EOS, 42], "stop", 42)
    # The first min_tokens tokens never stop generation.
    r = one(SamplingParams(max_tokens=10, min_tokens=2), [EOS, EOS, EOS, 9])
    assert (r.output_token_ids, r.finish_reason) == ([EOS, EOS, EOS], "stop")
    r = one(SamplingParams(max_tokens=10), [9] * 10, max_seq_len=6)
    assert (r.output_token_ids, r.finish_reason) == ([9] * 4, "length")


def test_prefix_cache_hits_skip_prefill_tokens_but_compute_the_last_one():
    def serve(caching):
        bm = BlockManager(64, 4, enable_prefix_caching=caching)
        sched = Scheduler(bm, max_batch_size=4, max_num_tokens=128)
        system = list(range(10, 42))                        # 32 shared tokens = 8 blocks
        first = make("a", system + [5, 6], max_tokens=3, ignore_eos=True)
        sched.add(first)
        run(sched)
        second = make("b", system + [7, 8, 9], max_tokens=3, ignore_eos=True)
        same = make("c", system, max_tokens=3, ignore_eos=True)     # prompt fully cached
        sched.add(second)
        sched.add(same)
        out, _ = step(sched)
        starts = {s.request.request_id: (s.start_pos, s.num_new_tokens) for s in out.scheduled}
        run(sched)
        return sched, bm, starts, [r.output_token_ids for r in (first, second, same)]

    cold_sched, _, cold_starts, cold_out = serve(False)
    warm_sched, warm_bm, warm_starts, warm_out = serve(True)
    assert warm_out == cold_out
    assert cold_starts == {"b": (0, 35), "c": (0, 32)}
    assert warm_starts == {"b": (32, 3), "c": (28, 4)}             # >= 1 token always computed
    assert cold_sched.num_prefill_tokens_computed - warm_sched.num_prefill_tokens_computed == 32 + 28
    assert warm_bm.prefix_cache_hits == 60 and warm_bm.prefix_cache_hit_rate > 0.5


def test_timestamps_give_ttft_and_tpot():
    now = [100.0]
    bm = BlockManager(8, 4)
    sched = Scheduler(bm, 2, 16, clock=lambda: now[0])
    r = Request("t", [5, 6], SamplingParams(max_tokens=3, ignore_eos=True), arrival_time=99.0)
    sched.add(r)
    for t in (100.5, 101.0, 101.5):
        now[0] = t
        step(sched)
    assert r.ttft == pytest.approx(1.5) and r.tpot == pytest.approx(0.5)
    assert r.first_scheduled_time == 100.5 and r.finished_time == 101.5


def test_add_rejects_requests_that_can_never_run():
    bm = BlockManager(4, 4)                        # 16 tokens of KV
    sched = Scheduler(bm, 2, 8, enable_chunked_prefill=False, max_seq_len=32)
    sched.add(make("ok", [1, 2, 3], max_tokens=4))
    with pytest.raises(ValueError, match=r"request_id 'ok' is already in use"):
        sched.add(make("ok", [1]))
    with pytest.raises(ValueError, match=r"exceeds engine.max_num_tokens \(8\) and chunked prefill is off"):
        sched.add(make("long", range(9), max_tokens=1))
    with pytest.raises(ValueError, match=r"prompt \+ max_tokens = 20 tokens can never fit the KV cache of 16"):
        sched.add(make("big", range(8), max_tokens=12))
    with pytest.raises(ValueError, match=r"prompt of 32 tokens \(max_seq_len 32\): no room to generate: the prompt fills max_seq_len; allowed: a shorter prompt"):
        Scheduler(BlockManager(64, 4), 2, 64, max_seq_len=32).add(make("full", range(32)))
    with pytest.raises(ValueError, match=r"engine.scheduler_policy: 'fifo'; allowed: max_utilization, guaranteed_no_evict"):
        Scheduler(bm, 2, 8, policy="fifo")
    with pytest.raises(ValueError, match=r"engine.max_num_tokens: 0"):
        Scheduler(bm, 2, 0)
    with pytest.raises(ValueError, match=r"prompt_token_ids is empty"):
        make("empty", [])
    assert sched.num_waiting == 1 and list(sched.requests) == ["ok"]


def test_high_priority_prefill_preempts_an_already_scheduled_decode():
    bm = BlockManager(6, 4)                        # 24 tokens
    sched = Scheduler(bm, max_batch_size=4, max_num_tokens=8)
    low = make("low", range(3, 11), max_tokens=10, ignore_eos=True)
    sched.add(low)
    step(sched)                                    # low: 8-token prefill
    hog = make("hog", range(20, 34), max_tokens=2, ignore_eos=True, priority=5)
    sched.add(hog)
    step(sched)                                    # low decodes, hog's first chunk (7 tokens)
    out = sched.schedule()
    # low's decode was scheduled first, then hog's chunk needed its blocks: low is unscheduled.
    assert out.preempted == [low] and low.status is RequestStatus.PREEMPTED
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("hog", 7)]
    assert (out.num_prefill_tokens, out.num_decode_tokens, out.num_tokens) == (7, 0, 7)
    sched.update(out, [next_token(hog.all_token_ids)])
    run(sched)
    assert low.output_token_ids == reference_output(low.prompt_token_ids, 10)
    assert bm.num_free_blocks == 6


def test_update_accepts_numpy_scalars_and_stores_python_ints():
    np = pytest.importorskip("numpy")
    bm = BlockManager(8, 4)
    sched = Scheduler(bm, 2, 16, eos_token_ids=[EOS])
    r = make("n", [5, 6], max_tokens=3)
    sched.add(r)
    for tok in (np.int64(7), [np.int32(8)], np.int64(EOS)):
        sched.update(sched.schedule(), [tok])
    assert r.output_token_ids == [7, 8, EOS] and all(type(t) is int for t in r.output_token_ids)
    assert r.finish_reason == "stop" and bm.num_free_blocks == 8
