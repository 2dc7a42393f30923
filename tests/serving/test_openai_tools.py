"""Tool calling on the real stack with the official ``openai`` client: SmolLM2's template has no tools,
so the built-in Hermes prompt and the ``hermes`` parser serve them; ``required`` and named calls are
valid by construction (the engine's grammar), so every sampled call parses and validates."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.serving.openai_stack import MODEL, SHORT

pytestmark = [pytest.mark.slow, pytest.mark.server]

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 12},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
TIME = {"type": "object", "additionalProperties": False, "required": ["zone"],
        "properties": {"zone": {"enum": ["UTC", "Europe/Paris", "Asia/Tokyo"]}, "format": {"enum": ["12h", "24h"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather forecast for a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The current time in a time zone",
                                           "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What will the weather be in Paris for the next 3 days?"}]


def _valid(call) -> dict:
    import jsonschema
    assert call.type == "function" and call.id.startswith("call_") and len(call.id) > 8, call
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return args


def assert_100_sampled_calls_validate(client, model: str, seed: int) -> None:
    """80 ``required`` and 20 named calls at temperature 1: each parses and validates against its
    schema, and they are not one answer a hundred times. Shared with the second family's test."""
    named = {"type": "function", "function": {"name": "get_time"}}

    def one(i: int):
        choice = named if i % 5 == 4 else "required"   # 80 required, 20 named
        return choice, client.chat.completions.create(
            model=model, messages=ASK, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False,
            temperature=1.0, seed=seed + i, max_tokens=48)
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(100)))
    names = set()
    for choice, r in results:
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None, c
        assert len(c.message.tool_calls) == 1, c   # parallel_tool_calls false: one call
        call = c.message.tool_calls[0]
        if choice != "required":
            assert call.function.name == "get_time"
        _valid(call)
        names.add((call.function.name, call.function.arguments))
    assert len(names) > 10, names   # sampled, not one answer a hundred times


def test_100_sampled_required_and_named_calls_all_parse_and_validate(stack):
    assert_100_sampled_calls_validate(stack.client(), MODEL, 1000)


def test_without_the_grammar_the_same_prompt_rarely_gives_a_valid_call(stack, serving_build):
    """The control for the test above: the same rendered prompt, sampled the same way through
    /v1/completions (no grammar), is answered with prose, so the grammar is what makes calls valid."""
    import requests

    from harness.openai.prompts import chat_prompt_ids
    from harness.openai.served_model import load_served_model
    from harness.openai.tool_answer import ToolAnswer
    from harness.openai.tools import parse_tools
    model = load_served_model(serving_build / "model_repository")
    ids = chat_prompt_ids(model, ASK, parse_tools({"tools": TOOLS, "tool_choice": "required",
                                                   "parallel_tool_calls": False}))

    def valid(i: int) -> bool:
        r = requests.post(f"{stack.base}/completions", timeout=300, json={
            "model": MODEL, "prompt": ids, "max_tokens": 48, "temperature": 1.0, "seed": 1000 + i}).json()
        _, calls = ToolAnswer(model.tool_format).message(r["choices"][0]["text"])
        try:
            return bool(calls) and all(jsonschema_ok(c) for c in calls)
        except ValueError:
            return False
    with ThreadPoolExecutor(8) as pool:
        n_valid = sum(pool.map(valid, range(8)))
    assert n_valid <= 4, n_valid


def jsonschema_ok(call: dict) -> bool:
    import jsonschema
    try:
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
    except (jsonschema.ValidationError, KeyError):
        return False
    return True


def test_each_tool_choice_mode(stack):
    client = stack.client()
    card = client.models.retrieve(MODEL)  # SmolLM2's template has no tools: the built-in prompt
    assert (card.tool_parser, card.tool_prompt) == ("hermes", "builtin_hermes"), card
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, temperature=0, max_tokens=48)
    r = client.chat.completions.create(tool_choice="none", **kw).choices[0]
    assert not r.message.tool_calls and r.message.content and r.finish_reason in ("stop", "length"), r
    assert "<tool_call>" not in r.message.content
    # parallel calls allowed: one or more. Greedy SmolLM2 repeats its call until max_tokens cuts the
    # last one: "length", and the calls completed before the cut, each valid
    r = client.chat.completions.create(tool_choice="required", **kw).choices[0]
    assert r.finish_reason in ("tool_calls", "length") and r.message.tool_calls, r
    for call in r.message.tool_calls:
        _valid(call)
    assert len({c.id for c in r.message.tool_calls}) == len(r.message.tool_calls)
    r = client.chat.completions.create(tool_choice="required", parallel_tool_calls=False, **kw).choices[0]
    assert r.finish_reason == "tool_calls" and len(r.message.tool_calls) == 1, r
    _valid(r.message.tool_calls[0])
    r = client.chat.completions.create(tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                       **kw).choices[0]
    assert r.finish_reason == "tool_calls" and [c.function.name for c in r.message.tool_calls] == ["get_weather"]
    _valid(r.message.tool_calls[0])
    # auto: text, or a call that is valid (the grammar takes over once the model opens <tool_call>)
    for seed in range(4):
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, temperature=1.0, seed=seed,
                                           max_tokens=48).choices[0]
        if r.message.tool_calls:
            assert r.finish_reason == "tool_calls", r
            for call in r.message.tool_calls:
                _valid(call)
        else:
            assert r.message.content and r.finish_reason in ("stop", "length"), r
    # the same auto request the model answers with a call when told to use its tools
    r = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=48, tools=TOOLS, messages=[
        {"role": "system", "content": "Always answer by calling a function."}, *ASK]).choices[0]
    assert r.message.tool_calls or r.message.content, r


def _assemble(chunks) -> tuple[str | None, list[tuple], str]:
    content, calls, finish = "", {}, None
    for ch in chunks:
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            if tc.index not in calls:  # a call's first delta: index, id, type and name
                assert tc.id and tc.type == "function" and tc.function.name, tc
                calls[tc.index] = [tc.id, tc.function.name, tc.function.arguments or ""]
            else:
                assert tc.id is None and not tc.function.name, tc
                calls[tc.index][2] += tc.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    return content or None, [tuple(calls[i][1:]) for i in sorted(calls)], finish


def test_streamed_calls_assemble_to_the_non_streamed_answer(stack):
    client = stack.client()
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, temperature=0, max_tokens=64,
                  parallel_tool_calls=False, logprobs=True)   # greedy SmolLM2 would repeat its call until max_tokens
        r = client.chat.completions.create(**kw)
        whole = r.choices[0]
        chunks = list(client.chat.completions.create(stream=True, **kw))
        # every generated token's log-probability, streamed too (a call's text is held back, its logprobs are not)
        assert len(whole.logprobs.content) == r.usage.completion_tokens
        assert sum(len(ch.choices[0].logprobs.content) for ch in chunks
                   if ch.choices and ch.choices[0].logprobs) == r.usage.completion_tokens
        arg_pieces = sum(1 for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []
                         if tc.function.arguments)
        content, calls, finish = _assemble(chunks)
        assert finish == whole.finish_reason == "tool_calls"
        assert content == whole.message.content
        assert calls == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
        assert arg_pieces > 1   # the arguments came in pieces, as they were generated


def _turn(result: str) -> list[dict]:
    return [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_abc123", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_abc123", "content": result}]


def test_a_tool_result_turn_is_answered(stack):
    client = stack.client()
    short = '{"forecast": "sunny, 21 C"}'
    r = client.chat.completions.create(model=MODEL, messages=_turn(short), tools=TOOLS, tool_choice="none",
                                       temperature=0, max_tokens=32)
    c = r.choices[0]
    assert c.message.content and not c.message.tool_calls and c.finish_reason in ("stop", "length"), c
    # the result is in the prompt: a longer result, more prompt tokens
    longer = client.chat.completions.create(model=MODEL, messages=_turn(short + " " * 0 + '{"extra": "rain later"}'),
                                            tools=TOOLS, tool_choice="none", temperature=0, max_tokens=1)
    assert longer.usage.prompt_tokens > r.usage.prompt_tokens
    # with the tools still offered (auto), the turn is answered too: text or a valid new call
    c = client.chat.completions.create(model=MODEL, messages=_turn(short), tools=TOOLS, temperature=0,
                                       max_tokens=48).choices[0]
    assert c.message.content or c.message.tool_calls, c
    for call in c.message.tool_calls or []:
        _valid(call)


def test_malformed_tools_are_400s_naming_the_field_and_the_server_goes_on(stack):
    import openai
    client = stack.client()
    bad_schema = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": "x"}}}]
    cases = [
        (dict(messages=ASK, tools=bad_schema), "tools[0].function.parameters"),
        (dict(messages=ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
        (dict(messages=ASK, tool_choice="required"), "tool_choice"),
        (dict(messages=[*_turn("x")[:2], {"role": "tool", "content": "21 C"}], tools=TOOLS), "messages[2].tool_call_id"),
        (dict(messages=[ASK[0], {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "get_weather", "arguments": "{not json"}}]}], tools=TOOLS),
         "messages[1].tool_calls[0].function.arguments"),
        (dict(messages=ASK, tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}),
         "response_format"),
    ]
    for kw, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, max_tokens=8, **kw)
        assert e.value.body["param"] == param and param in e.value.body["message"], (param, e.value.body)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": SHORT}], max_tokens=2,
                                       temperature=0)
    assert r.usage.completion_tokens == 2
