"""The loop of the answer parsers written as states (tool-call blocks, Mistral's calls, harmony
messages): each ``_<state>()`` reads ``self.buf`` and returns what it produced (having moved on to
its next state), or None to wait for more text."""
from __future__ import annotations

__all__ = ["StatePump"]


class StatePump:
    buf: str
    state: str

    def feed(self, s: str) -> list:
        """Add a piece of the answer; everything it completes, in order."""
        self.buf += s
        out: list = []
        while True:
            step = getattr(self, f"_{self.state}")()
            if step is None:
                return out
            out += step
