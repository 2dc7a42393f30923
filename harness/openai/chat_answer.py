"""One chat answer's text -> OpenAI's message or its stream deltas: reasoning, content, tool calls.

The order of the two parsers is the point: the reasoning splitter (``reasoning``) runs first, and
only the content it leaves reaches the tool-call parser (``tool_answer``), so a call the model
merely thinks about (``<think>I could write <tool_call>...``) is not a call. Both the streamed and
the whole answer go through the same two parsers, so the deltas join to the message.
"""
from __future__ import annotations

from typing import Any

from harness.openai.reasoning import ReasoningSplitter
from harness.openai.tool_answer import ToolAnswer
from harness.openai.tool_parsers import ToolFormat

__all__ = ["ChatAnswer"]


class ChatAnswer:
    """``tools``: the tool format when the request has tools (None: the content is plain text);
    ``reasoning``: the answer's splitter when the model thinks (None: no ``reasoning_content``)."""

    def __init__(self, tools: ToolFormat | None, reasoning: ReasoningSplitter | None):
        self.tools = ToolAnswer(tools) if tools is not None else None
        self.reasoning = reasoning
        self.reasoning_parts: list[str] = []
        self.content_parts: list[str] = []

    def _deltas(self, parts: list[tuple[str, str]]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for kind, text in parts:
            if kind == "reasoning":
                self.reasoning_parts.append(text)
                out.append({"reasoning_content": text})
            elif self.tools is not None:
                out += self.tools.feed(text)
            elif text:
                self.content_parts.append(text)
                out.append({"content": text})
        return out

    def feed(self, text: str) -> list[dict[str, Any]]:
        """A piece of the engine's text -> chat deltas (``content``, ``reasoning_content`` or
        ``tool_calls``, one key each)."""
        if not text:
            return []
        return self._deltas(self.reasoning.feed(text) if self.reasoning is not None else [("content", text)])

    def end(self) -> list[dict[str, Any]]:
        out = self._deltas(self.reasoning.end()) if self.reasoning is not None else []
        if self.tools is not None:
            out += self.tools.end()
        return out

    def calls(self) -> list[dict[str, Any]]:
        return self.tools.calls() if self.tools is not None else []

    def finish_reason(self, engine_finish: str | None) -> str | None:
        return self.tools.finish_reason(engine_finish) if self.tools is not None else engine_finish

    @property
    def content(self) -> str:
        return "".join(self.tools.content if self.tools is not None else self.content_parts)

    @property
    def reasoning_content(self) -> str | None:
        return "".join(self.reasoning_parts) if self.reasoning_parts else None

    def message(self, text: str) -> dict[str, Any]:
        """Non-streamed: the whole answer's message (``role`` included)."""
        self.feed(text)
        self.end()
        calls = self.calls()
        msg: dict[str, Any] = {"role": "assistant", "content": (self.content or None) if calls else self.content}
        if self.reasoning is not None:   # the field is there whenever the model thinks, null if it did not
            msg["reasoning_content"] = self.reasoning_content
        if calls:
            msg["tool_calls"] = calls
        return msg
