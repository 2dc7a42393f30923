"""A generation request body -> everything the engine call needs, checked whole before it is sent.

Shared by ``/v1/chat/completions``, ``/v1/completions`` and ``/v1/responses`` (which turns its body
into a chat body first, ``responses_input``), so that every route gets the same checks, the same
prompt rendering, tools and grammar, and the same ``max_tokens`` rules: a bad request costs no
engine time and gets a 400 naming its field.
"""
from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from backend.engine.sampling_params import room_problem
from harness.openai.chat_answer import ChatAnswer
from harness.openai.errors import bad_request
from harness.openai.limits import Limits
from harness.openai.params import Sampling, check_logit_bias, check_unsupported, parse_sampling, parse_stream
from harness.openai.prompts import chat_prompt, completion_prompt_ids, template_kwargs
from harness.openai.served_model import ServedModel
from harness.openai.tool_answer import with_tool_guide
from harness.openai.tools import ToolRequest, parse_tools

__all__ = ["Plan", "plan_request"]


@dataclasses.dataclass
class Plan:
    chat: bool
    ids: list[int]
    sampling: Sampling
    max_tokens: int
    stream: bool
    include_usage: bool
    tools: ToolRequest | None
    prompt_text: str | None          # the rendered chat prompt (where the model's thinking starts)

    def answer(self, model: ServedModel) -> ChatAnswer:
        """A fresh parser pair for this request's answer (chat only)."""
        thinks = model.reasoning if self.prompt_text is not None else None
        return ChatAnswer(model.tool_format if self.tools is not None else None,
                          thinks.splitter(self.prompt_text) if thinks is not None else None)


async def plan_request(model: ServedModel, limits: Limits, body: dict[str, Any], chat: bool) -> Plan:
    check_unsupported(body)
    stream, include_usage = parse_stream(body)
    sampling = parse_sampling(body, chat=chat)
    if chat and sampling.skip_special_tokens is None and model.markers_are_special:
        sampling = dataclasses.replace(sampling, skip_special_tokens=False)   # the parsers read the markers
    check_logit_bias(sampling, model.vocab_size)
    tools = parse_tools(body) if chat else None
    if not chat and body.get("tools"):
        raise bad_request("tools", "tools are a chat feature: send them to /v1/chat/completions",
                          code="unsupported_value")
    text = None
    if chat:
        kwargs = template_kwargs(body.get("chat_template_kwargs"), body.get("reasoning_effort"))
        ids, text = chat_prompt(model, body.get("messages"), tools, kwargs)
    else:
        ids = completion_prompt_ids(model, body.get("prompt"))
    if tools is not None:
        # a model that thinks writes its reasoning before a forced call; "auto" is free text until a
        # call opens, reasoning included
        prefix = (model.reasoning.grammar_prefix(model.reasoning.opened_in(text))
                  if model.reasoning is not None and tools.choice != "auto" else None)
        # in a thread: the first one imports xgrammar (~2 s), none blocks the event loop
        sampling = await asyncio.to_thread(with_tool_guide, sampling, tools, model.tool_format, prefix)
    room = model.max_seq_len - len(ids)
    cap = limits.max_tokens_cap
    max_tokens = sampling.max_tokens if sampling.max_tokens is not None else min(room, cap or room)
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    if cap is not None and max_tokens > cap:
        raise bad_request(name, f"{max_tokens} is more than this server's cap of {cap} tokens per request "
                          "(--max-tokens-cap)")
    problem = room_problem(max_tokens, room)
    if problem is not None:
        raise bad_request(name, f"{max_tokens}: {problem}")
    return Plan(chat, ids, sampling, max_tokens, stream, include_usage, tools, text)
