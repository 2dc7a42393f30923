"""Clean shutdown under load (#17): the server stops while long streams run on ``tensorrt_llm_bls``,
``ensemble`` and ``tensorrt_llm`` (the engine); every model unloads within Triton's exit timeout,
the server exits 0 without a crash, and every client stream ends with a final response or an error.

Before the fix (Triton 24.10, nvidia-pytriton): SIGTERM with such streams in flight made the server
wait out --exit-timeout-secs ("Model 'ensemble' (version 1) has 3 in-flight inferences" every
second), give up ("Exit timeout expired. Exiting immediately."), exit 1 and abort on the way out
("malloc(): unaligned tcache chunk detected", Signal 6); the streams were cut by the dying process.
The mechanism is in backend/serving/engine_model/serving_state.py.
"""
from __future__ import annotations

import asyncio
import re
import threading
import time

import pytest

from harness.model_names import DEFAULT as NAMES
from harness.serving_server import TritonServer
from tests.serving.test_cancel_storm import _engine_inputs, _stream, _text_inputs


EXIT_TIMEOUT = 10      # --exit-timeout-secs
STOP_SLACK_S = 5       # the drain handshake and process tear-down around Triton's own wait
PER_MODEL = 3          # long streams per model (9 in all on 2 cores: each still streams every step)
LONG = ("Write a long story about a dragon.", 600)
STREAM_BOUND_S = EXIT_TIMEOUT + 60  # a stream not ended by then hangs (the test fails on it)
# a crash on the way out; "Signal (15) received." is Triton noting the SIGTERM itself
CRASH = re.compile(r"Signal \((?!15\))\d+\)|Segmentation|terminate called|core dumped|malloc\(\)|double free")


def _jobs(srv, models) -> dict[str, tuple]:
    text, n = LONG
    out = {}
    for i in range(PER_MODEL):
        if NAMES.bls in models:
            out[f"bls-{i}"] = (NAMES.bls, _text_inputs(text, max_tokens=n, min_tokens=n, temperature=0.0,
                                                       stream=True))
        if NAMES.ensemble in models:
            out[f"ensemble-{i}"] = (NAMES.ensemble, _text_inputs(text, max_tokens=n, min_tokens=n,
                                                                 temperature=0.0, stream=True))
        if NAMES.engine in models:
            out[f"engine-{i}"] = (NAMES.engine, _engine_inputs(srv, text, n))
    return out


def _stop_under_load(srv, jobs: dict, stop) -> tuple[int | None, float, dict, list]:
    """Open every stream, wait until each streamed a piece, run ``stop()`` (-> exit code) and
    collect every stream's outcome (its result dict, or the exception that ended it)."""
    started = {name: threading.Event() for name in jobs}
    results: dict[str, object] = {}

    async def go():
        loop = asyncio.get_running_loop()
        tasks = {name: asyncio.create_task(_stream(srv.grpc_url, model, inputs, on_piece=started[name].set,
                                                   timeout=STREAM_BOUND_S))
                 for name, (model, inputs) in jobs.items()}
        deadline = time.monotonic() + 120
        while not all(e.is_set() for e in started.values()) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        not_started = sorted(k for k, e in started.items() if not e.is_set())
        t0 = time.monotonic()
        code = await loop.run_in_executor(None, stop)
        stop_s = time.monotonic() - t0
        for name, task in tasks.items():
            try:
                results[name] = await task
            except BaseException as e:  # noqa: BLE001 - asserted by the caller
                results[name] = e
        return code, stop_s, not_started

    code, stop_s, not_started = asyncio.run(go())
    return code, stop_s, results, not_started


def _check_exit(srv, code, stop_s, not_started) -> str:
    log = srv.log_file.read_text(errors="replace")
    tail = "\n".join(log.splitlines()[-40:])
    assert not not_started, f"streams without a first piece within 120 s: {not_started}"
    assert code == 0, f"tritonserver exited with {code} after {stop_s:.1f} s (1: its exit timeout expired); " \
                      f"log {srv.log_file}:\n{tail}"
    assert stop_s < EXIT_TIMEOUT + STOP_SLACK_S, f"stopping took {stop_s:.1f} s"
    crash = CRASH.search(log)
    assert crash is None, f"{crash.group(0)!r} in the server log {srv.log_file}:\n{tail}"
    return log


def _ended(name: str, res) -> dict:
    """The stream ended by the server with a final response or an error (not cut off, not hung)."""
    assert isinstance(res, dict), f"{name}: the stream did not end with a final or an error: {res!r}"
    assert res["final"] or res["error"], f"{name}: {res}"
    assert len(res["pieces"]) < LONG[1], f"{name} ran to its end: stopping did not cut it"
    return res


@pytest.mark.slow
@pytest.mark.server
def test_stop_with_streams_in_flight_on_every_model_is_clean(serving_build):
    """``TritonServer.stop`` (harness.serve's Ctrl-C / SIGTERM): the engine drains first, then the
    server gets its SIGTERM. bls clients get an error that says why, engine clients a normal final
    with finish_reason "cancelled" (tensorrtllm_backend's stop), ensemble clients their final."""
    srv = TritonServer(serving_build / "model_repository", model_control="explicit",
                       load_models=tuple(NAMES.as_dict().values()), exit_timeout=EXIT_TIMEOUT).start()
    try:
        jobs = _jobs(srv, (NAMES.bls, NAMES.ensemble, NAMES.engine))
        code, stop_s, results, not_started = _stop_under_load(srv, jobs, srv.stop)
    finally:
        srv.stop()  # a no-op once stopped
    _check_exit(srv, code, stop_s, not_started)
    for name, res in results.items():
        res = _ended(name, res)
        if name.startswith("bls"):
            assert res["error"] and "shutting down" in res["error"], (name, res)
        elif name.startswith("engine"):
            assert res["error"] is None and res["finish_reason"] == "cancelled", (name, res)
        else:
            assert res["error"] is None and res["final"], (name, res)


# ---- ServingState: the engine's signal, without a server ----------------------------------------

def test_serving_state_drain_handshake(tmp_path, monkeypatch):
    """The harness's side: a drain request in the folder; the engine registered itself at start and
    acknowledges once idle (harness.serving_server.TritonServer.drain waits for that)."""
    import os
    from backend.serving.engine_model.serving_state import (DRAIN_DIR_ENV, DRAIN_REQUEST, SHUTTING_DOWN, ServingState,
                                               engine_marker, idle_marker)
    monkeypatch.setenv(DRAIN_DIR_ENV, str(tmp_path))
    st = ServingState("tensorrt_llm")
    assert engine_marker(tmp_path, os.getpid()).exists()
    assert st.stopped() is None
    (tmp_path / DRAIN_REQUEST).touch()
    assert st.stopped() == SHUTTING_DOWN
    (tmp_path / DRAIN_REQUEST).unlink()
    assert st.stopped() == SHUTTING_DOWN  # final: a drained engine never serves again
    assert not idle_marker(tmp_path, os.getpid()).exists()
    st.idle()
    assert idle_marker(tmp_path, os.getpid()).exists()
    monkeypatch.setenv(DRAIN_DIR_ENV, str(tmp_path / "missing"))
    assert ServingState("tensorrt_llm").drain_dir is None  # cannot register: not waited for
    monkeypatch.delenv(DRAIN_DIR_ENV)
    assert ServingState("tensorrt_llm").stopped() is None  # no drain folder: serves on
