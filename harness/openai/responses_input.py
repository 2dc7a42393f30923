"""A ``/v1/responses`` body -> the chat body the chat path serves, and the responses kept for
``previous_response_id``.

The Responses API is served by the chat path (``request_plan``: the same prompt rendering, tools,
grammar and engine call), so this module only translates: ``input`` items (messages,
``function_call``, ``function_call_output``) become chat messages, ``instructions`` the system
message, function tools and ``tool_choice`` their chat spelling, ``max_output_tokens`` ``max_tokens``.
Mistakes in what is translated are 400s naming the Responses field (``input[2].call_id``,
``tools[0].name``); what the chat checks refuse afterwards is renamed to the Responses field it came
from (``rename``), so a client never reads a chat field it did not send.
"""
from __future__ import annotations

import collections
import dataclasses
import re
import threading
from typing import Any

from harness.openai.errors import ApiError, bad_request
from harness.openai.params import json_dumps_short, json_type

__all__ = ["ChatBody", "ResponseStore", "to_chat_body", "rename", "STORE_SIZE"]

STORE_SIZE = 1000   # responses kept for previous_response_id, in memory: the newest 1000
_TEXT_PARTS = ("input_text", "output_text", "text")
_EXTENSIONS = ("seed", "guided_json", "guided_regex", "guided_grammar", "top_k")
_ROLES = ("user", "system", "developer", "assistant")
# fields the chat path reads under another name, or with no Responses meaning; refused unless neutral
_REFUSED = {"background": (lambda v: v in (None, False), "background responses are not supported"),
            "conversation": (lambda v: v is None, "conversations are not supported; send previous_response_id"),
            "prompt": (lambda v: v is None, "stored prompts are not supported"),
            "truncation": (lambda v: v in (None, "disabled"), "only \"disabled\" is supported: an input over "
                           "the context is refused, not truncated"),
            "top_logprobs": (lambda v: v in (None, 0), "log-probabilities are served on /v1/chat/completions")}


@dataclasses.dataclass
class ChatBody:
    body: dict[str, Any]          # what request_plan reads
    history: list[dict]           # the conversation without instructions: what a stored response keeps
    origin: list[str]             # per chat message, the Responses field it came from (for rename)


class ResponseStore:
    """The newest ``size`` responses' conversations, by id; the oldest is forgotten first."""

    def __init__(self, size: int = STORE_SIZE):
        self.size = size
        self._items: "collections.OrderedDict[str, list[dict]]" = collections.OrderedDict()
        self._lock = threading.Lock()

    def put(self, rid: str, conversation: list[dict]) -> None:
        with self._lock:
            self._items[rid] = conversation
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def get(self, rid: str) -> list[dict] | None:
        with self._lock:
            return self._items.get(rid)

    def __len__(self) -> int:
        return len(self._items)


def _text(where: str, content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(where, f"expected a string or an array of content parts, got {json_type(content)}")
    out = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else json_type(part)
            raise bad_request(f"{where}[{j}]", f"content part of type {json_dumps_short(kind)}: only text parts "
                              f"({', '.join(_TEXT_PARTS)}) are supported")
        out.append(part["text"])
    return "".join(out)


def _str(where: str, v: Any) -> str:
    if not isinstance(v, str) or not v:
        raise bad_request(where, f"expected a non-empty string, got {json_type(v)}",
                          code="missing_required_parameter" if v is None else "invalid_value")
    return v


def _items(raw: Any) -> tuple[list[dict], list[str]]:
    """``input`` -> (chat messages, the input field each came from)."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}], ["input"]
    if not isinstance(raw, list):
        raise bad_request("input", f"expected a string or an array of input items, got {json_type(raw)}")
    msgs: list[dict] = []
    origin: list[str] = []
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(where, f"expected an object, got {json_type(item)}")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise bad_request(f"{where}.role", f"{json_dumps_short(role)}; allowed: {', '.join(_ROLES)}")
            msgs.append({"role": role, "content": _text(f"{where}.content", item.get("content"))})
        elif kind == "function_call":
            args = item.get("arguments")
            if not isinstance(args, str):
                raise bad_request(f"{where}.arguments", f"expected the arguments as JSON text, got {json_type(args)}")
            call = {"id": _str(f"{where}.call_id", item.get("call_id")), "type": "function",
                    "function": {"name": _str(f"{where}.name", item.get("name")), "arguments": args}}
            # calls right after an assistant turn belong to it, as the model wrote them in one answer
            if msgs and msgs[-1]["role"] == "assistant":
                msgs[-1].setdefault("tool_calls", []).append(call)
                continue
            msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out = item.get("output")
            msgs.append({"role": "tool", "tool_call_id": _str(f"{where}.call_id", item.get("call_id")),
                         "content": _text(f"{where}.output", out)})
        elif kind == "reasoning":
            continue  # past reasoning is not shown again, as chat templates drop it
        else:
            raise bad_request(f"{where}.type", f"{json_dumps_short(kind)}: supported input items are message, "
                              "function_call, function_call_output and reasoning")
        origin.append(where)
    return msgs, origin


def _tools(raw: Any) -> list[dict] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise bad_request("tools", f"expected an array of tools, got {json_type(raw)}")
    out = []
    for i, t in enumerate(raw):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else json_type(t)
            raise bad_request(f"tools[{i}].type", f"{json_dumps_short(kind)}: only function tools are supported")
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(v: Any) -> Any:
    if v is None or isinstance(v, str):
        return v
    if isinstance(v, dict) and v.get("type") == "function":
        return {"type": "function", "function": {"name": v.get("name")}}
    raise bad_request("tool_choice", f"expected \"none\", \"auto\", \"required\" or {{\"type\": \"function\", "
                      f"\"name\": ...}}, got {json_dumps_short(v)}")


def _text_format(v: Any) -> Any:
    """``text.format`` -> chat's ``response_format`` (whose checks then apply)."""
    if v is None:
        return None
    if not isinstance(v, dict):
        raise bad_request("text", f"expected an object, got {json_type(v)}")
    fmt = v.get("format")
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") != "json_schema"):
        return fmt
    return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}


def to_chat_body(body: dict[str, Any], store: ResponseStore) -> ChatBody:
    for name, (neutral, why) in _REFUSED.items():
        if not neutral(body.get(name)):
            raise bad_request(name, why, code="unsupported_value")
    if body.get("input") is None:
        raise bad_request("input", "required", code="missing_required_parameter")
    msgs, origin = _items(body["input"])
    prev = body.get("previous_response_id")
    history: list[dict] = []
    if prev is not None:
        history = store.get(prev) if isinstance(prev, str) else None
        if history is None:
            raise ApiError(400, f"'previous_response_id': no response {json_dumps_short(prev)} is kept by this "
                           f"server (it keeps the newest {store.size}, in memory, while it runs)",
                           param="previous_response_id", code="previous_response_not_found")
    history = history + msgs
    origin = ["previous_response_id"] * (len(history) - len(msgs)) + origin
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_request("instructions", f"expected a string, got {json_type(instructions)}")
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + history
    origin = (["instructions"] if instructions else []) + origin
    reasoning = body.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, dict):
        raise bad_request("reasoning", f"expected an object, got {json_type(reasoning)}")
    chat = {"model": body.get("model"), "messages": messages, "tools": _tools(body.get("tools")),
            "tool_choice": _tool_choice(body.get("tool_choice")), "max_tokens": body.get("max_output_tokens"),
            "parallel_tool_calls": body.get("parallel_tool_calls"), "temperature": body.get("temperature"),
            "top_p": body.get("top_p"), "stream": body.get("stream"), "response_format": _text_format(body.get("text")),
            "reasoning_effort": (reasoning or {}).get("effort"),
            "chat_template_kwargs": body.get("chat_template_kwargs"),
            # Kiln's and vLLM's chat extensions, the same here: a seed, a grammar
            **{k: body.get(k) for k in _EXTENSIONS}}
    return ChatBody({k: v for k, v in chat.items() if v is not None}, history, origin)


# a chat field in a 400 -> the Responses field it was translated from
_RENAMES = ((re.compile(r"^tools\[(\d+)\]\.function\.(.*)$"), r"tools[\1].\2"),
            (re.compile(r"^messages$"), "input"),
            (re.compile(r"^max_tokens$"), "max_output_tokens"),
            (re.compile(r"^reasoning_effort$"), "reasoning.effort"),
            (re.compile(r"^response_format$"), "text.format"))


def rename(e: ApiError, origin: list[str]) -> ApiError:
    if not e.param:
        return e
    m = re.match(r"^messages\[(\d+)\]", e.param)
    param = origin[int(m.group(1))] if m and int(m.group(1)) < len(origin) else "input" if m else e.param
    for pattern, repl in _RENAMES:
        param = pattern.sub(repl, param)
    if param == e.param:
        return e
    message = e.message.replace(f"'{e.param}'", f"'{param}'", 1)
    return ApiError(e.status, message, param=param, type=e.type, code=e.code)
