"""The engine model's responses, made and sent by one thread that is not the engine's loop.

A Python-backend ``response_sender.send()`` is a synchronous round trip to the Triton server: the stub
writes the response to shared memory, posts a message and waits (GIL released) until a server thread
has taken it. With a model that costs almost nothing, 47% of the loop thread's time went to those
waits, one per stream per step (``docs/perf/serving-ceiling-profile.json``). With the responder, the loop
thread only computes each response's outputs (numpy) and queues them; the responder thread makes the
Triton tensors and the response and sends it, while the loop runs the next step.

One thread, on purpose (``engine_host.py`` has the history): Triton 24.10's stub aborted when responses
were made on one thread and sent on another, and died of heap corruption when four threads sent at
once. Here every Python-backend object of a response is made, sent and dropped on this one thread, as
the loop thread did alone before. One FIFO also keeps each request's responses in order, its FINAL one
last, with no per-request bookkeeping.

``Responder(False)`` makes and sends inline on the caller's thread (what the engine did before).
"""
from __future__ import annotations

import queue
import threading
from typing import Any, Callable

from backend.logs import get_logger

__all__ = ["Responder"]

_LOG = get_logger("serving.responder")

_STOP = object()


class Responder:
    def __init__(self, threaded: bool, name: str = "kiln-responder") -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._worker = None              # None: made and sent inline
        if threaded:
            self._worker = threading.Thread(target=self._run, name=name, daemon=True)
            self._worker.start()

    def send(self, sender: Any, make: Callable[[], Any], flags: int,
             on_error: Callable[[BaseException], None] | None = None) -> None:
        """Send ``make()`` (the response) through ``sender`` after everything queued before it.
        ``on_error(exc)`` runs on the sending thread when making or sending fails (the client went away)."""
        if self._worker is None:
            self._deliver(sender, make, flags, on_error)
            return
        assert not self._closed, "responder closed"
        self._queue.put((sender, make, flags, on_error))

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything queued so far has been sent (False: ``timeout`` passed first)."""
        if self._worker is None:
            return True
        mark = threading.Event()
        self._queue.put(mark)
        return mark.wait(timeout)

    def close(self, timeout: float | None = None) -> None:
        """Send what is queued, then stop the thread (no send may follow)."""
        if self._closed:
            return
        self._closed = True
        if self._worker is not None:
            self._queue.put(_STOP)
            self._worker.join(timeout)

    @staticmethod
    def _deliver(sender: Any, make: Callable[[], Any], flags: int,
                 on_error: Callable[[BaseException], None] | None) -> None:
        try:
            sender.send(make(), flags=flags)
        except Exception as e:  # noqa: BLE001 - the client went away (or the request was released)
            _LOG.info("response not sent: %s", e)
            if on_error is not None:
                try:
                    on_error(e)
                except Exception:  # noqa: BLE001 - a failing handler must not end the thread
                    _LOG.exception("response error handler failed")

    def _run(self) -> None:
        q, deliver = self._queue, self._deliver
        while True:
            item = q.get()
            if item is _STOP:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            deliver(*item)
            del item   # the request's objects go now, on this thread, not when the next item comes
