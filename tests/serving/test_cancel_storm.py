"""Cancellation on the real server: a storm of client-cancelled ``bls`` streams, who may stop a
request by id (``stop_request``), and the error/cancellation counters on ``/metrics``.

Before the fix, 200 cancels at concurrency 32 on ``bls`` crashed tritonserver (std::bad_weak_ptr or
SIGSEGV under TRITONBACKEND_OutputBuffer, 3 of 3 fresh servers, after ~100-150 cancels), and every
cancelled stream left a thread of the bls stub blocked for ever in its engine iterator. The full
size (1,000 cancels at concurrency 64) is ``harness.cancel_storm.cancel_storm`` with its defaults.
"""
from __future__ import annotations

import asyncio
import time
import uuid

import numpy as np
import pytest
import requests

from harness.cancel_storm import cancel_storm, wait_threads
from harness.model_names import DEFAULT as NAMES
from harness.serving_server import TritonServer

pytestmark = [pytest.mark.slow, pytest.mark.server]

MODELS = tuple(NAMES.as_dict().values())
GREEDY = ("The capital of France is", 16)
EXIT_TIMEOUT = 10        # --exit-timeout-secs of the storm's server
# Tolerances after the storm (justified in the test): threads the stub may start once, lazily,
# and RSS the allocator keeps (arenas, freed thread stacks) without it being a leak.
THREAD_SLACK = 4
RSS_SLACK_KB = 16 * 1024


def _inputs(**tensors):
    import tritonclient.grpc as g
    out = []
    for name, arr in tensors.items():
        arr = np.asarray(arr)[None]  # one request's tensor, batch dimension first (max_batch_size > 0)
        dt = {np.dtype(np.int32): "INT32", np.dtype(np.float32): "FP32", np.dtype(bool): "BOOL"}.get(arr.dtype, "BYTES")
        inp = g.InferInput(name, list(arr.shape), dt)
        inp.set_data_from_numpy(arr)
        out.append(inp)
    return out


def _text_inputs(text: str, **kw):
    t = {"text_input": np.array([text.encode()], dtype=object)}
    for k, v in kw.items():
        t[k] = np.array([v], np.float32 if isinstance(v, float) else bool if isinstance(v, bool) else np.int32)
    return _inputs(**t)


async def _stream(url: str, model: str, inputs, *, request_id: str = "", cancel_after: int | None = None,
                  on_piece=None, timeout: float = 120.0) -> dict:
    """One request on its own gRPC stream (tritonclient.grpc.aio): pieces, error, finish."""
    import tritonclient.grpc.aio as aio
    client = aio.InferenceServerClient(url)
    # "ended": the server closed the stream without an error (a stop_request's answer is one final
    # response with no outputs).
    out = {"pieces": [], "error": None, "final": False, "cancelled": False, "finish_reason": None,
           "ended": False}

    async def reqs():
        yield {"model_name": model, "inputs": inputs, "request_id": request_id}

    async def read():
        it = client.stream_infer(reqs())
        async for result, error in it:
            if error is not None:
                out["error"] = out["error"] or str(error)
                continue  # final too: read to the end (harness.serving_client READ_TO_THE_END)
            for name in ("text_output", "output_ids"):
                arr = result.as_numpy(name)
                if arr is not None and arr.size:
                    out["pieces"].append(arr.reshape(-1)[0].decode() if arr.dtype == object else arr.tolist())
                    if on_piece is not None:
                        on_piece()
            reason = result.as_numpy("finish_reason")
            if reason is not None and reason.size and reason.reshape(-1)[0]:
                out["finish_reason"] = reason.reshape(-1)[0].decode()
            final = result.get_response().parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                out["final"] = True
                continue  # the server ends the stream next (harness.serving_client READ_TO_THE_END)
            if cancel_after is not None and len(out["pieces"]) >= cancel_after:
                it.cancel()
                out["cancelled"] = True
                return
        out["ended"] = True
    try:
        await asyncio.wait_for(read(), timeout)
    finally:
        await client.close()
    return out


def _greedy(url: str) -> str:
    text, n = GREEDY
    res = asyncio.run(_stream(url, NAMES.bls, _text_inputs(text, max_tokens=n, temperature=0.0, stream=True)))
    assert res["error"] is None and res["final"], res
    return "".join(res["pieces"])


def _errors(srv, model: str, kind: str) -> float:
    """kiln_request_errors_total of one model and kind (summed over instances)."""
    total, seen = 0.0, False
    for line in requests.get(srv.metrics_url, timeout=10).text.splitlines():
        if line.startswith("kiln_request_errors_total{") and f'model="{model}"' in line and f'kind="{kind}"' in line:
            total += float(line.rsplit(" ", 1)[1])
            seen = True
    assert seen, f"kiln_request_errors_total{{model={model}, kind={kind}}} missing"
    return total


def _wait_for(fn, want, timeout: float = 15.0):
    """Poll fn() until it returns want (metrics of a request are published as it ends)."""
    deadline = time.monotonic() + timeout
    while (got := fn()) != want and time.monotonic() < deadline:
        time.sleep(0.1)
    return got


def test_bls_cancel_storm_keeps_the_server_up_and_leaves_nothing_behind(serving_build):
    """200 client-cancelled bls streams at concurrency 32 (one normal request per three of them).

    Tolerances, measured against the stub after a small warm-up storm (so that helper threads the
    Python backend and numpy start once, lazily, and the allocator's per-thread arenas already
    exist): threads at most THREAD_SLACK above idle within 30 s (a cancelled stream's thread ends
    once the engine's final for it arrived, within a step after the stop; the leak this guards
    against was one thread per cancelled stream, ~200 here); RSS at most RSS_SLACK_KB (16 MiB) above
    idle once the bls model released the finished engine iterators it keeps for GRACE_S (glibc keeps
    freed arenas and stacks of a 32-thread burst: 3-7 MiB measured; the old leak kept ~90 KiB of
    thread per stream plus every response of its engine stream)."""
    from backend.serving.text_models.bls import GRACE_S
    srv = TritonServer(serving_build / "model_repository", model_control="explicit", load_models=MODELS,
                       exit_timeout=EXIT_TIMEOUT).start()
    try:
        before = _greedy(srv.grpc_url)
        assert before
        warm = cancel_storm(srv, cancels=8, concurrency=8)
        assert warm.ok(), warm
        time.sleep(GRACE_S + 0.5)
        _greedy(srv.grpc_url)  # releases the warm-up's engine iterators
        idle = wait_threads(srv, 10**6)
        report = cancel_storm(srv, cancels=200, concurrency=32, timeout_s=120, budget_s=600)
        failure = srv.failure()
        assert failure is None, f"{failure}; log {srv.log_file}:\n{srv.log_tail()}"
        assert report.ok(), (report.errors[:5], report.unanswered)
        assert report.cancelled == 200 and report.completed >= 60
        after = wait_threads(srv, idle.threads + THREAD_SLACK, timeout_s=30)
        assert after.pid == idle.pid, "the bls stub was restarted"
        assert after.threads <= idle.threads + THREAD_SLACK, (idle, after)
        time.sleep(GRACE_S + 0.5)
        assert _greedy(srv.grpc_url) == before  # same server, same greedy answer
        after = wait_threads(srv, idle.threads + THREAD_SLACK, timeout_s=30)
        assert after.rss_kb <= idle.rss_kb + RSS_SLACK_KB, (idle, after)
    finally:
        t0 = time.monotonic()
        code = srv.stop()
        stop_s = time.monotonic() - t0
    assert code == 0, f"tritonserver exited with {code} (1: its exit timeout expired); log {srv.log_file}"
    assert stop_s < EXIT_TIMEOUT + 5, stop_s


def _engine_inputs(srv, text: str, n: int):
    from backend.serving.conversion.tokenizer import load_tokenizer
    ids = load_tokenizer(srv.repo.parent / "engine").encode(text)
    return _inputs(input_ids=np.array(ids, np.int32), request_output_len=np.array([n], np.int32),
                   min_tokens=np.array([n], np.int32), streaming=np.array([True]))


async def _stop(url: str, request_id: str) -> dict:
    return await _stream(url, NAMES.engine, _inputs(stop_request=np.array([True])), request_id=request_id)


def test_stop_request_needs_an_unguessable_id(triton_server):
    """A stop_request may only name a long (unguessable) id: a short one is refused with an error
    that says what to do, and the request with that id keeps running; its owner, who started it
    with a UUID, stops it and gets tensorrtllm_backend's final response (finish_reason cancelled)."""
    url = triton_server.grpc_url

    async def go(request_id: str):
        started = asyncio.Event()
        job = asyncio.create_task(_stream(url, NAMES.engine, _engine_inputs(triton_server, "Write a long story.", 600),
                                          request_id=request_id, on_piece=started.set))
        await asyncio.wait_for(started.wait(), 60)
        stop = await _stop(url, request_id)
        await asyncio.sleep(1.5)  # a stop that worked ends the stream within a step
        running = not job.done()
        if running:  # end it the way every client can: close the stream
            job.cancel()
        try:
            res = await job
        except asyncio.CancelledError:
            res = None
        return stop, running, res

    stop, running, _ = asyncio.run(go("12345"))
    assert stop["error"] and "unguessable" in stop["error"] and "UUID" in stop["error"], stop
    assert running, "a stop_request with a short id stopped the request"

    owner = str(uuid.uuid4())
    stop, running, res = asyncio.run(go(owner))
    assert stop["error"] is None and stop["ended"] and not stop["pieces"], stop
    assert not running and res["error"] is None and res["final"] and res["finish_reason"] == "cancelled", res
    assert len(res["pieces"]) < 600


def test_cancellations_and_invalid_requests_move_the_error_counters(triton_server):
    srv, url = triton_server, triton_server.grpc_url
    cancelled = {m: _errors(srv, m, "cancelled") for m in (NAMES.bls, NAMES.engine)}
    invalid = {m: _errors(srv, m, "invalid_request") for m in (NAMES.bls, NAMES.engine, NAMES.preprocessing)}
    other = {(m, k): _errors(srv, m, k) for m in (NAMES.bls, NAMES.engine) for k in ("engine", "unavailable", "internal")}

    # a bls stream its client cancels: bls counts the cancellation, the engine the inner request it stopped
    res = asyncio.run(_stream(url, NAMES.bls, _text_inputs("Write a long story about a dragon.", max_tokens=600,
                                                       min_tokens=600, temperature=0.0, stream=True),
                              cancel_after=2))
    assert res["cancelled"]
    assert _wait_for(lambda: _errors(srv, NAMES.bls, "cancelled"), cancelled[NAMES.bls] + 1) == cancelled[NAMES.bls] + 1
    assert _wait_for(lambda: _errors(srv, NAMES.engine, "cancelled"), cancelled[NAMES.engine] + 1) == cancelled[NAMES.engine] + 1

    # an engine client that closes its stream
    res = asyncio.run(_stream(url, NAMES.engine, _engine_inputs(srv, "Write a long story.", 600), cancel_after=2))
    assert res["cancelled"]
    assert _wait_for(lambda: _errors(srv, NAMES.engine, "cancelled"), cancelled[NAMES.engine] + 2) == cancelled[NAMES.engine] + 2

    # invalid requests, counted by the model that refuses them
    res = asyncio.run(_stream(url, NAMES.bls, _text_inputs("Hi", max_tokens=0)))
    assert res["error"] and "max_tokens" in res["error"]
    res = asyncio.run(_stream(url, NAMES.ensemble, _text_inputs("Hi", top_p=1.5)))
    assert res["error"] and "top_p" in res["error"]
    bad = _engine_inputs(srv, "Hi", 4) + _inputs(temperature=np.array([-1.0], np.float32))
    res = asyncio.run(_stream(url, NAMES.engine, bad))
    assert res["error"] and "temperature" in res["error"]
    for m in (NAMES.bls, NAMES.engine, NAMES.preprocessing):
        assert _wait_for(lambda m=m: _errors(srv, m, "invalid_request"), invalid[m] + 1) == invalid[m] + 1, m
    # nothing was counted as anything else
    assert {(m, k): _errors(srv, m, k) for (m, k) in other} == other
    exported = requests.get(srv.metrics_url, timeout=10).text
    for name in ("kiln_preemptions_total", "kiln_engine_step_errors_total", "kiln_engine_failures_total"):
        assert name + "{" in exported, name
