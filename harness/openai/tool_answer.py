"""One chat answer with tools: the engine's text -> content and ``tool_calls``, streamed or whole.

Both ways run the same parser over the same text (whole: one piece), so a streamed answer's deltas
join to the non-streamed message: the same content, the same calls with the same names and
arguments (the ids are new per answer, ``call_`` + 24 hex digits, as OpenAI's are unique).

``finish_reason`` is ``tool_calls`` when the answer holds a call and ended on its own (the engine's
"stop"). When ``max_tokens`` cut it ("length") inside a call, that call is incomplete: the
non-streamed message leaves it out of ``tool_calls`` (the calls completed before it stay), and a
stream has already sent its first pieces; "length" says so either way.
"""
from __future__ import annotations

import dataclasses
import uuid
from typing import Any

from harness.openai.errors import bad_request
from harness.openai.params import Guide, Sampling
from harness.openai.tool_guide import tool_grammar
from harness.openai.tool_parsers import Delta, ToolFormat
from harness.openai.tools import ToolRequest

__all__ = ["ToolAnswer", "with_tool_guide"]


def with_tool_guide(s: Sampling, tr: ToolRequest, fmt: ToolFormat | None, prefix: dict | None = None) -> Sampling:
    """The request's sampling with the grammar that keeps its calls valid (``tool_guide``); ``prefix``:
    what the answer may start with before its calls (a reasoning block)."""
    if fmt is None:
        raise bad_request("tools", "this server does not handle tools (--tool-parser none)", code="unsupported_value")
    if s.guide is not None:
        raise bad_request(s.guide.param, "cannot be combined with tools: the tool calls are constrained by a "
                          "grammar, and the engine applies one per request", code="unsupported_value")
    for name, on in (("ignore_eos", s.ignore_eos), ("min_tokens", s.min_tokens > 0)):
        if on:
            raise bad_request(name, "cannot be combined with tools: a complete call ends with the end token",
                              code="unsupported_value")
    return dataclasses.replace(s, guide=Guide("ebnf_grammar", tool_grammar(tr, fmt, prefix), "tools"))


class ToolAnswer:
    def __init__(self, fmt: ToolFormat):
        self.parser = fmt.parser()
        self.ids: dict[int, str] = {}
        self.names: dict[int, str] = {}
        self.args: dict[int, list[str]] = {}
        self.content: list[str] = []
        self.cut: int | None = None
        self.ended = False

    def _delta(self, d: Delta) -> dict[str, Any]:
        """One parser delta -> an OpenAI chat delta (and recorded for the whole message)."""
        if d.content is not None:
            self.content.append(d.content)
            return {"content": d.content}
        if d.name is not None:
            self.ids[d.index] = f"call_{uuid.uuid4().hex[:24]}"
            self.names[d.index], self.args[d.index] = d.name, []
            return {"tool_calls": [{"index": d.index, "id": self.ids[d.index], "type": "function",
                                    "function": {"name": d.name, "arguments": ""}}]}
        self.args[d.index].append(d.arguments)
        return {"tool_calls": [{"index": d.index, "function": {"arguments": d.arguments}}]}

    def feed(self, text: str) -> list[dict[str, Any]]:
        return [self._delta(d) for d in self.parser.feed(text)] if text else []

    def end(self) -> list[dict[str, Any]]:
        assert not self.ended
        self.ended = True
        deltas, self.cut = self.parser.end()
        return [self._delta(d) for d in deltas]

    def calls(self) -> list[dict[str, Any]]:
        """The whole calls, in order; a cut one left out."""
        return [{"id": self.ids[i], "type": "function",
                 "function": {"name": self.names[i], "arguments": "".join(self.args[i])}}
                for i in sorted(self.ids) if i != self.cut]

    def finish_reason(self, engine_finish: str | None) -> str | None:
        return "tool_calls" if engine_finish == "stop" and self.calls() else engine_finish

    def message(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """Non-streamed: (content, tool_calls) of the whole answer's text."""
        self.feed(text)
        self.end()
        content = "".join(self.content)
        calls = self.calls()
        return (content or None) if calls else content, calls
