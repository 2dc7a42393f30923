"""The overlapped engine loop (engine.overlap_scheduling, backend/engine/overlap.py) on the real
SmolLM2 fp32 bundle: exactly the synchronous loop's greedy tokens, logprobs and finish reasons, with
concurrent requests of different lengths, stop tokens, chunked prefill, prefix caching, a cancel
mid-stream, preemption in a tiny KV pool and a failing step. On CPU torch ops are synchronous: this
checks the loop's logic, not its speed."""
from __future__ import annotations

import pytest
import torch

from backend.engine.sampling_params import SamplingParams
from backend.runtime.spec import EngineError

pytestmark = pytest.mark.slow


def _executor(make_executor, **kw):
    return make_executor(start=False, **{"max_kv_tokens": 2048, **kw})


def _run(ex, prompts, params):
    return [(r.token_ids, r.logprobs, r.finish_reason) for r in ex.generate(prompts, params)]


def _spy_late_rows(ex):
    """Count decode rows whose input token came from the previous step's device samples."""
    real = ex.inputs.prepare
    seen = {"late": 0}

    def prepare(out, late=None):
        inputs = real(out, late)
        if inputs.late_dst is not None:
            seen["late"] += int(inputs.late_dst.numel())
        return inputs

    ex.inputs.prepare = prepare
    return seen


def test_overlap_is_a_runtime_choice(make_executor):
    assert _executor(make_executor).overlap is None           # auto on CPU: synchronous
    assert _executor(make_executor, overlap_scheduling=True).overlap is not None
    with pytest.raises(EngineError, match="overlap_scheduling: 'yes'; allowed: auto, true, false"):
        _executor(make_executor, overlap_scheduling="yes")


class _Drafter:                       # any speculator: its drafts need each step's tokens on the host
    capture_hidden_layers = ()


def test_speculation_keeps_the_synchronous_loop(make_executor):
    assert _executor(make_executor, speculator=_Drafter()).overlap is None
    with pytest.raises(EngineError, match="overlap_scheduling: true cannot run with speculative decoding"):
        _executor(make_executor, speculator=_Drafter(), overlap_scheduling=True)


def test_a_speculator_attached_later_chooses_the_loop_again(make_executor):
    """`attach`, the benchmarks and tests set ``executor.speculator`` after construction. On a GPU the
    "auto" loop is the overlapped one, which never calls a speculator: left running, it silently
    decoded without drafts (seen on an H100: EAGLE-3 k=4 cost exactly a plain pass, 0 drafts)."""
    ex = _executor(make_executor)
    ex.device = torch.device("cuda")      # only the loop choice reads it here; nothing runs on it
    ex.speculator = None
    assert ex.overlap is not None         # auto on a CUDA device: overlapped
    ex.speculator = _Drafter()
    assert ex.overlap is None             # ... and synchronous once a speculator is attached
    ex.speculator = None
    assert ex.overlap is not None
    forced = _executor(make_executor, overlap_scheduling=True)
    loop = forced.overlap
    with pytest.raises(EngineError, match="overlap_scheduling: true cannot run with speculative decoding"):
        forced.speculator = _Drafter()
    assert forced.speculator is None and forced.overlap is loop     # refused: nothing changed


def test_same_tokens_logprobs_and_stops_as_the_synchronous_loop(make_executor, varied_prompts):
    sync = _executor(make_executor, max_num_tokens=64)
    over = _executor(make_executor, max_num_tokens=64, overlap_scheduling=True)
    prompts = [varied_prompts[i] for i in (0, 1, 3, 10, 12, 13, 14, 7)]
    ref = sync.generate(prompts[:3], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    # a token of the greedy continuation that does not occur before it: the stop lands right there
    mid = next(i for i in range(2, 8) if ref[0].token_ids[i] not in ref[0].token_ids[:i])
    stop_mid = ref[0].token_ids[mid]
    last = next(i for i in range(7, 2, -1) if ref[1].token_ids[i] not in ref[1].token_ids[:i])
    stop_last = ref[1].token_ids[last]
    params = [
        SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[stop_mid], logprobs=3),
        # the stop token is also the last token max_tokens allows: "stop", as synchronously
        SamplingParams(max_tokens=last + 1, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_last]),
        SamplingParams(max_tokens=1, temperature=0.0, logprobs=1),
        SamplingParams(max_tokens=17, temperature=0.0, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=24, temperature=0.0),                  # chat: may stop at EOS
        SamplingParams(max_tokens=24, temperature=0.0, min_tokens=5),
        SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=11, temperature=0.0, stop_token_ids=[ref[2].token_ids[2]]),
    ]
    late = _spy_late_rows(over)
    expected = _run(sync, prompts, params)
    got = _run(over, prompts, params)
    assert got == expected
    assert expected[0][2] == "stop" and len(expected[0][0]) == mid + 1
    assert expected[1][2] == "stop" and len(expected[1][0]) == last + 1
    assert late["late"] > 0, "no decode row took its input token on the device"
    for ex in (sync, over):
        s = ex.stats()
        assert s["kv_blocks_used"] == 0 and s["running"] == 0 and s["waiting"] == 0
    assert over.overlap.pending is None


def test_seeded_sampling_matches(make_executor, varied_prompts):
    params = [SamplingParams(max_tokens=8, temperature=0.9, top_k=50, top_p=0.95, seed=7 + i, logprobs=1)
              for i in range(3)]
    prompts = [varied_prompts[i] for i in (2, 5, 8)]
    expected = _run(_executor(make_executor), prompts, params)
    assert _run(_executor(make_executor, overlap_scheduling=True), prompts, params) == expected


def test_history_reading_rows_still_match(make_executor, varied_prompts):
    """Penalties and bad words read earlier tokens' values: those steps resolve the step in flight
    first (the host knows every token they read)."""
    prompts = [varied_prompts[i] for i in (0, 4)]
    params = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, repetition_penalty=1.3),
              SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, bad_token_ids=[[198, 198]])]
    expected = _run(_executor(make_executor), prompts, params)
    assert _run(_executor(make_executor, overlap_scheduling=True), prompts, params) == expected


def test_prefix_cache_over_generated_tokens(make_executor, varied_prompts):
    """A prompt that continues an earlier request's output hits the blocks holding its generated
    tokens: hashed with the real tokens, never a placeholder."""
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    hits = {}
    for overlap in (False, True):
        ex = _executor(make_executor, overlap_scheduling=overlap)
        first = ex.generate([varied_prompts[2]], params)[0]
        again = varied_prompts[2] + first.token_ids[:36] + [28]
        second = ex.generate([again], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
        hits[overlap] = (first.token_ids, second.token_ids, ex.stats()["prefix_cache_hits"])
    assert hits[True] == hits[False]
    assert hits[True][2] >= 32


def test_preemption_in_a_tiny_pool(make_executor, varied_prompts):
    prompts = [varied_prompts[i % 12][:24] + [30 + i] for i in range(16)]
    params = [SamplingParams(max_tokens=6 + i % 5, temperature=0.0, ignore_eos=i % 3 != 0) for i in range(16)]
    expected = _run(_executor(make_executor), prompts, params)
    small = _executor(make_executor, max_kv_tokens=128, enable_prefix_caching=False, overlap_scheduling=True)
    assert _run(small, prompts, params) == expected
    s = small.stats()
    assert s["preemptions"] > 0
    assert s["kv_blocks_used"] == 0 and s["kv_blocks_free"] == s["kv_blocks_total"]
    assert s["running"] == 0 and s["waiting"] == 0


def test_cancel_mid_stream(make_executor, varied_prompts):
    """Threaded loop: a cancel ends the stream with exactly one final event and frees its blocks;
    the request running beside it gets the synchronous tokens."""
    other_params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    expected = _executor(make_executor).generate([varied_prompts[0]], other_params)[0].token_ids
    ex = make_executor(overlap_scheduling=True)
    h = ex.submit(varied_prompts[10], SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True))
    other = ex.submit(varied_prompts[0], other_params)
    events = []
    for ev in h:
        events.append(ev)
        if len(events) == 3:
            ex.cancel(h.request_id)
    assert events[-1].finished and events[-1].finish_reason == "cancelled"
    assert sum(ev.finished for ev in events) == 1
    assert 3 <= sum(len(ev.token_ids) for ev in events) < 400
    assert other.result().token_ids == expected
    s = ex.stats()
    assert s["kv_blocks_used"] == 0 and s["running"] == 0 and s["waiting"] == 0


def test_cancel_between_manual_steps_keeps_the_others_exact(make_executor, varied_prompts):
    prompts = [varied_prompts[i] for i in (0, 3, 9)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = [r.token_ids for r in _executor(make_executor).generate(prompts, params)]
    ex = _executor(make_executor, overlap_scheduling=True)
    handles = [ex.submit(p, params) for p in prompts]
    for _ in range(5):
        ex.step()                     # a step is in flight after each of these
    assert ex.overlap.pending is not None
    ex.cancel(handles[1].request_id)
    while not all(h.finished for h in handles):
        ex.step()
    res = [h.result() for h in handles]
    assert res[1].finish_reason == "cancelled" and len(res[1].token_ids) < 12
    assert res[1].token_ids == expected[1][:len(res[1].token_ids)]
    assert [res[0].token_ids, res[2].token_ids] == [expected[0], expected[2]]
    assert ex.stats()["kv_blocks_used"] == 0


def test_a_failing_step_ends_its_requests_and_the_one_in_flight(make_executor, varied_prompts):
    ex = make_executor(overlap_scheduling=True)
    real = ex.runner.execute
    calls = {"n": 0}

    def flaky(*args, **kw):
        calls["n"] += 1
        if calls["n"] == 3:           # a step fails while the previous one's tokens are in flight
            raise RuntimeError("injected device failure")
        return real(*args, **kw)

    ex.runner.execute = flaky
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    bad = [ex.submit(p, params) for p in varied_prompts[:2]]
    results = [h.result() for h in bad]
    assert all(r.finish_reason == "error" and "injected device failure" in r.error for r in results)
    good = ex.submit(varied_prompts[0], params).result()
    assert good.finish_reason == "length" and len(good.token_ids) == 12
    s = ex.stats()
    assert s["step_errors"] == 1 and s["kv_blocks_used"] == 0


def test_shutdown_delivers_the_step_in_flight(make_executor, varied_prompts):
    ex = _executor(make_executor, overlap_scheduling=True)
    h = ex.submit(varied_prompts[0], SamplingParams(max_tokens=1, temperature=0.0))
    ex.step()                         # its only token is still on its way to the host
    assert not h.finished and ex.overlap.pending is not None
    ex.shutdown()
    r = h.result()
    assert r.finish_reason == "length" and len(r.token_ids) == 1


def test_one_device_to_host_wait_per_step(make_executor, varied_prompts, monkeypatch):
    """The loop's only wait for the device is HostCopy.wait, once per launched step (on CUDA: the
    event of that step's one packed copy). A second host sync per step would have to be added
    outside it, in plain sight; the sampler and input preparation send everything without blocking."""
    from backend.engine.overlap import HostCopy
    ex = _executor(make_executor, overlap_scheduling=True)
    counts = {"wait": 0, "execute": 0}
    real_wait, real_execute = HostCopy.wait, ex.runner.execute

    def wait(handle):
        counts["wait"] += 1
        return real_wait(handle)

    def execute(*args, **kw):
        counts["execute"] += 1
        return real_execute(*args, **kw)

    monkeypatch.setattr(HostCopy, "wait", staticmethod(wait))
    ex.runner.execute = execute
    ex.generate([varied_prompts[i] for i in (0, 3, 5)],
                SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2))
    assert counts["execute"] >= 6 and counts["wait"] == counts["execute"]


def test_a_request_ending_at_its_prefill_among_steady_decodes(make_executor, varied_prompts):
    """The step after one where a max_tokens=1 request was prefilled beside the decodes runs exactly
    the decodes of the step before (the preparer's steady state), but the last step's samples start
    with the ended request's: each decode takes its own sample, not the one at its row."""
    over = _executor(make_executor, overlap_scheduling=True)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)
    one = SamplingParams(max_tokens=1, temperature=0.0, logprobs=1)
    handles = [over.submit(varied_prompts[i], params) for i in (0, 1, 3)]
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in over.scheduler.running) or \
            over.scheduler.num_waiting:
        over.step()
    over.step()                           # steady decode: the same three sequences again
    ended = over.submit(varied_prompts[5], one)
    while over.step():
        pass
    assert over.scheduler.num_steps >= 8
    got = [(r.token_ids, r.logprobs, r.finish_reason) for r in (h.result() for h in handles + [ended])]
    sync = _executor(make_executor)
    assert got == _run(sync, [varied_prompts[i] for i in (0, 1, 3)], params) + _run(sync, [varied_prompts[5]], one)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_raising_event_callback_is_logged_and_the_others_are_served(make_executor, varied_prompts,
                                                                      overlap, caplog):
    """Both loops hand a running request's token straight to its handle (not through the slow path of RequestTable.deliver):
    a consumer callback that raises there, and on the final event, is logged with its request id and
    changes nothing for the request beside it (the same prompt: the same greedy tokens), nor for
    the raising request's own tokens."""
    ex = _executor(make_executor, overlap_scheduling=overlap)
    assert (ex.overlap is not None) == overlap
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=1)
    seen = []

    def bad(ev):
        seen.append(ev)
        raise RuntimeError("consumer bug")

    ex.submit(varied_prompts[0], params, request_id="bad", on_event=bad)
    good = ex.submit(varied_prompts[0], params, request_id="good")
    with caplog.at_level("ERROR", logger="kiln"):
        while ex.step():
            pass
    r = good.result()
    assert r.finish_reason == "length" and len(r.token_ids) == 5 and len(r.logprobs) == 5
    assert [len(ev.token_ids) for ev in seen] == [1] * 5 and [ev.finished for ev in seen].count(True) == 1
    assert [t for ev in seen for t in ev.token_ids] == r.token_ids
    assert [lp for ev in seen for lp in ev.logprobs] == r.logprobs
    failed = [rec for rec in caplog.records if "the response callback failed" in rec.getMessage()]
    assert len(failed) == 5 and all("[request bad]" in rec.getMessage() for rec in failed)
    assert not ex.table.handles       # every final event was delivered
