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

Coalescing (``send_part``, ``serving.coalesce_responses``): a stream's data responses that wait in the
queue behind a send become one response when the responder reaches them (``engine_outputs.merge_outputs``
joins their tokens). An idle responder sends each as it comes, so no token waits longer than it would
have; a busy one sends fewer, larger responses, and every process on the path (this stub, the server,
postprocessing, the client) pays its per-response cost once per group instead of once per token. That
is what lets the server keep up with an engine that makes tokens faster than one thread can send them.

``Responder(False)`` makes and sends inline on the caller's thread (what the engine did before).
"""
from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Hashable

from backend.logs import get_logger

__all__ = ["Responder"]

_LOG = get_logger("serving.responder")

_STOP = object()


class _Parts:
    """A queued response made of one or more parts; parts join it until the responder takes it."""
    __slots__ = ("key", "sender", "make", "parts", "flags", "on_error", "seq")

    def __init__(self, key, sender, make, part, flags, on_error, seq) -> None:
        self.key, self.sender, self.make = key, sender, make
        self.parts, self.flags, self.on_error = [part], flags, on_error
        self.seq = seq                   # its place in the queue (Responder._queued when it was put)

    def __call__(self) -> Any:
        return self.make(self.parts)


class Responder:
    def __init__(self, threaded: bool, name: str = "kiln-responder", coalesce: bool = True) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._coalesce = coalesce
        # key -> its queued response that parts may still join (the responder has not taken it)
        self._open: dict[Hashable, _Parts] = {}
        self._open_lock = threading.Lock()
        # responses queued so far, and per sender (its id) the number of the last one queued for it: a
        # FINAL part joins its stream's waiting response only while that is its sender's last (numbers,
        # not objects: this thread must not hold a response's Python-backend objects, which are dropped
        # on the responder's thread only; every request's FINAL removes its sender's entry)
        self._queued = 0
        self._last_of: dict[int, int] = {}
        self.responses = 0               # responses made (sent or failed)
        self.parts = 0                   # parts they carried (parts - responses = coalesced away)
        self._worker = None              # None: made and sent inline
        if threaded:
            self._worker = threading.Thread(target=self._run, name=name, daemon=True)
            self._worker.start()

    def send(self, sender: Any, make: Callable[[], Any], flags: int,
             on_error: Callable[[BaseException], None] | None = None, key: Hashable | None = None) -> None:
        """Send ``make()`` (the response) through ``sender`` after everything queued before it.
        ``on_error(exc)`` runs on the sending thread when making or sending fails (the client went away).
        ``key``: the stream it belongs to; no later part of that stream joins a response queued before it."""
        if self._worker is None:
            self._deliver(sender, make, flags, on_error)
            return
        assert not self._closed, "responder closed"
        with self._open_lock:
            if key is not None:
                self._open.pop(key, None)
            self._queue.put((sender, make, flags, on_error))
            self._queued += 1
            self._note_last(sender, self._queued, flags)

    def send_part(self, key: Hashable, sender: Any, part: Any, make: Callable[[list], Any], flags: int,
                  on_error: Callable[[BaseException], None] | None = None) -> None:
        """Like ``send``, for one part of a stream's data: when the stream (``key``) still has a response
        waiting in the queue that is not FINAL, ``part`` joins it, else it is queued as a new one.
        ``make(parts)`` makes the response from its parts, in order; ``flags`` and ``on_error`` are the
        last part's. Inline, or with coalescing off, every part is a response of its own."""
        if self._worker is None or not self._coalesce:
            self.send(sender, _Parts(key, sender, make, part, flags, on_error, 0), flags, on_error)
            return
        assert not self._closed, "responder closed"
        with self._open_lock:
            item = self._open.get(key)
            # A FINAL part joins only a response nothing was queued behind: the rows of one request
            # (RowGroup) share a sender, and a FINAL joined into a row's earlier response would go out
            # ahead of another row's waiting response and end the request before that row's last
            # tokens (the bls model then never saw its last row end). Non-final parts of one stream
            # may pass other streams' responses: only the FINAL flag must come last.
            if item is not None and (not flags or item.seq == self._last_of.get(id(sender))):
                item.parts.append(part)
                item.flags, item.on_error = flags, on_error
                if flags:
                    self._last_of.pop(id(sender), None)
            else:
                self._queued += 1
                item = _Parts(key, sender, make, part, flags, on_error, self._queued)
                self._queue.put(item)
                self._note_last(sender, self._queued, flags)
            if flags:                    # a FINAL response ends the stream: nothing may join it
                self._open.pop(key, None)
            else:
                self._open[key] = item

    def _note_last(self, sender: Any, seq: int, flags: int) -> None:
        """(under the lock) ``seq`` is ``sender``'s last queued response; a FINAL one ends its entry."""
        if flags:
            self._last_of.pop(id(sender), None)
        else:
            self._last_of[id(sender)] = seq

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

    def _deliver(self, sender: Any, make: Callable[[], Any], flags: int,
                 on_error: Callable[[BaseException], None] | None) -> None:
        self.responses += 1
        self.parts += len(make.parts) if isinstance(make, _Parts) else 1
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
            if isinstance(item, _Parts):
                with self._open_lock:    # taken: later parts of its stream start a new response
                    if self._open.get(item.key) is item:
                        del self._open[item.key]
                item = (item.sender, item, item.flags, item.on_error)
            deliver(*item)
            del item   # the request's objects go now, on this thread, not when the next item comes
