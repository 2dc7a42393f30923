"""Cancelling an ``ensemble`` stream on the real Triton 24.10 server.

Measured (2026-11-26, instrumented engine model, one ensemble stream cancelled after 3 pieces):
the engine step never learns of it. ``request.is_cancelled()`` and ``response_sender.is_cancelled()``
(which exists in this Python backend) stay false for the whole request, and every
``response_sender.send()`` returns None (the ensemble keeps accepting and drops the responses), so
the request ran on to max_tokens with its KV blocks held. The ensemble does forward the client's
request id to its steps, so the client stops the engine request by id: it starts the stream with a
UUID and, when it cancels, sends ``stop_request`` with that id to the engine model
(``harness.serving_client.stop_request``; model_repository/README.md "Cancellation").
"""
from __future__ import annotations

import asyncio
import time
import uuid

import pytest
import requests

from harness.model_names import DEFAULT as NAMES
from harness.serving_client import stop_request
from tests.serving.test_cancel_storm import _errors, _stream, _text_inputs, _wait_for

pytestmark = [pytest.mark.slow, pytest.mark.server]

LONG = ("Write a long story about a dragon.", 600)   # runs ~20 s on 2 cores: a cancel must cut it
GREEDY = ("The capital of France is", 16)


def _engine_gauge(srv, name: str) -> float:
    total = 0.0
    for line in requests.get(srv.metrics_url, timeout=10).text.splitlines():
        if line.startswith(name + "{") and f'model="{NAMES.engine}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def _idle(srv) -> tuple[float, float]:
    return _engine_gauge(srv, "kiln_requests_running"), _engine_gauge(srv, "kiln_kv_blocks_used")


def _long_inputs():
    text, n = LONG
    return _text_inputs(text, max_tokens=n, min_tokens=n, temperature=0.0, stream=True)


def _greedy(url: str) -> str:
    text, n = GREEDY
    res = asyncio.run(_stream(url, NAMES.ensemble, _text_inputs(text, max_tokens=n, temperature=0.0, stream=True)))
    assert res["error"] is None and res["final"], res
    return "".join(res["pieces"])


async def _stop_only(url: str, rid: str) -> str | None:
    import tritonclient.grpc.aio as aio
    client = aio.InferenceServerClient(url)
    try:
        return await stop_request(client, NAMES.engine, rid)
    finally:
        await client.close()


async def _cancel_and_stop(url: str, request_id: str, *, stop: bool) -> tuple[dict, str | None]:
    """An ensemble stream its client cancels after 2 pieces; with ``stop``, then its stop_request."""
    res = await _stream(url, NAMES.ensemble, _long_inputs(), request_id=request_id, cancel_after=2)
    return res, (await _stop_only(url, request_id) if stop else None)


def test_closing_an_ensemble_stream_alone_does_not_reach_the_engine_but_a_stop_by_id_does(triton_server):
    """Pins the Triton 24.10 behaviour the README documents: after the client closed its ensemble
    stream the engine request is still running 2 s later; the stop_request by its id ends it within
    about a second (KV blocks freed, counted as cancelled by the engine)."""
    srv, url = triton_server, triton_server.grpc_url
    assert _wait_for(lambda: _idle(srv), (0.0, 0.0)) == (0.0, 0.0)
    cancelled = _errors(srv, NAMES.engine, "cancelled")
    rid = str(uuid.uuid4())
    res, _ = asyncio.run(_cancel_and_stop(url, rid, stop=False))
    assert res["cancelled"] and res["error"] is None, res
    time.sleep(2.0)
    running, used = _idle(srv)
    assert running == 1 and used > 0, ("the engine saw the ensemble's cancellation: update the README", running, used)
    t0 = time.monotonic()
    err = asyncio.run(_stop_only(url, rid))
    assert err is None, err
    assert _wait_for(lambda: _idle(srv), (0.0, 0.0), timeout=5) == (0.0, 0.0)
    assert time.monotonic() - t0 < 2.0
    assert _wait_for(lambda: _errors(srv, NAMES.engine, "cancelled"), cancelled + 1) == cancelled + 1


def test_cancelled_ensemble_streams_free_the_engine(triton_server):
    """N ensemble streams cancelled mid-generation (600 tokens each), each followed by its client's
    stop_request: running requests and used KV blocks are back to 0 within a few seconds, the engine
    counts N cancellations, the server stays healthy and greedy output is unchanged."""
    n = 8
    srv, url = triton_server, triton_server.grpc_url
    before = _greedy(url)
    assert before
    assert _wait_for(lambda: _idle(srv), (0.0, 0.0)) == (0.0, 0.0)
    cancelled = _errors(srv, NAMES.engine, "cancelled")

    async def storm():
        return await asyncio.gather(*(_cancel_and_stop(url, str(uuid.uuid4()), stop=True) for _ in range(n)))

    t0 = time.monotonic()
    results = asyncio.run(storm())
    for res, err in results:
        assert res["cancelled"] and res["error"] is None and err is None, (res, err)
    assert _wait_for(lambda: _idle(srv), (0.0, 0.0), timeout=5) == (0.0, 0.0), _idle(srv)
    assert time.monotonic() - t0 < 30  # far below the ~20 s x 8 the streams would have run
    assert _wait_for(lambda: _errors(srv, NAMES.engine, "cancelled"), cancelled + n) == cancelled + n
    assert srv.failure() is None, srv.log_tail()
    assert requests.get(f"http://{srv.http_url}/v2/health/ready", timeout=10).status_code == 200
    assert _greedy(url) == before


def test_a_slow_reading_ensemble_stream_is_not_cancelled(triton_server):
    """A client that reads slowly (0.2 s per piece, slower than the engine generates) gets every
    token and a normal final response; the engine counts no cancellation."""
    srv, url = triton_server, triton_server.grpc_url
    want = _greedy(url)
    cancelled = _errors(srv, NAMES.engine, "cancelled")
    text, n = GREEDY

    async def slow():
        import tritonclient.grpc.aio as aio
        client = aio.InferenceServerClient(url)
        pieces, final, error = [], False, None

        async def reqs():
            yield {"model_name": NAMES.ensemble, "request_id": str(uuid.uuid4()),
                   "inputs": _text_inputs(text, max_tokens=n, temperature=0.0, stream=True)}
        try:
            async for result, err in client.stream_infer(reqs()):  # read to the end
                if err is not None:
                    error = error or str(err)
                    continue
                out = result.as_numpy("text_output")
                if out is not None and out.size:
                    pieces.append(out.reshape(-1)[0].decode())
                fr = result.get_response().parameters.get("triton_final_response")
                final = final or bool(fr is not None and fr.bool_param)
                await asyncio.sleep(0.2)
        finally:
            await client.close()
        return pieces, final, error

    pieces, final, error = asyncio.run(slow())
    assert error is None and final, (error, final)
    assert "".join(pieces) == want
    time.sleep(1.0)
    assert _errors(srv, NAMES.engine, "cancelled") == cancelled
    assert _idle(srv) == (0.0, 0.0)
