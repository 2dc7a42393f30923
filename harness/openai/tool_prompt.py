"""Chat messages with tools -> what the chat template renders.

Two ways, chosen by the bundle's template:

* The template renders tools itself (it reads ``tools``: Qwen, Hermes, Llama 3.1+): it gets
  transformers' ``apply_chat_template(tools=...)`` convention: ``tools`` as OpenAI's tool objects,
  an assistant turn's ``tool_calls`` with their ``arguments`` as an object (templates write them
  with ``tojson``; a string would be quoted twice), ``tool`` turns with ``tool_call_id``.
* It does not (SmolLM2's; DeepSeek-V3's, which writes past calls but not the tool list): the
  built-in tool prompt. The tools and how to call them go into the system message (appended to
  the conversation's own, or as the first message), past calls are written into the assistant's
  text in the format's own syntax (``ToolFormat.calls_text``), and a tool's result becomes a user
  turn ``<tool_response>...</tool_response>``; the template then sees only roles and text, which it
  knows how to render.
"""
from __future__ import annotations

import json
from typing import Any

from harness.openai.tool_parsers import ToolFormat
from harness.openai.tools import ToolRequest

__all__ = ["native_messages", "builtin_messages", "tool_system_prompt"]


def tool_system_prompt(tr: ToolRequest, fmt: ToolFormat) -> str:
    tools = "\n".join(json.dumps(t.openai(), ensure_ascii=False) for t in tr.tools)
    example = fmt.call_text("<function-name>", "<arguments-as-a-JSON-object>")
    must = {"auto": "You may call one or more of these functions, or answer in text.",
            "required": "You must call at least one of these functions."}.get(
        tr.choice, f"You must call the function {tr.choice}.")
    return (f"# Tools\n\nYou can call functions. They are listed here as JSON, one per line, between "
            f"<tools></tools>:\n<tools>\n{tools}\n</tools>\n\n{must} To call a function, write its name "
            f"and its arguments, as JSON that follows the function's parameters schema, like this:\n{example}")


def _arguments_object(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def native_messages(messages: list[dict]) -> list[dict]:
    """Checked messages (``prompts``) -> transformers' convention."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [{"id": c["id"], "type": "function",
                                "function": {"name": c["name"], "arguments": _arguments_object(c["arguments"])}}
                               for c in m["tool_calls"]]
        out.append(m)
    return out


def builtin_messages(messages: list[dict], tr: ToolRequest | None, fmt: ToolFormat) -> list[dict]:
    """Checked messages -> roles and text only, the tools in the system message."""
    out: list[dict] = []
    for m in messages:
        if m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        elif m.get("tool_calls"):
            calls = fmt.calls_text([(c["name"], c["arguments"]) for c in m["tool_calls"]])
            text = m.get("content") or ""
            out.append({"role": "assistant", "content": f"{text}\n{calls}" if text else calls})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if tr is not None:
        prompt = tool_system_prompt(tr, fmt)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out
