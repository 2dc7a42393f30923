"""The overlapped loop's scheduler protocol (backend/engine/late_tokens.py), with a stand-in model:
each step's tokens reach the scheduler one step late as placeholders, yet every request ends with
exactly the tokens, finish reason and KV bookkeeping of the synchronous protocol, through chunked
prefill, prefix caching, preemption in a tiny pool, stop tokens (also on the last allowed token),
min_tokens and aborts while a step is in flight."""
from __future__ import annotations

import random

import pytest

from backend.engine.kv_cache import BlockManager
from backend.engine.late_tokens import PLACEHOLDER, fill, late_rows
from backend.engine.scheduler import Scheduler

from tests.runtime.scheduler_helpers import EOS, make, next_token


def model(tokens):
    """Stops now and then (EOS), so the stop check has to wait for the token."""
    return EOS if (tokens[-1] * 13 + len(tokens)) % 17 == 0 else next_token(tokens)


def _requests(seed, n=14, max_tokens=None):
    rng = random.Random(seed)
    shared = [rng.randrange(3, 50) for _ in range(12)]
    reqs = []
    for i in range(n):
        prompt = [rng.randrange(3, 50) for _ in range(rng.randrange(1, 30))]
        if i % 3 == 0:
            prompt = shared + prompt
        kw = dict(max_tokens=max_tokens or rng.randrange(1, 24), priority=rng.choice([0, 0, 1]))
        if i % 4 == 1:
            kw["ignore_eos"] = True
            kw["stop_token_ids"] = [rng.randrange(3, 100)]
        if i % 5 == 2:
            kw["min_tokens"] = 3
        reqs.append(make(f"r{i}", prompt, **kw))
    return reqs


def _scheduler(blocks, caching):
    return Scheduler(BlockManager(blocks, 4, enable_prefix_caching=caching), max_batch_size=6,
                     max_num_tokens=24, eos_token_ids=[EOS])


def _sample(out, known):
    """The model's next token for each sampling row; ``known`` replaces a trailing placeholder, as the
    executor's device-side gather does."""
    sampled = []
    for s in out.scheduled:
        if not s.sample:
            continue
        toks = s.request.all_token_ids[:s.start_pos + s.num_new_tokens]
        if toks[-1] == PLACEHOLDER:
            toks = toks[:-1] + [known[s.request.request_id]]
        assert PLACEHOLDER not in toks, "only the last token may be unknown"
        out_len = len(s.request.output_token_ids)
        tok = model(toks)
        if tok == EOS and out_len < s.request.params.min_tokens:
            tok = next_token(toks)           # the sampler masks stops before min_tokens
        sampled.append(tok)
    return sampled


def run_sync(sched, reqs, abort_at=None):
    for r in reqs:
        sched.add(r)
    step = 0
    while sched.has_unfinished():
        if abort_at and step in abort_at:
            sched.abort(abort_at[step])
        out = sched.schedule()
        sched.update(out, _sample(out, {}))
        sched.block_manager.check_invariants()
        step += 1
    return step


def run_overlapped(sched, reqs, abort_at=None):
    for r in reqs:
        sched.add(r)
    pending = None
    step = 0
    while sched.has_unfinished() or pending:
        if abort_at and step in abort_at:
            sched.abort(abort_at[step])
        out = sched.schedule()
        if out.is_empty:
            assert pending, "nothing scheduled and nothing in flight with requests unfinished"
            fill(sched, pending[0], pending[1], 0.0)
            pending = None
            continue
        known = {r.request_id: pending[1][i] for r, i in zip(pending[0].requests, pending[0].index)} if pending else {}
        sampled = _sample(out, known)
        if pending:
            fill(sched, pending[0], pending[1], 0.0)
        sampling = [s.request for s in out.scheduled if s.sample]
        sched.update(out, [PLACEHOLDER] * len(sampling))
        pending = (late_rows(sampling, sched.last_update_skipped), sampled)
        sched.block_manager.check_invariants()
        step += 1
    return step


def _result(reqs):
    return [(r.request_id, r.output_token_ids, r.status.name, r.stop_token) for r in reqs]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("blocks, caching", [(400, True), (400, False), (18, True), (17, False)])
def test_late_tokens_give_the_synchronous_results(seed, blocks, caching, monkeypatch):
    import backend.engine.kv_hashes as kv

    real_hash = kv.hash_block

    def checked_hash(parent, tokens):
        assert PLACEHOLDER not in tokens, "a block hashed over a token the host did not know yet"
        return real_hash(parent, tokens)

    monkeypatch.setattr(kv, "hash_block", checked_hash)
    a, b = _scheduler(blocks, caching), _scheduler(blocks, caching)
    sync_reqs, late_reqs = _requests(seed), _requests(seed)
    run_sync(a, sync_reqs)
    run_overlapped(b, late_reqs)
    assert _result(late_reqs) == _result(sync_reqs)
    assert any(r.status.name == "FINISHED_STOPPED" for r in sync_reqs)
    if blocks < 20:
        assert b.num_preemptions > 0
    for s in (a, b):
        assert s.block_manager.num_used_blocks == 0 and not s.running and not s.requests
    if blocks > 100:
        # Without pool pressure, the same prefix-cache hits (under pressure, the wasted row of a
        # request that stopped can change which blocks get evicted).
        assert b.block_manager.prefix_cache_hits == a.block_manager.prefix_cache_hits
    assert b.num_generated_tokens == a.num_generated_tokens


def test_stop_on_the_last_allowed_token_says_stop():
    prompt = [5, 6, 7]
    toks = list(prompt)
    for _ in range(4):
        toks.append(next_token(toks))
    last = toks[-1]
    assert last not in toks[3:-1]
    for runner in (run_sync, run_overlapped):
        req = make("x", prompt, max_tokens=4, ignore_eos=True, stop_token_ids=[last])
        runner(_scheduler(100, True), [req])
        assert req.status.name == "FINISHED_STOPPED" and req.output_token_ids == toks[3:]


def test_abort_while_a_step_is_in_flight():
    a, b = _scheduler(60, True), _scheduler(60, True)
    sync_reqs, late_reqs = _requests(3, 6, max_tokens=20), _requests(3, 6, max_tokens=20)
    run_sync(a, sync_reqs, abort_at={4: "r1"})
    run_overlapped(b, late_reqs, abort_at={4: "r1"})
    by_id = {r.request_id: r for r in late_reqs}
    assert by_id["r1"].status.name == "FINISHED_ABORTED"
    # The aborted request never got more than the synchronous run gave it before the abort; the
    # others are untouched.
    assert [x for x in _result(late_reqs) if x[0] != "r1"] == [x for x in _result(sync_reqs) if x[0] != "r1"]
    assert b.block_manager.num_used_blocks == 0
