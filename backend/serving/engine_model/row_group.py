"""The rows of one engine request with batch size B > 1 (NVIDIA's ``--batch-inputs``).

tensorrtllm_backend's ``tensorrt_llm`` model splits such a request into B executor requests and
answers each with responses of its own, told apart by a ``batch_index`` output; the Triton
request ends (the FINAL flag) with the response that ends its LAST row, and only a decoupled model
may do this (one response per request leaves no room for B). Kiln's engine does the same: each row
is an ordinary stream of the engine host, and the rows of one request share a :class:`RowGroup`.

If one row fails, the request fails: the first error is sent with the FINAL flag and the group is
closed, so that the other rows stop (they are cancelled in the executor, freeing their blocks) and
send nothing more: nothing may follow a FINAL response.

Pure Python, thread-safe: rows finish on the executor's thread, errors also on the poller's.
"""
from __future__ import annotations

import threading

__all__ = ["RowGroup"]


class RowGroup:
    def __init__(self, rows: int):
        self.rows = rows
        self._left = rows
        self._closed = False
        self._lock = threading.Lock()

    @property
    def closed(self) -> bool:
        """True once an error ended the request: the remaining rows must send nothing."""
        return self._closed

    def row_finished(self) -> bool:
        """A row sends its last response: True when that response must carry the FINAL flag (it is
        the request's last row)."""
        with self._lock:
            self._left -= 1
            return self._left == 0 and not self._closed

    def close(self) -> bool:
        """An error ends the request: True for the first caller, who sends it with the FINAL flag."""
        with self._lock:
            first = not self._closed and self._left > 0
            self._closed = True
            return first
