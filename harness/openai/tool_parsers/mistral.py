"""Mistral's calls, opened by its ``[TOOL_CALLS]`` token.

Two spellings are in use. Tokenizers v11 and later (Mistral Small 3.2, Magistral, Devstral,
Ministral 3) write each call as ``[TOOL_CALLS]NAME[ARGS]{...}``, the next call opened by its own
``[TOOL_CALLS]`` (some insert ``[CALL_ID]id`` before ``[ARGS]``); older ones write one JSON list,
``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]``. Both are read; Kiln's grammar and built-in
prompt write the newer one.
"""
from __future__ import annotations

import json
import re

from harness.openai.state_pump import StatePump
from harness.openai.tool_parsers.base import NAME, Delta, JsonEnd, WhitespaceHold, arguments_object, marker_tail

__all__ = ["MistralParser", "TOOL_CALLS", "ARGS"]

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"


class MistralParser(StatePump):
    """Text until ``[TOOL_CALLS]``; then a call's name and ``[ARGS]``, whose arguments stream as
    they come, or the older JSON list, sent once it is closed and checked. What follows a marker
    and can become neither (``[TOOL_CALLS]`` in prose) is text, as written."""

    HEAD = re.compile(rf"\s*({NAME})\s*(?:\[CALL_ID\]\s*[A-Za-z0-9]+\s*)?(?:\[ARGS\])?\s*(?=\{{)")
    # what may still grow into a head: a name, then "[" (of [ARGS] or [CALL_ID]) or "{"
    _MAYBE_HEAD = re.compile(r"[A-Za-z0-9_.\-]{0,64}\s*(?:[\[{].*)?", re.S)
    _HEAD_MAX = 120     # a name, a call id and [ARGS] are far shorter: longer is prose

    def __init__(self):
        self.buf, self.state, self.n_calls = "", "text", 0
        self.ws = WhitespaceHold()
        self.scanner: JsonEnd | None = None
        self.open_call: int | None = None
        self.raw = ""   # the older list as written, in case it is not calls

    def _text(self) -> list[Delta] | None:
        i = self.buf.find(TOOL_CALLS)
        if i < 0:
            keep = marker_tail(self.buf, (TOOL_CALLS,))
            text, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
            return self.ws.text(text) or None
        text, self.buf, self.state = self.buf[:i], self.buf[i + len(TOOL_CALLS):], "head"
        return self.ws.text(text)

    def _maybe_head(self) -> bool:
        s = self.buf.lstrip()
        return len(s) <= self._HEAD_MAX and self._MAYBE_HEAD.fullmatch(s) is not None

    def _head(self) -> list[Delta] | None:
        s = self.buf.lstrip()
        if s[:1] in ("[", "{"):   # the older spelling: a list of call objects (or one)
            self.buf, self.state, self.scanner, self.raw = s, "list", JsonEnd("[{"), self.buf[:len(self.buf) - len(s)]
            return []
        m = self.HEAD.match(self.buf)
        if m:
            self.open_call, self.n_calls = self.n_calls, self.n_calls + 1
            self.buf, self.state, self.scanner = self.buf[m.end():], "args", JsonEnd()
            return [Delta(index=self.open_call, name=m.group(1))]
        if not s or self._maybe_head():
            return None
        self.state = "text"   # not a call: the marker is text, and what follows is read as text again
        return self.ws.text(TOOL_CALLS)

    def _args(self) -> list[Delta] | None:
        if not self.buf:
            return None
        end = self.scanner.feed(self.buf)   # HEAD matched only before a "{": it is an object
        if end is None:
            piece, self.buf = self.buf, ""
            return [Delta(index=self.open_call, arguments=piece)]
        piece, self.buf, self.state, self.open_call = self.buf[:end], self.buf[end:], "text", None
        return [Delta(index=self.n_calls - 1, arguments=piece)]

    def _list(self) -> list[Delta] | None:
        if not self.buf:
            return None
        end = self.scanner.feed(self.buf)
        if end is None:
            self.raw, self.buf = self.raw + self.buf, ""
            return None
        text, self.buf, self.state = self.raw + self.buf[:end], self.buf[end:], "text"
        self.raw = ""
        calls = self._calls(text)
        if calls is None:
            return self.ws.text(TOOL_CALLS + text)
        out = []
        for name, args in calls:
            i, self.n_calls = self.n_calls, self.n_calls + 1
            out += [Delta(index=i, name=name), Delta(index=i, arguments=json.dumps(args, ensure_ascii=False))]
        return out

    @staticmethod
    def _calls(text: str) -> list[tuple[str, dict]] | None:
        try:
            value = json.loads(text)
        except ValueError:
            return None
        calls = []
        for call in value if isinstance(value, list) else [value]:
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                return None
            args = arguments_object(call.get("arguments", {}))
            if args is None:
                return None
            calls.append((call["name"], args))
        return calls or None

    def end(self) -> tuple[list[Delta], int | None]:
        """The last deltas, and the index of a call cut off before its end (None: every call is whole)."""
        out: list[Delta] = []
        cut = None
        if self.state == "args":
            cut = self.open_call
        elif self.state in ("head", "list"):   # opened, cut before its name or its list was complete
            cut = self.n_calls
        else:
            out = self.ws.text(self.buf)
        if self.n_calls == 0 and self.ws.held:
            out.append(Delta(content=self.ws.held))
        self.buf = self.ws.held = ""
        return out, cut
