"""Chat messages and completion prompts -> the token ids sent to the engine.

Tokenizing here, with the bundle's own tokenizer, rather than in Triton's preprocessing model: the
usage counts are then the engine's exact token counts, and a prompt over the engine's
``max_input_len`` is refused before anything is sent, with OpenAI's ``context_length_exceeded``.
A chat is rendered through the bundle's chat template (``TextTokenizer.render_messages``), which
spells out the special tokens itself, so none are added when it is encoded (as the ensemble does
for ``apply_chat_template``). Tools, past calls and tool results are rendered by the template
itself when it knows them, else by the built-in tool prompt (``tool_prompt``). A request's
``chat_template_kwargs`` (``{"enable_thinking": false}``) and ``reasoning_effort`` become more
variables of the template (``template_kwargs``), as vLLM and SGLang pass them; a template that does
not read one ignores it.
"""
from __future__ import annotations

import json
from typing import Any

from harness.openai.errors import ApiError, bad_request
from harness.openai.params import json_dumps_short, json_type
from harness.openai.served_model import ServedModel
from harness.openai.tool_parsers import template_has_tools
from harness.openai.tool_prompt import builtin_messages, native_messages
from harness.openai.tools import NAME, ToolRequest

__all__ = ["chat_prompt", "chat_prompt_ids", "completion_prompt_ids", "check_length", "template_kwargs", "ROLES",
           "EFFORTS"]

# OpenAI's roles a chat template can show; "developer" is OpenAI's newer name for "system"
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


def _content(i: int, msg: dict) -> str | None:
    """A message's text: a string, or OpenAI's array of content parts, of which only text parts exist
    for a text model (an image part is refused, not dropped). None: an assistant turn of calls only."""
    c = msg.get("content")
    where = f"messages[{i}].content"
    if isinstance(c, str):
        return c
    if c is None and msg.get("role") == "assistant" and msg.get("tool_calls"):
        return None
    if not isinstance(c, list):
        raise bad_request(where, f"expected a string or an array of content parts, got {json_type(c)}")
    texts = []
    for j, part in enumerate(c):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else json_type(part)
            raise bad_request(f"{where}[{j}]", f"content part of type {kind!r}: only text parts are supported")
        texts.append(part["text"])
    return "".join(texts)


def _tool_calls(i: int, calls: Any) -> list[dict]:
    """An assistant turn's past ``tool_calls`` -> [{"id", "name", "arguments"}] (arguments as JSON text)."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list) or not calls:
        raise bad_request(where, f"expected a non-empty array of tool calls, got {json_type(calls)}")
    out = []
    for j, c in enumerate(calls):
        w = f"{where}[{j}]"
        if not isinstance(c, dict) or c.get("type", "function") != "function" or not isinstance(c.get("function"), dict):
            raise bad_request(w, "expected {\"id\": ..., \"type\": \"function\", \"function\": {\"name\": ..., "
                              "\"arguments\": ...}}")
        if not isinstance(c.get("id"), str) or not c["id"]:
            raise bad_request(f"{w}.id", f"expected a non-empty string, got {json_type(c.get('id'))}")
        fn = c["function"]
        if not isinstance(fn.get("name"), str) or not NAME.match(fn["name"]):
            raise bad_request(f"{w}.function.name", f"expected a function name, got {json_type(fn.get('name'))}")
        args = fn.get("arguments")
        if not isinstance(args, str):
            raise bad_request(f"{w}.function.arguments", f"expected the arguments as JSON text, got {json_type(args)}")
        try:
            json.loads(args)
        except ValueError as e:
            raise bad_request(f"{w}.function.arguments", f"not valid JSON: {e}") from None
        out.append({"id": c["id"], "name": fn["name"], "arguments": args})
    return out


def _message(i: int, msg: Any) -> dict:
    if not isinstance(msg, dict):
        raise bad_request(f"messages[{i}]", f"expected an object, got {json_type(msg)}")
    role = msg.get("role")
    if role not in ROLES:
        raise bad_request(f"messages[{i}].role", f"{role!r} is not supported; allowed: {', '.join(sorted(ROLES))}")
    out: dict = {"role": ROLES[role], "content": _content(i, msg)}
    if role == "assistant" and msg.get("tool_calls"):
        out["tool_calls"] = _tool_calls(i, msg["tool_calls"])
    if role == "tool":
        tid = msg.get("tool_call_id")
        if not isinstance(tid, str) or not tid:
            raise bad_request(f"messages[{i}].tool_call_id", "a tool message needs the id of the call it answers, "
                              f"got {json_type(tid)}", code="missing_required_parameter" if tid is None else "invalid_value")
        out["tool_call_id"] = tid
    return out


# what the renderer itself sets (tokenizer.render_messages): a kwarg may not replace the conversation
_RESERVED = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token")
EFFORTS = ("none", "minimal", "low", "medium", "high")   # OpenAI's reasoning_effort values


def template_kwargs(kw: Any, effort: Any = None, effort_param: str = "reasoning_effort") -> dict:
    """``chat_template_kwargs`` (an object of template variables) plus the reasoning effort, which
    templates that know it read as ``reasoning_effort`` (gpt-oss's); one given in both must agree.
    ``effort_param``: where the effort came from (chat's ``reasoning_effort``, the Responses API's
    ``reasoning.effort``), what a 400 names."""
    if kw is None:
        kw = {}
    if not isinstance(kw, dict):
        raise bad_request("chat_template_kwargs", f"expected an object of template variables, got {json_type(kw)}")
    bad = [k for k in kw if k in _RESERVED or not k.isidentifier()]
    if bad:
        raise bad_request("chat_template_kwargs", f"{bad[0]!r} cannot be set: the names {', '.join(_RESERVED)} "
                          "are the conversation's own, and a name must be an identifier")
    if effort is not None:
        if effort not in EFFORTS:
            raise bad_request(effort_param, f"{json_dumps_short(effort)}; allowed: {', '.join(EFFORTS)}")
        if kw.get("reasoning_effort", effort) != effort:
            raise bad_request(effort_param, f"{effort!r} differs from chat_template_kwargs.reasoning_effort")
        kw = {**kw, "reasoning_effort": effort}
    return kw


def chat_prompt_ids(model: ServedModel, messages: Any, tools: ToolRequest | None = None) -> list[int]:
    return chat_prompt(model, messages, tools)[0]


def chat_prompt(model: ServedModel, messages: Any, tools: ToolRequest | None = None,
                kwargs: dict | None = None) -> tuple[list[int], str]:
    """(ids, the rendered text). ``tools``: the request's checked tools (None: no tool handling, the
    conversation may still hold past calls and results). The text tells a reasoning parser whether
    the template opened the model's thinking (``reasoning``)."""
    if messages is None:
        raise bad_request("messages", "required", code="missing_required_parameter")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages", f"expected a non-empty array of messages, got {json_type(messages)}"
                          + (" (empty)" if messages == [] else ""))
    checked = [_message(i, m) for i, m in enumerate(messages)]
    uses_tools = tools is not None or any(m["role"] == "tool" or m.get("tool_calls") for m in checked)
    fmt = model.tool_format
    if uses_tools and fmt is None:
        raise bad_request("tools" if tools is not None else "messages", "this server does not handle tools "
                          "(--tool-parser none)", code="unsupported_value")
    tool_objs = [t.openai() for t in tools.tools] if tools is not None else None
    if not uses_tools:
        rendered = checked
    elif template_has_tools(model.tokenizer.chat_template):
        rendered = native_messages(checked)
    else:
        rendered, tool_objs = builtin_messages(checked, tools, fmt), None
    try:
        text = model.tokenizer.render_messages(rendered, tools=tool_objs, extra=kwargs)
    except ValueError as e:  # the bundle has no chat template
        raise bad_request("messages", f"{e}; use /v1/completions", code="unsupported_value") from None
    except Exception as e:  # noqa: BLE001 - the template itself refused (e.g. raise_exception on role order)
        raise bad_request("messages", f"the model's chat template refused the conversation: {e}") from None
    ids = model.tokenizer.tokenizer.encode(text, add_special_tokens=False).ids
    return check_length(model, ids, "messages"), text


def completion_prompt_ids(model: ServedModel, prompt: Any) -> list[int]:
    """A string, or one prompt in an array (a string or token ids): one sequence per request."""
    if prompt is None:
        raise bad_request("prompt", "required", code="missing_required_parameter")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompt = [prompt]  # one prompt given as token ids
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise bad_request("prompt", f"{len(prompt)} prompts; one prompt per request is supported "
                              "(send the others as their own requests)")
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = model.tokenizer.encode(prompt)
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        bad = [t for t in prompt if not 0 <= t < model.vocab_size]
        if bad:
            raise bad_request("prompt", f"token id {bad[0]} is outside the vocabulary [0, {model.vocab_size})")
        ids = list(prompt)
    else:
        raise bad_request("prompt", f"expected a string or an array of token ids, got {json_type(prompt)}")
    return check_length(model, ids, "prompt")


def check_length(model: ServedModel, ids: list[int], param: str) -> list[int]:
    if not ids:
        raise bad_request(param, "the prompt is empty (0 tokens)")
    if len(ids) > model.max_input_len:
        raise ApiError(400, f"'{param}': the prompt has {len(ids)} tokens, more than this model's "
                       f"max_input_len of {model.max_input_len} tokens; shorten it",
                       param=param, code="context_length_exceeded")
    return ids
