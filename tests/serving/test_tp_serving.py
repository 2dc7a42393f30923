"""Tensor parallelism through the real Triton server (#20): the serving bundle built with
``engine.tp_size=3`` (SmolLM2's 3 KV heads; rank 0 in the engine model's stub, two spawned worker
processes, joined by gloo on this CPU).

Streaming through the ensemble and the engine model gives the TP1 executor's greedy text; a cancelled bls
stream's blocks return to the pool (rank 0's block manager decides for every rank: the ranks hold
the same block ids) and reused blocks still give the right text on every rank; killing one worker
ends every in-flight stream with an error naming it, takes the server down (harness.serve exits 3,
readiness stops answering) and leaves no process behind.
"""
from __future__ import annotations

import asyncio
import os
import signal
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from harness.model_names import DEFAULT as NAMES
from harness.serving_server import free_port, stub_processes
from tests.serving.conftest import PROMPTS, SERVING_CONFIG, SERVING_OVERRIDES, _server
from tests.serving.serve_process import (LongStreams, alive, children, group_members, server_pid, start_serve,
                                        stop_serve)
from tests.serving.test_cancel_storm import _stream, _text_inputs
from tests.serving.server_helpers import _streams, metric, wait_kv_idle

pytestmark = [pytest.mark.slow, pytest.mark.server]

TP = 3


@pytest.fixture(scope="module")
def tp_build(build_bundle) -> Path:
    root = Path(build_bundle(SERVING_CONFIG, [*SERVING_OVERRIDES, f"engine.tp_size={TP}"])).parent
    return root


@pytest.fixture(scope="module")
def tp_server(tp_build):
    with _server(tp_build) as srv:
        yield srv


def _workers(server: int) -> list[int]:
    """The tensor-parallel worker processes: the spawned children of the engine model's stub (the
    multiprocessing resource tracker is a child too, and is not a rank)."""
    [engine] = [p for p, model in stub_processes(server).items() if model == NAMES.engine]
    out = []
    for pid in children(engine):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():
                out.append(pid)
    return out


def test_tp3_streams_the_tp1_text_through_ensemble_and_engine(tp_server, reference, text_tokenizer):
    """Both prompts at once (one batch on every rank), streamed through the ensemble, then the engine
    model with NVIDIA's tensor names, each equal to the TP1 executor's greedy text."""
    assert len(_workers(tp_server.proc.pid)) == TP - 1

    async def both():
        return await asyncio.gather(*[
            _stream(tp_server.grpc_url, NAMES.ensemble,
                    _text_inputs(text, max_tokens=n, temperature=0.0, stream=True))
            for text, n in PROMPTS.values()])
    for key, res in zip(PROMPTS, asyncio.run(both())):
        assert res["error"] is None and res["final"], res
        assert len(res["pieces"]) > 1                       # streamed, not one piece at the end
        assert "".join(res["pieces"]) == reference[key]

    from tests.serving.test_cancel_storm import _engine_inputs
    text, n = PROMPTS["paris"]
    res = asyncio.run(_stream(tp_server.grpc_url, NAMES.engine, _engine_inputs(tp_server, text, n)))
    assert res["error"] is None and res["final"], res
    ids = [int(i) for piece in res["pieces"] for i in np.asarray(piece).reshape(-1)]   # [1, beam, n] each
    assert text_tokenizer.decode(ids) == reference["paris"]


def test_tp3_cancellation_frees_the_blocks_and_reused_blocks_serve_right(tp_server, reference):
    """A client-cancelled long bls stream beside a short one: the short one gives TP1's text, the
    cancelled one's blocks are free again (no request left), and the next requests, whose KV lands
    in blocks the cancelled one wrote on every rank, still give TP1's text."""
    text, n = PROMPTS["paris"]
    done = metric(tp_server, "kiln_requests_finished_total")
    # on bls: Triton 24.10 never cancels an ensemble's engine step already streaming (test_server.py)
    cancelled, other = asyncio.run(_streams(tp_server.grpc_url, [
        (NAMES.bls, "Write a very long story about a dragon who learns to fly.",
         dict(max_tokens=600, min_tokens=600, temperature=0.0, cancel_after=3)),
        (NAMES.bls, text, dict(max_tokens=n, temperature=0.0))]))
    assert cancelled.cancelled and len(cancelled.pieces) == 3
    assert other.error is None and other.text == reference["paris"]
    used, free, total = wait_kv_idle(tp_server, finished=done + 2, timeout=30)
    assert used == 0 and free == total > 0
    for key, (text, n) in PROMPTS.items():
        again = asyncio.run(_stream(tp_server.grpc_url, NAMES.ensemble,
                                    _text_inputs(text, max_tokens=n, temperature=0.0, stream=True)))
        assert again["error"] is None and "".join(again["pieces"]) == reference[key]


def test_killing_a_tp_worker_ends_streams_with_errors_and_stops_cleanly(tp_build):
    """SIGKILL of rank 2 while three streams run: each ends with an error (none hangs), the engine
    model's stub fails and exits, harness.serve stops the server with exit code 3, readiness stops
    answering, and the surviving worker exits by itself (it is checked before the server's group is
    cleaned up, so harness.serve's own kill cannot be what stopped it)."""
    ports = [free_port() for _ in range(3)]
    proc, lines = start_serve(tp_build / "model_repository", ports)
    pid = server_pid(lines)
    assert pid is not None, "".join(lines)
    try:
        streams = LongStreams(ports[1], model=NAMES.ensemble)
        assert streams.started(180), f"streams did not start: {streams.results}"
        workers = _workers(pid)
        assert len(workers) == TP - 1
        os.kill(workers[-1], signal.SIGKILL)
        survivor = workers[0]
        deadline = time.monotonic() + 30
        while alive(survivor) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(survivor), "the surviving worker outlived its engine"
        rest, _ = proc.communicate(timeout=120)
        assert proc.returncode == 3, rest
        assert streams.all_failed(), f"a stream hangs or ended without an error: {streams.results}"
        # the final error responses name the dead rank (a stream whose RPC failed as the server went
        # has an exception instead)
        named = [r.error for r in streams.results if not isinstance(r, Exception)]
        assert all("tensor parallel" in e for e in named), named
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{ports[0]}/v2/health/ready", timeout=5)
        assert group_members(pid) == []
    finally:
        stop_serve(proc, pid)
