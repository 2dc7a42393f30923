"""The engine model's responder (backend/serving/engine_model/responder.py): responses made and sent off the loop.

The senders here are stand-ins that record or block, because what is under test is the queueing: one
FIFO (a request's responses in order, its FINAL last), the caller never waiting for a send, the
response made on the responder's thread, failures reported, flush and close. The real response sender
goes through the real Triton server in every serving test (test_server, test_ensemble_cancel, the soak),
all with the default (the responder's thread on).
"""
from __future__ import annotations

import contextlib
import threading

import pytest

from backend.serving.engine_model.responder import Responder


class Recorder:
    def __init__(self, block: threading.Event | None = None, fail_on=()):
        self.got: list = []
        self.block = block
        self.fail_on = set(fail_on)
        self.entered = threading.Event()

    def send(self, response, flags=0):
        self.entered.set()
        if self.block is not None:
            assert self.block.wait(10), "never released"
        if response in self.fail_on:
            raise RuntimeError(f"client gone before {response}")
        self.got.append((response, flags, threading.current_thread().name))


def made(value, where: list | None = None):
    def make():
        if where is not None:
            where.append(threading.current_thread().name)
        return value
    return make


def test_responses_go_out_in_the_order_they_were_queued_made_on_the_responder():
    r = Responder(True)
    try:
        senders, where = [Recorder() for _ in range(4)], []
        for i in range(100):
            for s in senders:
                r.send(s, made(i, where), 1 if i == 99 else 0)
        assert r.flush(10)
        for s in senders:
            assert s.got == [(i, 1 if i == 99 else 0, "kiln-responder") for i in range(100)]
        assert set(where) == {"kiln-responder"}
    finally:
        r.close(10)


def test_the_caller_does_not_wait_for_a_slow_send():
    r = Responder(True)
    release = threading.Event()
    try:
        slow = Recorder(block=release)
        r.send(slow, made("a"), 0)
        r.send(slow, made("b"), 0)       # queued behind the blocked send: returns at once
        assert slow.entered.wait(10)
        assert r.flush(0.05) is False    # still stuck in the first send
        assert slow.got == []
        release.set()
        assert r.flush(10)
        assert [x for x, _, _ in slow.got] == ["a", "b"]
    finally:
        release.set()
        r.close(10)


def test_a_failed_make_or_send_is_reported_and_the_rest_still_goes_out():
    r = Responder(True)
    errors = []

    def broken():
        raise ValueError("cannot make")
    try:
        s = Recorder(fail_on={"b"})
        for x in "abc":
            r.send(s, made(x), 0, on_error=lambda e, x=x: errors.append((x, str(e))))
        r.send(s, broken, 0, on_error=lambda e: errors.append(("made", str(e))))
        r.send(s, made("d"), 0, on_error=lambda e: 1 / 0)  # a failing handler is logged, not fatal
        r.send(s, made("e"), 0)
        assert r.flush(10)
        assert errors == [("b", "client gone before b"), ("made", "cannot make")]
        assert [x for x, _, _ in s.got] == ["a", "c", "d", "e"]
    finally:
        r.close(10)


def test_close_sends_what_was_queued_then_refuses_more():
    r = Responder(True)
    release = threading.Event()
    s = Recorder(block=release)
    for i in range(5):
        r.send(s, made(i), 0)
    threading.Timer(0.1, release.set).start()
    r.close(10)
    assert [x for x, _, _ in s.got] == [0, 1, 2, 3, 4]
    assert not r._worker.is_alive()
    with pytest.raises(AssertionError, match="closed"):
        r.send(s, made(5), 0)


def test_unthreaded_makes_and_sends_inline_on_the_callers_thread():
    r = Responder(False)
    errors = []
    s = Recorder(fail_on={"b"})
    r.send(s, made("a"), 0)
    r.send(s, made("b"), 0, on_error=errors.append)
    assert s.got == [("a", 0, threading.current_thread().name)] and len(errors) == 1
    assert r.flush(0) is True and r._worker is None


def joined(parts):
    return "+".join(parts)


@contextlib.contextmanager
def busy(r: Responder):
    """``r`` stuck in another stream's send for the block (what is queued meanwhile waits behind it;
    inline there is nothing to wait behind); afterwards everything queued is sent and ``r`` closed."""
    release = threading.Event()
    threaded = r._worker is not None
    blocker = Recorder(block=release if threaded else None)
    try:
        r.send(blocker, made("x"), 0)
        assert not threaded or blocker.entered.wait(10)
        yield
        release.set()
        assert r.flush(10)
    finally:
        release.set()
        r.close(10)


def test_parts_waiting_behind_a_send_join_into_one_response():
    r, errors = Responder(True), []
    a, b = Recorder(), Recorder()
    with busy(r):
        for i in range(3):
            r.send_part("a", a, f"a{i}", joined, 0, on_error=lambda e, i=i: errors.append(i))
            r.send_part("b", b, f"b{i}", joined, 0)
        r.send_part("a", a, "a3", joined, 1)     # the FINAL part joins too and closes the response
        r.send_part("a", a, "late", joined, 0)   # nothing joins a FINAL response: a new one
    assert a.got == [("a0+a1+a2+a3", 1, "kiln-responder"), ("late", 0, "kiln-responder")]
    assert b.got == [("b0+b1+b2", 0, "kiln-responder")]
    assert (r.responses, r.parts) == (4, 9)
    assert errors == []


def test_a_part_after_the_responder_took_the_response_starts_a_new_one():
    r = Responder(True)
    release = threading.Event()
    try:
        a = Recorder(block=release)
        r.send_part("a", a, "a0", joined, 0)
        assert a.entered.wait(10)                # a0 is being sent: a1 cannot join it any more
        r.send_part("a", a, "a1", joined, 0)
        r.send_part("a", a, "a2", joined, 0)
        release.set()
        assert r.flush(10)
        assert [x for x, _, _ in a.got] == ["a0", "a1+a2"]
    finally:
        release.set()
        r.close(10)


def test_a_plain_send_for_a_stream_keeps_its_later_parts_behind_it():
    r, a = Responder(True), Recorder()
    with busy(r):
        r.send_part("a", a, "a0", joined, 0)
        r.send(a, made("error"), 0, key="a")
        r.send_part("a", a, "a1", joined, 0)     # must not jump ahead of "error" into a0's response
    assert [x for x, _, _ in a.got] == ["a0", "error", "a1"]


@pytest.mark.parametrize("threaded", [True, False])
def test_without_coalescing_or_a_thread_every_part_is_a_response(threaded):
    r = Responder(threaded, coalesce=False) if threaded else Responder(False)
    a = Recorder()
    with busy(r):
        for i in range(3):
            r.send_part("a", a, f"a{i}", joined, 1 if i == 2 else 0)
    assert [(x, f) for x, f, _ in a.got] == [("a0", 0), ("a1", 0), ("a2", 1)]
    assert (r.responses, r.parts) == (4, 4)


def test_a_final_part_never_goes_out_ahead_of_a_response_queued_after_its_stream_s():
    """Rows of one request share its sender (RowGroup): row "a" has a response waiting, row "b" queues
    one behind it, then "a" ends the request (FINAL). Joined into a's waiting response, the FINAL would
    go out before b's tokens and end the request without them; it goes out last, after b's."""
    r = Responder(True)
    shared = Recorder()
    with busy(r):
        r.send_part("a", shared, "a0", joined, 0)
        r.send_part("b", shared, "b0", joined, 0)
        r.send_part("b", shared, "b1", joined, 0)   # b's own parts still join
        r.send_part("a", shared, "a1", joined, 1)   # the FINAL, behind b's response
    assert [(x, f) for x, f, _ in shared.got] == [("a0", 0), ("b0+b1", 0), ("a1", 1)]


def test_a_final_part_still_joins_a_response_that_is_last_in_the_queue():
    r = Responder(True)
    a, b = Recorder(), Recorder()
    with busy(r):
        r.send_part("b", b, "b0", joined, 0)
        r.send_part("a", a, "a0", joined, 0)
        r.send_part("a", a, "a1", joined, 1)
    assert [(x, f) for x, f, _ in a.got] == [("a0+a1", 1)]
