"""What every tool-call parser is made of: the ``Delta`` it answers with, the whitespace rule, the
scanner that finds where a JSON value written as text ends, the held-back marker tail, and the
parser of calls written as blocks between an opening and a closing marker (Hermes, DeepSeek)."""
from __future__ import annotations

import dataclasses
import json
import re

from harness.openai.state_pump import StatePump

__all__ = ["Delta", "WhitespaceHold", "JsonEnd", "marker_tail", "first_marker", "BlockParser", "NAME"]

NAME = r"[A-Za-z0-9_.\-]{1,64}"     # a function name as tools.py accepts it


@dataclasses.dataclass
class Delta:
    content: str | None = None
    index: int | None = None         # a tool call's position in the answer
    name: str | None = None          # on a call's first delta only
    arguments: str | None = None     # a piece of the call's arguments (JSON text)


class WhitespaceHold:
    """Plain text is passed on, except trailing whitespace, which is held until text follows: the
    newlines around and between calls are not content (OpenAI answers a call with content null)."""

    def __init__(self):
        self.held = ""

    def text(self, s: str) -> list[Delta]:
        # a piece's trailing whitespace is always held, whatever the split: the same text cut into
        # other pieces must give the same content
        body = s.rstrip()
        if not body:
            self.held += s
            return []
        out, self.held = self.held + body, s[len(body):]
        return [Delta(content=out)]


class JsonEnd:
    """Finds where a JSON object (or, with ``opens="{["``, an array) written as text ends, as it is
    written: string-aware bracket depth, no validation (a grammar-made call is valid already)."""

    def __init__(self, opens: str = "{"):
        self.opens = opens
        self.depth, self.in_str, self.esc, self.started = 0, False, False, False

    def feed(self, s: str) -> int | None:
        """How many chars of ``s`` belong to the value; None: all of them and it is not closed yet.
        Raises ValueError if the value does not start with one of ``opens``."""
        for i, c in enumerate(s):
            if not self.started:
                if c.isspace():
                    continue
                if c not in self.opens:
                    raise ValueError("arguments are not a JSON object")
                self.started = True
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif c == "\\":
                    self.esc = True
                elif c == '"':
                    self.in_str = False
            elif c == '"':
                self.in_str = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return None


def marker_tail(buf: str, markers: tuple[str, ...]) -> int:
    """How many chars at the end of ``buf`` may be the start of one of ``markers``: they are held
    back while streaming, so no piece of a marker is ever sent as text."""
    longest = min(max(len(m) for m in markers) - 1, len(buf))
    return next((k for k in range(longest, 0, -1) if any(m.startswith(buf[-k:]) for m in markers)), 0)


def first_marker(buf: str, markers: tuple[str, ...]) -> tuple[int, str | None]:
    """The first of ``markers`` in ``buf``: (its index, the marker), or (-1, None)."""
    found = [(i, m) for m in markers if (i := buf.find(m)) >= 0]
    return min(found) if found else (-1, None)


def arguments_object(value) -> dict | None:
    """A call's arguments as written in a JSON call object: an object, or JSON text of one."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    return value if isinstance(value, dict) else None


class BlockParser(StatePump):
    """Calls written as blocks, ``OPEN`` ... ``CLOSE``, among free text. A block that starts as
    ``HEAD`` says (the function's name, then its arguments, the way the grammar writes it) streams
    its arguments as they come; any other block is checked whole at ``CLOSE`` (``whole``) and sent
    in one piece, or passed on as text if it is not a call at all. ``DROP``: markers around a group
    of calls, neither text nor calls."""

    OPEN: str
    CLOSE: str
    DROP: tuple[str, ...] = ()
    HEAD: re.Pattern     # its first group that matched is the name; it ends where the arguments start

    def __init__(self):
        self.buf, self.state, self.n_calls = "", "text", 0
        self.ws = WhitespaceHold()
        self.scanner: JsonEnd | None = None
        self.open_call: int | None = None   # index of a call whose name was sent and which is not closed
        self.markers = (self.OPEN, *self.DROP)

    def whole(self, block: str) -> tuple[str, dict] | None:
        """A block that did not stream: (name, arguments) if it is a call."""
        raise NotImplementedError

    def _text(self) -> list[Delta] | None:
        i, marker = first_marker(self.buf, self.markers)
        if i < 0:  # keep a tail that may be the start of a marker
            keep = marker_tail(self.buf, self.markers)
            text, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
            return self.ws.text(text) or None
        text, self.buf = self.buf[:i], self.buf[i + len(marker):]
        if marker == self.OPEN:
            self.state = "head"
        return self.ws.text(text)

    def _head(self) -> list[Delta] | None:
        m = self.HEAD.match(self.buf)
        if m:
            self.open_call, self.n_calls = self.n_calls, self.n_calls + 1
            self.buf, self.state, self.scanner = self.buf[m.end():], "args", JsonEnd()
            return [Delta(index=self.open_call, name=next(g for g in m.groups() if g))]
        if self.CLOSE in self.buf:  # not the streamable spelling: the block whole
            block, _, self.buf = self.buf.partition(self.CLOSE)
            self.state = "text"
            call = self.whole(block)
            if call is None:
                return self.ws.text(self.OPEN + block + self.CLOSE)
            i, self.n_calls = self.n_calls, self.n_calls + 1
            return [Delta(index=i, name=call[0]), Delta(index=i, arguments=json.dumps(call[1], ensure_ascii=False))]
        return None

    def _args(self) -> list[Delta] | None:
        if not self.scanner.started:  # whitespace before the object is not part of the arguments
            self.buf = self.buf.lstrip()
        if not self.buf:
            return None
        try:
            end = self.scanner.feed(self.buf)
        except ValueError:  # arguments that are not an object: wait for the close, pass it on as text
            self.state, self.open_call = "tail", None
            return []
        if end is None:
            piece, self.buf = self.buf, ""
            return [Delta(index=self.open_call, arguments=piece)]
        piece, self.buf, self.state = self.buf[:end], self.buf[end:], "tail"
        return [Delta(index=self.open_call, arguments=piece)]

    def _tail(self) -> list[Delta] | None:
        if self.CLOSE not in self.buf:
            return None
        _, _, self.buf = self.buf.partition(self.CLOSE)
        self.state, self.open_call = "text", None
        return []

    def end(self) -> tuple[list[Delta], int | None]:
        """The last deltas, and the index of a call cut off before its end (None: every call is whole)."""
        cut = self.open_call if self.state in ("args", "tail") else None
        out: list[Delta] = []
        if self.state == "head":  # opened, cut before its name was complete: a call, not text
            cut = self.n_calls
        elif self.state == "text":
            out = self.ws.text(self.buf)
        if self.n_calls == 0 and self.ws.held:
            out.append(Delta(content=self.ws.held))
        self.buf = self.ws.held = ""
        return out, cut
