"""Tool-call syntaxes, one row per model family: how a call is written, parsed and constrained.

``FORMATS`` is the table (``--tool-parser NAME`` picks a row; ``auto`` asks ``choose_format`` with
the bundle's chat template). Each row knows

* how a call is spelled (``call_text``): the built-in tool prompt shows it and renders past calls;
* how the answer's text is parsed, streamed (``parser()``: feed text pieces, get deltas);
* the structural tag that makes a call valid by construction (``harness.openai.tool_guide``): the
  text a call opens with up to its arguments (``head``), the text that closes it (``tail``), what
  separates two calls, and the trigger that starts one inside free text (``tool_choice`` auto).

A parser turns text into ``Delta``s: ``Delta(content=...)`` for plain text, and per call a first
``Delta(index, name=...)`` then ``Delta(index, arguments=...)`` pieces that join to the call's
arguments. Feeding the whole text at once gives the same deltas joined as feeding it piece by
piece, which is what makes a streamed answer assemble to the non-streamed one.
"""
from __future__ import annotations

import dataclasses
import json
import re
from typing import Callable

__all__ = ["Delta", "ToolFormat", "FORMATS", "choose_format", "HermesParser", "Llama3JsonParser"]


@dataclasses.dataclass
class Delta:
    content: str | None = None
    index: int | None = None         # a tool call's position in the answer
    name: str | None = None          # on a call's first delta only
    arguments: str | None = None     # a piece of the call's arguments (JSON text)


class _WhitespaceHold:
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


class _ArgsScanner:
    """Finds where a JSON object written as text ends, as it is written: string-aware bracket depth."""

    def __init__(self):
        self.depth, self.in_str, self.esc, self.started = 0, False, False, False

    def feed(self, s: str) -> int | None:
        """How many chars of ``s`` belong to the object; None: all of them and it is not closed yet.
        Raises ValueError if the value does not start as an object."""
        for i, c in enumerate(s):
            if not self.started:
                if c.isspace():
                    continue
                if c != "{":
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


class HermesParser:
    """``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` blocks among free text
    (Hermes, Qwen 2.5/3). A call whose JSON starts with its name and then its arguments (how the
    grammar writes it) streams its arguments as they come; any other call is checked whole at its
    closing tag and sent in one piece, or passed on as text if it is not a call at all."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_.\-]{1,64})"\s*,\s*"arguments"\s*:\s*')

    def __init__(self):
        self.buf, self.state, self.n_calls = "", "text", 0
        self.ws = _WhitespaceHold()
        self.scanner: _ArgsScanner | None = None
        self.open_call: int | None = None   # index of a call whose name was sent and which is not closed

    def feed(self, s: str) -> list[Delta]:
        self.buf += s
        out: list[Delta] = []
        while True:
            step = getattr(self, f"_{self.state}")()
            if step is None:
                return out
            out += step

    def _text(self) -> list[Delta] | None:
        i = self.buf.find(self.OPEN)
        if i < 0:  # keep a tail that may be the start of the opening tag
            keep = next((k for k in range(min(len(self.OPEN) - 1, len(self.buf)), 0, -1)
                         if self.OPEN.startswith(self.buf[-k:])), 0)
            text, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
            return self.ws.text(text) or None
        text, self.buf, self.state = self.buf[:i], self.buf[i + len(self.OPEN):], "head"
        return self.ws.text(text)

    def _head(self) -> list[Delta] | None:
        m = self._HEAD.match(self.buf)
        if m:
            self.open_call, self.n_calls = self.n_calls, self.n_calls + 1
            self.buf, self.state, self.scanner = self.buf[m.end():], "args", _ArgsScanner()
            return [Delta(index=self.open_call, name=m.group(1))]
        if self.CLOSE in self.buf:  # not the streamable spelling: the block whole
            block, _, self.buf = self.buf.partition(self.CLOSE)
            self.state = "text"
            return self._whole(block)
        return None

    def _whole(self, block: str) -> list[Delta]:
        try:
            call = json.loads(block)
        except ValueError:
            call = None
        if (isinstance(call, dict) and isinstance(call.get("name"), str)
                and isinstance(call.get("arguments", {}), dict)):
            i, self.n_calls = self.n_calls, self.n_calls + 1
            return [Delta(index=i, name=call["name"]),
                    Delta(index=i, arguments=json.dumps(call.get("arguments", {}), ensure_ascii=False))]
        return self.ws.text(self.OPEN + block + self.CLOSE)

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


class Llama3JsonParser:
    """Llama 3.1-3.3's JSON calls: the whole answer is ``{"name": ..., "parameters": {...}}`` (several
    joined by ``; ``), after an optional ``<|python_tag|>``; an answer that does not start with ``{``
    is text. A call is known only once the answer is complete, so calls come at the end, their
    arguments in one piece each."""

    TAG = "<|python_tag|>"

    def __init__(self):
        self.buf, self.mode = "", None   # mode: None until the first visible char, then "text" / "calls"

    def feed(self, s: str) -> list[Delta]:
        if self.mode == "text":
            return [Delta(content=s)] if s else []
        self.buf += s
        head = self.buf.lstrip()
        if head.startswith(self.TAG):
            head = head[len(self.TAG):].lstrip()
        if not head or self.TAG.startswith(head):
            return []
        self.mode = "calls" if head.startswith("{") else "text"
        if self.mode == "text":
            out, self.buf = self.buf, ""
            return [Delta(content=out)]
        return []

    def end(self) -> tuple[list[Delta], int | None]:
        if self.mode != "calls":
            out = [Delta(content=self.buf)] if self.buf else []
            return out, None
        text = self.buf.strip()
        if text.startswith(self.TAG):
            text = text[len(self.TAG):]
        dec, pos, calls = json.JSONDecoder(), 0, []
        try:
            while True:
                while pos < len(text) and text[pos] in " \n\t;":
                    pos += 1
                if pos >= len(text):
                    break
                obj, pos = dec.raw_decode(text, pos)
                args = obj.get("parameters", obj.get("arguments")) if isinstance(obj, dict) else None
                if not isinstance(obj.get("name"), str) or not isinstance(args, dict):
                    raise ValueError("not a call")
                calls.append((obj["name"], args))
        except (ValueError, AttributeError):
            return [Delta(content=self.buf)], None  # not calls after all (or cut off): the text as written
        out = []
        for i, (name, args) in enumerate(calls):
            out += [Delta(index=i, name=name), Delta(index=i, arguments=json.dumps(args, ensure_ascii=False))]
        return out, None


@dataclasses.dataclass(frozen=True)
class ToolFormat:
    name: str
    parser: Callable[[], object]
    head: str               # a call up to its arguments, "{name}" where the function's name goes
    tail: str               # what closes a call after its arguments
    separator: str          # between two calls
    trigger: str            # the text that opens a call (auto: free text until then)
    template_markers: tuple[str, ...]   # a chat template that spells these writes this format

    def call_text(self, name: str, arguments: str) -> str:
        return self.head.replace("{name}", name) + arguments + self.tail


FORMATS: dict[str, ToolFormat] = {f.name: f for f in (
    ToolFormat("hermes", HermesParser, '<tool_call>\n{"name": "{name}", "arguments": ', "}\n</tool_call>", "\n",
               "<tool_call>", ("<tool_call>",)),
    ToolFormat("llama3_json", Llama3JsonParser, '{"name": "{name}", "parameters": ', "}", "; ",
               '{"name": "', ("<|python_tag|>", "ipython")),
)}
DEFAULT_FORMAT = "hermes"   # the built-in tool prompt's syntax (templates without tools)


def template_has_tools(template: str | None) -> bool:
    """A chat template renders tools itself if it reads the ``tools`` variable."""
    return bool(template) and re.search(r"\btools\b", template) is not None


def choose_format(setting: str, template: str | None) -> ToolFormat | None:
    """``--tool-parser``: a row's name, ``none`` (tools refused), or ``auto``: the row whose markers
    the bundle's template spells, else Hermes (also the built-in prompt's syntax)."""
    if setting == "none":
        return None
    if setting != "auto":
        return FORMATS[setting]
    if template_has_tools(template):
        for f in FORMATS.values():
            if any(m in template for m in f.template_markers):
                return f
    return FORMATS[DEFAULT_FORMAT]
