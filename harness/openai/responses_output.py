"""The Responses API's objects: the response, its output items, and its stream of named events.

Built from the chat path's deltas (``ChatAnswer``: ``reasoning_content``, ``content``,
``tool_calls``), in the order the model wrote them: a ``reasoning`` item, a ``message`` item with one
``output_text`` part, a ``function_call`` item per call. Streamed, each item is announced
(``response.output_item.added``), filled (``response.reasoning_text.delta``,
``response.output_text.delta``, ``response.function_call_arguments.delta``), and closed with its
``.done`` events and ``response.output_item.done``; the stream opens with ``response.created`` and
``response.in_progress`` and ends with ``response.completed`` (``response.incomplete`` when
``max_output_tokens`` cut it), every event numbered (``sequence_number``), as OpenAI streams it.
"""
from __future__ import annotations

import time
import uuid
from typing import Any

__all__ = ["ResponseObject", "EventStream", "response_usage"]


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_usage(n_in: int, n_out: int, n_reasoning: int) -> dict[str, Any]:
    return {"input_tokens": n_in, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": n_out, "output_tokens_details": {"reasoning_tokens": n_reasoning},
            "total_tokens": n_in + n_out}


class ResponseObject:
    """The response's fields that do not change while it is generated (what the request set)."""

    def __init__(self, model: str, body: dict[str, Any], tools: list[dict]):
        self.id, self.created = _id("resp"), int(time.time())
        self.model, self.body, self.tools = model, body, tools

    def obj(self, status: str, output: list[dict], use: dict | None, incomplete: bool = False) -> dict[str, Any]:
        b = self.body
        choice = b.get("tool_choice", "auto" if self.tools else "none")
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "completed_at": int(time.time()) if status == "completed" else None, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "instructions": b.get("instructions"), "max_output_tokens": b.get("max_output_tokens"),
                "model": self.model, "output": output, "parallel_tool_calls": b.get("parallel_tool_calls", True),
                "previous_response_id": b.get("previous_response_id"), "reasoning": b.get("reasoning"),
                "store": b.get("store", True), "temperature": b.get("temperature", 1.0),
                "text": b.get("text", {"format": {"type": "text"}}), "tool_choice": choice, "tools": self.tools,
                "top_p": b.get("top_p", 1.0), "truncation": "disabled", "usage": use, "metadata": b.get("metadata"),
                "user": b.get("user")}


class EventStream:
    """Chat deltas in, Responses events out; ``items`` is the output so far (closed items whole)."""

    def __init__(self, resp: ResponseObject):
        self.resp = resp
        self.seq = 0
        self.items: list[dict] = []
        self.open: dict | None = None       # the item being written
        self.call_items: dict[int, dict] = {}   # a tool call's index -> its item

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        ev = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return ev

    def start(self) -> list[dict]:
        head = self.resp.obj("in_progress", [], None)
        return [self.event("response.created", response=head), self.event("response.in_progress", response=head)]

    def _add(self, item: dict) -> list[dict]:
        out = self.close()
        self.open = item
        self.items.append(item)
        out.append(self.event("response.output_item.added", output_index=len(self.items) - 1,
                              item={**item, "content": []} if "content" in item else dict(item)))
        return out

    def _part(self, kind: str) -> dict:
        return {"type": kind, "text": "", **({"annotations": [], "logprobs": []} if kind == "output_text" else {})}

    def delta(self, d: dict[str, Any]) -> list[dict]:
        """One chat delta (one key: ``reasoning_content``, ``content`` or ``tool_calls``)."""
        out: list[dict] = []
        if "reasoning_content" in d or "content" in d:
            kind = "reasoning" if "reasoning_content" in d else "message"
            text = d.get("reasoning_content", d.get("content"))
            if self.open is None or self.open["type"] != kind:
                item = ({"type": "reasoning", "id": _id("rs"), "summary": [], "content": [], "status": "in_progress"}
                        if kind == "reasoning" else
                        {"type": "message", "id": _id("msg"), "status": "in_progress", "role": "assistant",
                         "content": []})
                out += self._add(item)
                part = self._part("reasoning_text" if kind == "reasoning" else "output_text")
                item["content"].append(part)
                out.append(self.event("response.content_part.added", item_id=item["id"],
                                      output_index=len(self.items) - 1, content_index=0, part=dict(part)))
            part = self.open["content"][0]
            part["text"] += text
            name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
            extra = {"logprobs": []} if kind == "message" else {}
            out.append(self.event(name, item_id=self.open["id"], output_index=len(self.items) - 1, content_index=0,
                                  delta=text, **extra))
            return out
        for c in d.get("tool_calls", []):
            if "id" in c:   # a call's first delta: its id and name
                item = {"type": "function_call", "id": _id("fc"), "call_id": c["id"], "name": c["function"]["name"],
                        "arguments": "", "status": "in_progress"}
                out += self._add(item)
                self.call_items[c["index"]] = item
            piece = c["function"].get("arguments") or ""
            item = self.call_items[c["index"]]
            if piece:
                item["arguments"] += piece
                out.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=self.items.index(item), delta=piece))
        return out

    def close(self, status: str = "completed") -> list[dict]:
        item, self.open = self.open, None
        if item is None:
            return []
        i = self.items.index(item)
        item["status"] = status
        out = []
        if item["type"] == "function_call":
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                                  arguments=item["arguments"]))
        else:
            part = item["content"][0]
            name = "response.reasoning_text.done" if item["type"] == "reasoning" else "response.output_text.done"
            extra = {"logprobs": []} if item["type"] == "message" else {}
            out += [self.event(name, item_id=item["id"], output_index=i, content_index=0, text=part["text"], **extra),
                    self.event("response.content_part.done", item_id=item["id"], output_index=i, content_index=0,
                               part=dict(part))]
        out.append(self.event("response.output_item.done", output_index=i, item=item))
        return out

    def finish(self, use: dict, incomplete: bool) -> tuple[list[dict], dict]:
        """The last events and the whole response. ``incomplete``: ``max_output_tokens`` cut the
        answer, so the item being written when it stopped is ``incomplete``, and so is the response."""
        out = self.close("incomplete" if incomplete else "completed")
        if not self.items:   # nothing written (the end token at once): an empty message, as OpenAI answers
            out += self.delta({"content": ""}) + self.close()
        final = self.resp.obj("incomplete" if incomplete else "completed", self.items, use, incomplete)
        out.append(self.event("response.incomplete" if incomplete else "response.completed", response=final))
        return out, final
