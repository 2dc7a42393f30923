"""Helpers shared by the tests of a real Triton server (test_server.py, test_server_requests.py,
test_tp_serving.py): the two front-door models, concurrent gRPC streams, and Kiln's metrics."""
from __future__ import annotations

import asyncio
import time

import requests

from harness.model_names import DEFAULT as NAMES
from harness.serving_client import grpc_stream

MODELS = (NAMES.ensemble, NAMES.bls)


def run(coro):
    return asyncio.run(coro)


async def _streams(url, jobs):
    import tritonclient.grpc.aio as aio
    client = aio.InferenceServerClient(url)
    try:
        return await asyncio.gather(*(grpc_stream(client, model, text, **kw) for model, text, kw in jobs))
    finally:
        await client.close()


def metric(srv, name: str) -> float:
    total, seen = 0.0, False
    for line in requests.get(srv.metrics_url, timeout=10).text.splitlines():
        if line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
            seen = True
    assert seen, f"{name} missing from {srv.metrics_url}"
    return total


def wait_kv_idle(srv, finished: float, timeout: float = 15.0) -> tuple[float, float, float]:
    """Wait until ``kiln_requests_finished_total`` reaches ``finished``, no request runs and every KV
    block is free; return (used, free, total).

    The finished count comes first: the gauges are published every 0.5 s and when a request ends, so
    a request that began after the last publication and was cancelled before the next one leaves the
    idle gauges of before it, and idle gauges alone would pass before the engine saw the cancel (and
    count it later, in another test's window)."""
    deadline = time.monotonic() + timeout
    while True:
        done = metric(srv, "kiln_requests_finished_total")
        used, free, total = (metric(srv, f"kiln_kv_blocks_{k}") for k in ("used", "free", "total"))
        running = metric(srv, "kiln_requests_running") + metric(srv, "kiln_requests_waiting")
        if (done >= finished and used == 0 and free == total and running == 0) or time.monotonic() > deadline:
            assert done >= finished, f"{done} requests finished after {timeout} s; expected {finished}"
            return used, free, total
        time.sleep(0.2)
