"""gpt-oss's harmony format, read as it streams: the messages of one answer.

An answer is a run of messages, ``<|start|>assistant HEADER<|message|>BODY`` closed by ``<|end|>``
(more messages follow), ``<|call|>`` (a tool call: the turn stops) or ``<|return|>`` (the final
answer: the turn stops). The prompt ends with ``<|start|>assistant``, so the answer's first message
starts at its header. The header names the channel (``<|channel|>analysis``: reasoning,
``commentary``: tool calls and the preambles before them, ``final``: the answer) and, for a call,
its recipient ``to=functions.NAME``, before or after the channel; ``<|constrain|>json`` (or a bare
``json``) may say what the body is.

Both the reasoning splitter (``reasoning``'s ``harmony`` row) and the tool parser
(``tool_parsers.harmony``) read the text through ``MessageScanner``, which turns pieces into events:
``("text", s)`` outside any message, ``("header", Header)``, ``("body", s)``, ``("stop", marker)``
(the marker that closed the body; ``""`` when the next message began without one), and, from
``end()`` only, ``("cut", Header)`` for a header the answer stopped inside. A stop token the engine
ends on (``<|call|>``, ``<|return|>``) need not be in the text: a body that runs to the end is whole.
"""
from __future__ import annotations

import dataclasses
import re

from harness.openai.state_pump import StatePump

__all__ = ["START", "END", "MESSAGE", "CHANNEL", "CONSTRAIN", "CALL", "RETURN", "FUNCTIONS",
           "Header", "parse_header", "open_body", "MessageScanner"]

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, CALL, RETURN = "<|constrain|>", "<|call|>", "<|return|>"
FUNCTIONS = "functions."     # the namespace a request's function tools are called in
STOPS = (END, CALL, RETURN)
# how a message may begin: <|start|>, the channel (the prompt wrote <|start|>assistant), or a
# function recipient written in the role part right after the prompt's <|start|>assistant
OPENERS = (START, CHANNEL, "to=" + FUNCTIONS)
_BODY_ENDS = (*STOPS, START, CHANNEL)

_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")
_RECIPIENT = re.compile(r"to=([^\s<]+)")


@dataclasses.dataclass(frozen=True)
class Header:
    raw: str                  # as written, up to (not including) <|message|>
    channel: str | None
    recipient: str | None     # "functions.get_weather", "browser.search", ... or None

    @property
    def function(self) -> str | None:
        """The function this message calls (None: not a call to one of the request's functions)."""
        r = self.recipient
        return r[len(FUNCTIONS):] if r and r.startswith(FUNCTIONS) else None


def parse_header(raw: str) -> Header:
    ch, to = _CHANNEL.search(raw), _RECIPIENT.search(raw)
    return Header(raw, ch.group(1) if ch else None, to.group(1) if to else None)


def open_body(prompt_text: str) -> Header | None:
    """The header of a message the prompt leaves open (a template that writes
    ``<|channel|>final<|message|>`` for the model): the answer starts inside its body."""
    tail = prompt_text[prompt_text.rfind(START):] if START in prompt_text else prompt_text
    i = tail.rfind(MESSAGE)
    if i < 0 or any(s in tail[i:] for s in STOPS):
        return None
    return parse_header(tail[:i])


def _held(buf: str, markers: tuple[str, ...]) -> int:
    longest = min(max(len(m) for m in markers) - 1, len(buf))
    return next((k for k in range(longest, 0, -1) if any(m.startswith(buf[-k:]) for m in markers)), 0)


class MessageScanner(StatePump):
    def __init__(self, inside: Header | None = None):
        self.buf = ""
        self.state = "body" if inside is not None else "start"

    def _start(self) -> list | None:
        s = self.buf.lstrip()   # the blank between two messages belongs to neither
        if not s or any(o.startswith(s) and o != s for o in OPENERS):
            return None         # blank so far, or maybe the start of a header: wait for more
        self.buf, self.state = s, ("header" if s.startswith(OPENERS) else "text")
        return []

    def _text(self) -> list | None:
        found = [(i, m) for m in (START, CHANNEL) if (i := self.buf.find(m)) >= 0]
        if found:
            i = min(found)[0]
            text, self.buf, self.state = self.buf[:i], self.buf[i:], "header"
            return [("text", text)] if text else []
        keep = _held(self.buf, (START, CHANNEL))
        text, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
        return [("text", text)] if text else None

    def _header(self) -> list | None:
        i = self.buf.find(MESSAGE)
        if i < 0:
            return None
        raw, self.buf, self.state = self.buf[:i], self.buf[i + len(MESSAGE):], "body"
        return [("header", parse_header(raw))]

    def _body(self) -> list | None:
        found = [(i, m) for m in _BODY_ENDS if (i := self.buf.find(m)) >= 0]
        if found:
            i, marker = min(found)
            out = [("body", self.buf[:i])] if i else []
            if marker in STOPS:
                self.buf, self.state = self.buf[i + len(marker):], "start"
                return out + [("stop", marker)]
            self.buf, self.state = self.buf[i:], "header"   # a message began without closing this one
            return out + [("stop", "")]
        keep = _held(self.buf, _BODY_ENDS)
        text, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
        return [("body", text)] if text else None

    def end(self) -> list[tuple[str, object]]:
        """What was held back. A body that runs to the end is left open (its stop token, which the
        engine ended on, is not in the text); a header the answer stopped inside is ``cut``."""
        text, self.buf = self.buf, ""
        if self.state == "header":
            return [("cut", parse_header(text))]
        if not text:
            return []
        return [("body" if self.state == "body" else "text", text)]
