"""One thread that sends the engine model's responses, in the order they were handed to it.

Why a thread: a Python-backend ``response_sender.send()`` is a round trip to the Triton server
process; the stub waits until the server has taken the response (with the GIL released). Sent from
the executor's loop thread, sixteen streams cost sixteen round trips a step, with the engine's
compute stopped for all of them: 10% of the loop thread's time at 16 streams on the 2-core
development VM (py-spy). The loop thread now builds each response (detokenization, tensors) and
hands it over; the next step computes while the server takes it. Alternating runs of the serving
benchmark there (16 streams, 32 prompts, 64 tokens): 74-75 output tok/s sending from the loop
thread, 78-88 from this one; one stream: no difference beyond the VM's noise.

Order: every response of a stream goes through this one queue (data responses, and the error
that may end the stream from another thread), so a stream's FINAL response can never overtake
one queued before it. ``drain()`` waits until everything handed over so far has been sent (before
the stub exits on a fatal error, and at shutdown).
"""
from __future__ import annotations

import queue
import threading
from typing import Callable

from backend.logs import get_logger

_LOG = get_logger("serving.engine")


class Responder:
    def __init__(self, name: str = "kiln-responder") -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, send: Callable[[], None]) -> None:
        """Queue ``send`` (one response's delivery; it handles its own failures) behind everything
        handed over before it. Never blocks."""
        self._q.put(send)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until everything submitted before this call has been sent; False on timeout (or
        when the thread is gone: nothing will be sent any more)."""
        if not self._thread.is_alive():
            return False
        done = threading.Event()
        self._q.put(done.set)
        return done.wait(timeout)

    def close(self, timeout: float = 10.0) -> bool:
        """Send what is queued, then stop the thread; True when it ended within ``timeout``."""
        self._q.put(None)
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while True:
            send = self._q.get()
            if send is None:
                return
            try:
                send()
            except Exception:  # noqa: BLE001 - one bad delivery must not stop every later one
                _LOG.exception("sending a response failed")
