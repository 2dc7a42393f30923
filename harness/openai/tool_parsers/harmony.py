"""gpt-oss's calls: a harmony message to ``functions.NAME``, its body the arguments.

``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`` (the
recipient may also come first, ``<|start|>assistant to=functions.NAME<|channel|>commentary json``).
The messages are read by ``harness.openai.harmony_messages``; the reasoning splitter's ``harmony``
row has already taken the analysis channel away and left the final answer's body as plain text,
so what reaches this parser is text and call messages. Without that splitter (``--reasoning-parser
none``) every message that is not a call is content, its body without the markers.
"""
from __future__ import annotations

import re

from harness.openai.harmony_messages import MESSAGE, Header, MessageScanner
from harness.openai.tool_parsers.base import NAME, Delta, JsonEnd, WhitespaceHold

__all__ = ["HarmonyParser"]

_NAME = re.compile(NAME)


class HarmonyParser:
    """A call's name is sent once its body starts as a JSON object and its arguments stream as they
    come; a call message whose body is not an object (or whose name is not a function name) is
    content, as written, markers included, like a Hermes block that is not a call. A body that
    stops before its object closes is a cut call."""

    def __init__(self):
        self.scanner = MessageScanner()
        self.ws = WhitespaceHold()
        self.n_calls, self.cut = 0, None
        self.mode: str | None = None      # the current message: content | pending | args | after | as_text
        self.header: Header | None = None
        self.pending = ""                 # a call's body before its first visible character
        self.args: JsonEnd | None = None

    def feed(self, s: str) -> list[Delta]:
        return self._events(self.scanner.feed(s))

    def _events(self, events) -> list[Delta]:
        out: list[Delta] = []
        for kind, v in events:
            out += getattr(self, f"_on_{kind}")(v)
        return out

    def _on_text(self, s: str) -> list[Delta]:
        return self.ws.text(s)

    def _on_header(self, h: Header) -> list[Delta]:
        self.header, self.pending = h, ""
        if h.function is None:
            self.mode = "content"
            return []
        if _NAME.fullmatch(h.function) is None:
            self.mode = "as_text"
            return self.ws.text(h.raw + MESSAGE)
        self.mode = "pending"
        return []

    def _on_body(self, s: str) -> list[Delta]:
        if self.mode in ("content", "as_text"):
            return self.ws.text(s)
        if self.mode == "after":   # past the arguments' object: not part of the call
            return []
        if self.mode == "pending":
            self.pending += s
            s = self.pending.lstrip()
            if not s:
                return []
            if not s.startswith("{"):
                self.mode = "as_text"
                return self.ws.text(self.header.raw + MESSAGE + self.pending)
            i, self.n_calls, self.mode, self.args = self.n_calls, self.n_calls + 1, "args", JsonEnd()
            return [Delta(index=i, name=self.header.function)] + self._arguments(s)
        return self._arguments(s)

    def _arguments(self, s: str) -> list[Delta]:
        end = self.args.feed(s)
        if end is not None:
            s, self.mode = s[:end], "after"
        return [Delta(index=self.n_calls - 1, arguments=s)] if s else []

    def _on_stop(self, marker: str) -> list[Delta]:
        out: list[Delta] = []
        if self.mode == "args" and self.cut is None:    # closed before its arguments were
            self.cut = self.n_calls - 1
        elif self.mode == "pending":                     # a call with no arguments at all: text
            out = self.ws.text(self.header.raw + MESSAGE + self.pending + marker)
        elif self.mode == "as_text":
            out = self.ws.text(marker)
        self.mode = None
        return out

    def _on_cut(self, h: Header) -> list[Delta]:
        if h.function is not None and self.cut is None:   # opened, cut before its arguments
            self.cut = self.n_calls
        return []

    def end(self) -> tuple[list[Delta], int | None]:
        """The last deltas, and the index of a call cut off before its end (None: every call is whole)."""
        out = self._events(self.scanner.end())
        cut = self.cut
        if cut is None and self.mode == "args":
            cut = self.n_calls - 1
        elif cut is None and self.mode == "pending":
            cut = self.n_calls
        if self.n_calls == 0 and self.ws.held:
            out.append(Delta(content=self.ws.held))
        self.ws.held = ""
        return out, cut
