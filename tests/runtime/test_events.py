"""RequestHandle: the loop thread delivers without a lock unless a reader sleeps (backend/engine/events.py).
These tests run real threads against it: every event arrives once and in order, and no wake-up is lost
whether the reader is asleep, about to sleep, or not reading yet."""
from __future__ import annotations

import threading
import time

from backend.engine.events import RequestHandle, TokenEvent


def _events(n: int) -> list[TokenEvent]:
    return [TokenEvent("r", [i], finished=i == n - 1, finish_reason="length" if i == n - 1 else None)
            for i in range(n)]


def test_a_reader_on_another_thread_gets_every_event_once_in_order():
    # many rounds: the producer's append can land anywhere in the reader's check-then-sleep
    for rnd in range(200):
        h = RequestHandle("r", [1], None)
        got: list[int] = []
        reader = threading.Thread(target=lambda: got.extend(t for ev in h for t in ev.token_ids), daemon=True)
        reader.start()
        evs = _events(1 + rnd % 7)
        for ev in evs:
            if rnd % 3 == 0:
                time.sleep(0)            # let the reader get to sleep between some events
            h._deliver(ev)
        reader.join(5)
        assert not reader.is_alive(), f"round {rnd}: the reader was never woken"
        assert got == [t for ev in evs for t in ev.token_ids]
        assert h.finished and h._sleeping == 0


def test_wait_times_out_then_wakes_when_the_last_event_arrives():
    h = RequestHandle("r", [1], None)
    t0 = time.monotonic()
    assert h.wait(0.05) is False and time.monotonic() - t0 >= 0.05
    woke = []
    waiter = threading.Thread(target=lambda: woke.append(h.wait(10)), daemon=True)
    waiter.start()
    time.sleep(0.05)                     # the waiter is asleep by now (or about to be: either works)
    for ev in _events(3):
        h._deliver(ev)
    waiter.join(5)
    assert woke == [True]
    assert h.result().token_ids == [0, 1, 2]     # the events stayed queued for the iterator


def test_on_event_handles_call_back_and_keep_nothing():
    seen = []
    h = RequestHandle("r", [1], seen.append)
    evs = _events(2)
    for ev in evs:
        h._deliver(ev)
    assert seen == evs and h.finished and not h._events
