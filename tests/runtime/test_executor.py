"""Executor behaviour on the real SmolLM2 (fp32 bundle): batching, chunked prefill, prefix caching,
KV pressure with preemption, cancellation, errors and the event contract."""
from __future__ import annotations

import threading

import pytest

from backend.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def test_prefix_caching_same_outputs_fewer_prefill_tokens(make_executor, varied_prompts):
    shared = varied_prompts[10]  # ~140 tokens: several full blocks
    prompts = [shared + [28 + i, 29 + i] for i in range(6)]
    results, computed = {}, {}
    for caching in (False, True):
        ex = make_executor(enable_prefix_caching=caching)
        first = ex.generate(prompts[:1], GREEDY)        # fills the cache with the shared prefix
        rest = ex.generate(prompts[1:], GREEDY)
        results[caching] = [r.token_ids for r in first + rest]
        computed[caching] = ex.stats()["prefill_tokens_computed"]
        hits = ex.stats()["prefix_cache_hits"]
        assert (hits > 0) == caching
    assert results[True] == results[False]
    saved = computed[False] - computed[True]
    assert saved >= 5 * (len(shared) // 16 - 1) * 16, computed


def test_pressure_tiny_pool_preempts_and_frees_everything(make_executor, varied_prompts):
    # 24 requests (each of the 12 prompts twice, each copy its own last token): many times what the
    # pool holds, so requests wait, grow into each other's blocks and are preempted (asserted below);
    # 64 cost the suite ~12 s more for the same paths
    prompts = [varied_prompts[i % 12][:24] + [30 + i] for i in range(24)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    big = make_executor(max_kv_tokens=8192)
    expected = [r.token_ids for r in big.generate(prompts, params)]
    # 8 blocks of 16 tokens: two or three requests at a time; the rest wait or get preempted.
    small = make_executor(max_kv_tokens=128, enable_prefix_caching=False)
    got = small.generate(prompts, params)
    assert [r.token_ids for r in got] == expected
    assert all(r.finish_reason == "length" for r in got)
    s = small.stats()
    assert s["preemptions"] > 0
    assert s["kv_blocks_used"] == 0 and s["kv_blocks_free"] == s["kv_blocks_total"]
    assert s["running"] == 0 and s["waiting"] == 0


def test_cancel_mid_generation_frees_every_block(make_executor, varied_prompts):
    ex = make_executor()
    h = ex.submit(varied_prompts[10], SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True))
    other = ex.submit(varied_prompts[0], SamplingParams(max_tokens=4, temperature=0.0))
    events = []
    for ev in h:
        events.append(ev)
        if len(events) == 3:
            ex.cancel(h.request_id)
    assert events[-1].finished and events[-1].finish_reason == "cancelled"
    assert sum(ev.finished for ev in events) == 1
    assert 3 <= sum(len(ev.token_ids) for ev in events) < 400
    assert other.result().finish_reason in ("length", "stop")
    s = ex.stats()
    assert s["kv_blocks_used"] == 0 and s["running"] == 0 and s["waiting"] == 0


@pytest.mark.parametrize("kwargs, prompt, needle", [
    ({"temperature": -1.0}, [1, 2, 3], "sampling.temperature"),
    ({"top_p": 0.0}, [1, 2, 3], "sampling.top_p"),
    ({"max_tokens": 0}, [1, 2, 3], "sampling.max_tokens"),
    ({"stop_token_ids": [10 ** 6]}, [1, 2, 3], "sampling.stop_token_ids"),
    ({}, [], "prompt_token_ids"),
    ({}, [1, 49152], "prompt_token_ids"),
    ({}, [5] * 1600, "max_input_len"),
])
def test_invalid_requests_raise_before_queueing(make_executor, kwargs, prompt, needle):
    ex = make_executor(start=False, max_kv_tokens=2048)
    with pytest.raises(ValueError, match=needle):
        ex.submit(prompt, SamplingParams(**kwargs))
    assert ex.stats()["waiting"] == 0 and ex.step() == 0


def test_callbacks_come_from_the_loop_thread_with_one_final_event(make_executor, varied_prompts):
    ex = make_executor()
    seen, threads, done = [], set(), threading.Event()

    def on_event(ev):
        seen.append(ev)
        threads.add(threading.current_thread().name)
        if ev.finished:
            done.set()

    ex.submit(varied_prompts[3], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
              request_id="cb", on_event=on_event)
    assert done.wait(120)
    assert threads == {"kiln-executor"}
    assert [ev.finished for ev in seen].count(True) == 1 and seen[-1].finish_reason == "length"
    assert sum(len(ev.token_ids) for ev in seen) == 5


def test_step_error_fails_its_requests_and_the_loop_survives(make_executor, varied_prompts, caplog):
    ex = make_executor()
    real = ex.runner.execute
    calls = {"n": 0}

    def flaky(*args, **kw):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected device failure")
        return real(*args, **kw)

    ex.runner.execute = flaky
    with caplog.at_level("ERROR", logger="kiln"):
        handle = ex.submit(varied_prompts[0], GREEDY, request_id="req-under-test")
        bad = handle.result()
    assert bad.finish_reason == "error" and "injected device failure" in bad.error
    # the failure is logged once, with the traceback and the request it ended
    [rec] = [r for r in caplog.records if r.name == "kiln.engine.executor"]
    assert "req-under-test" in rec.getMessage() and "injected device failure" in caplog.text
    good = ex.submit(varied_prompts[0], GREEDY).result()
    assert good.finish_reason == "length" and len(good.token_ids) == GREEDY.max_tokens
    s = ex.stats()
    assert s["step_errors"] == 1 and s["kv_blocks_used"] == 0


def test_loop_failure_ends_every_request_and_refuses_new_ones(make_executor, varied_prompts):
    """A bug outside a step (here: the scheduler) ends the loop thread: every request still gets
    one final error event, health() says why, and submit() refuses instead of queueing forever."""
    from backend.runtime.spec import EngineError
    ex = make_executor()
    real = ex.scheduler.schedule
    calls = {"n": 0}

    def broken_schedule(*args, **kw):  # schedule() runs outside the step's own error handling
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyError("injected scheduler bug")
        return real(*args, **kw)

    ex.scheduler.schedule = broken_schedule
    handles = [ex.submit(p, GREEDY) for p in varied_prompts[:3]]
    results = [h.result() for h in handles]  # would hang forever without the final events
    assert all(r.finish_reason == "error" and "injected scheduler bug" in r.error for r in results)
    assert "injected scheduler bug" in ex.health()
    with pytest.raises(EngineError, match="engine loop has failed"):
        ex.submit(varied_prompts[0], GREEDY)


def test_health_reports_a_stuck_step(make_executor, varied_prompts):
    ex = make_executor()
    real = ex.runner.execute
    release, entered = threading.Event(), threading.Event()

    def hung(*args, **kw):
        entered.set()
        release.wait(30)
        return real(*args, **kw)

    ex.runner.execute = hung
    handle = ex.submit(varied_prompts[0], GREEDY)
    assert entered.wait(30)
    assert ex.health(stuck_after_s=60) is None
    threading.Event().wait(0.3)
    assert "more than 0.2 s" in ex.health(stuck_after_s=0.2)
    release.set()
    assert handle.result().finish_reason == "length"
    assert ex.health(stuck_after_s=0.2) is None


def test_seeded_sampling_same_alone_or_batched(make_executor, varied_prompts):
    ex = make_executor()
    params = SamplingParams(max_tokens=8, temperature=0.9, top_k=50, top_p=0.95, seed=1234)
    alone = ex.generate([varied_prompts[2]], params)[0].token_ids
    others = SamplingParams(max_tokens=8, temperature=1.0)
    batch = ex.generate([varied_prompts[5], varied_prompts[2], varied_prompts[7]], [others, params, others])
    assert batch[1].token_ids == alone


def test_stop_token_and_logprobs(make_executor, varied_prompts):
    ex = make_executor()
    ref = ex.generate([varied_prompts[0]], GREEDY)[0].token_ids
    stop = ref[3]
    res = ex.generate([varied_prompts[0]], SamplingParams(max_tokens=12, temperature=0.0,
                                                          stop_token_ids=[stop], logprobs=3))[0]
    assert res.finish_reason == "stop" and res.token_ids == ref[:ref.index(stop) + 1]
    assert len(res.logprobs) == len(res.token_ids)
    chosen, top = res.logprobs[0]
    assert len(top) == 3 and top[0][0] == res.token_ids[0] and abs(top[0][1] - chosen) < 1e-6
