"""A chat request's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` -> a checked ``ToolRequest``.

Every mistake is a 400 naming its field (``tools[1].function.parameters``, ``tool_choice``), checked
before anything is tokenized or sent: a schema that is not a JSON Schema (checked with
``jsonschema``'s meta-schema), a function name OpenAI would refuse or given twice, a ``tool_choice``
naming no tool, or asking for a call with no tools. ``tool_choice`` ``none`` (or no tools) means no
tool handling at all: the answer is text, as without tools.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping

from harness.openai.errors import bad_request
from harness.openai.params import json_dumps_short, json_type

__all__ = ["Tool", "ToolRequest", "parse_tools", "NAME"]

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")   # OpenAI's rule for a function's name
_CHOICES = ("none", "auto", "required")
EMPTY_PARAMETERS: dict = {"type": "object", "properties": {}}   # OpenAI's meaning of no parameters


@dataclasses.dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict

    def openai(self) -> dict:
        """As the chat template (and the built-in prompt) sees it: OpenAI's tool object."""
        fn: dict = {"name": self.name}
        if self.description:
            fn["description"] = self.description
        fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}


@dataclasses.dataclass(frozen=True)
class ToolRequest:
    tools: tuple[Tool, ...]
    choice: str        # "auto", "required" or the name of the function that must be called
    parallel: bool     # more than one call allowed (auto and required)

    def tool(self, name: str) -> Tool | None:
        return next((t for t in self.tools if t.name == name), None)


def _check_schema(where: str, schema: Any) -> dict:
    if not isinstance(schema, dict):
        raise bad_request(where, f"expected a JSON Schema object, got {json_type(schema)}")
    import jsonschema
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as e:
        path = "".join(f"[{p!r}]" for p in e.path)
        raise bad_request(where, f"not a valid JSON Schema{' at ' + path if path else ''}: {e.message[:300]}") from None
    if schema.get("type", "object") != "object":
        raise bad_request(where, f"a function's parameters must be an object schema, got type "
                          f"{json_dumps_short(schema.get('type'))}")
    return schema


def _tool(i: int, t: Any) -> Tool:
    where = f"tools[{i}]"
    if not isinstance(t, dict):
        raise bad_request(where, f"expected an object, got {json_type(t)}")
    if t.get("type") != "function":
        raise bad_request(f"{where}.type", f"{json_dumps_short(t.get('type'))}: only \"function\" tools are supported")
    fn = t.get("function")
    if not isinstance(fn, dict):
        raise bad_request(f"{where}.function", f"expected an object, got {json_type(fn)}")
    name = fn.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise bad_request(f"{where}.function.name", f"{json_dumps_short(name)}: a function name is 1 to 64 of "
                          "a-z, A-Z, 0-9, _ and -")
    desc = fn.get("description")
    if desc is not None and not isinstance(desc, str):
        raise bad_request(f"{where}.function.description", f"expected a string, got {json_type(desc)}")
    params = fn.get("parameters")
    params = EMPTY_PARAMETERS if params is None else _check_schema(f"{where}.function.parameters", params)
    strict = fn.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request(f"{where}.function.strict", f"expected true, false or null, got {json_type(strict)}")
    return Tool(name, desc, params)


def _choice(v: Any, tools: tuple[Tool, ...]) -> str:
    if v is None:
        return "auto" if tools else "none"
    if isinstance(v, str):
        if v not in _CHOICES:
            raise bad_request("tool_choice", f"{json_dumps_short(v)}; allowed: {', '.join(_CHOICES)} or "
                              "{\"type\": \"function\", \"function\": {\"name\": ...}}")
        name = v
    elif isinstance(v, dict) and v.get("type") == "function" and isinstance(v.get("function"), dict):
        name = v["function"].get("name")
        if not isinstance(name, str) or not any(t.name == name for t in tools):
            known = ", ".join(t.name for t in tools) or "none"
            raise bad_request("tool_choice", f"function {json_dumps_short(name)} is not one of the request's "
                              f"tools ({known})")
    else:
        raise bad_request("tool_choice", f"expected \"none\", \"auto\", \"required\" or {{\"type\": \"function\", "
                          f"\"function\": {{\"name\": ...}}}}, got {json_dumps_short(v)}")
    if name == "auto" and not tools:
        return "none"  # nothing to call: a plain answer (clients send "auto" with an empty tools list)
    if name != "none" and not tools:
        raise bad_request("tool_choice", f"{json_dumps_short(v)} needs tools, and the request has none")
    return name


def parse_tools(body: Mapping[str, Any]) -> ToolRequest | None:
    """None: no tool handling (no tools, or ``tool_choice`` none)."""
    raw = body.get("tools")
    if raw is not None and not isinstance(raw, list):
        raise bad_request("tools", f"expected an array of tools, got {json_type(raw)}")
    tools = tuple(_tool(i, t) for i, t in enumerate(raw or []))
    seen: set[str] = set()
    for i, t in enumerate(tools):
        if t.name in seen:
            raise bad_request(f"tools[{i}].function.name", f"{t.name!r} is given twice; names must be unique")
        seen.add(t.name)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request("parallel_tool_calls", f"expected true or false, got {json_type(parallel)}")
    choice = _choice(body.get("tool_choice"), tools)
    if choice == "none":
        return None
    return ToolRequest(tools, choice, True if parallel is None else parallel)
