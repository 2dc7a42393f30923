"""The Responses API without a server: ``input`` items -> chat messages, the fields a 400 names, the
bounded store behind ``previous_response_id``, and the events and response object, each parsed by
the official ``openai`` package's own Responses types (what the SDKs read). The server test is
test_openai_responses.py."""
from __future__ import annotations

import pytest

from harness.openai.chat_answer import ChatAnswer
from harness.openai.errors import ApiError, bad_request
from harness.openai.reasoning import REASONING_PARSERS
from harness.openai.responses_input import ResponseStore, rename, to_chat_body
from harness.openai.responses_output import EventStream, ResponseObject, response_usage
from harness.openai.tool_parsers import FORMATS

TOOL = {"type": "function", "name": "get_weather", "description": "Weather", "strict": True,
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                       "additionalProperties": False}}


def test_input_items_become_the_chat_conversation():
    body = {"model": "m", "instructions": "Be brief.", "tools": [TOOL], "tool_choice": {"type": "function", "name": "get_weather"},
            "max_output_tokens": 20, "temperature": 0, "input": [
                {"role": "user", "content": "Weather in Nice?"},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me see.",
                                                                      "annotations": []}]},
                {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Nice"}'},
                {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
                {"type": "reasoning", "id": "rs_1", "summary": []},
                {"role": "user", "content": [{"type": "input_text", "text": "And "}, {"type": "input_text", "text": "Paris?"}]}]}
    chat = to_chat_body(body, ResponseStore())
    b = chat.body
    assert b["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Nice?"},
        {"role": "assistant", "content": "Let me see.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Nice"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "user", "content": "And Paris?"}]
    assert chat.origin == ["instructions", "input[0]", "input[1]", "input[3]", "input[5]"]
    assert b["tools"] == [{"type": "function", "function": {k: TOOL[k] for k in ("name", "description", "parameters", "strict")}}]
    assert b["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert b["max_tokens"] == 20 and b["temperature"] == 0 and "top_p" not in b
    assert to_chat_body({"input": "Hi"}, ResponseStore()).body["messages"] == [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("body,param", [
    ({}, "input"), ({"input": 3}, "input"), ({"input": [{"type": "image"}]}, "input[0].type"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]}, "input[0].arguments"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "tool_choice": {"type": "allowed_tools"}}, "tool_choice"),
    ({"input": "x", "instructions": 5}, "instructions"), ({"input": "x", "background": True}, "background"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": "x", "previous_response_id": "resp_nope"}, "previous_response_id"),
])
def test_mistakes_name_the_responses_field(body, param):
    with pytest.raises(ApiError) as e:
        to_chat_body(body, ResponseStore())
    assert e.value.status == 400 and e.value.param == param, e.value.message
    assert f"'{param}'" in e.value.message


def test_what_the_chat_checks_refuse_is_renamed_to_the_field_it_came_from():
    origin = ["instructions", "input[0]", "input[2]"]
    for chat_param, want in [("tools[1].function.parameters", "tools[1].parameters"), ("max_tokens", "max_output_tokens"),
                             ("messages[2].tool_call_id", "input[2]"), ("messages", "input"),
                             ("reasoning_effort", "reasoning.effort"), ("response_format", "text.format"),
                             ("temperature", "temperature")]:
        e = rename(bad_request(chat_param, "wrong"), origin)
        assert e.param == want and e.message == f"'{want}': wrong", (chat_param, e.param, e.message)


def test_the_store_keeps_the_newest_responses_and_continues_them():
    store = ResponseStore(size=3)
    for i in range(5):
        store.put(f"resp_{i}", [{"role": "user", "content": str(i)}])
    assert len(store) == 3 and store.get("resp_1") is None and store.get("resp_4") is not None
    chat = to_chat_body({"input": "next", "previous_response_id": "resp_4", "instructions": "New."}, store)
    assert chat.body["messages"] == [{"role": "system", "content": "New."}, {"role": "user", "content": "4"},
                                     {"role": "user", "content": "next"}]
    assert chat.history == [{"role": "user", "content": "4"}, {"role": "user", "content": "next"}]
    with pytest.raises(ApiError) as e:
        to_chat_body({"input": "x", "previous_response_id": "resp_1"}, store)   # forgotten
    assert e.value.param == "previous_response_id" and "resp_1" in e.value.message


def _run(text: str, fmt, reasoning, finish: str = "stop"):
    """The events of one answer written in 2-character pieces, and its final response object."""
    ans = ChatAnswer(fmt, reasoning)
    stream = EventStream(ResponseObject("m", {"tools": [TOOL]}, [TOOL]))
    events = stream.start()
    for i in range(0, len(text), 2):
        events += [e for d in ans.feed(text[i:i + 2]) for e in stream.delta(d)]
    events += [e for d in ans.end() for e in stream.delta(d)]
    last, final = stream.finish(response_usage(7, 9, 0), finish == "length")
    return events + last, final


def _parsed(events):
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter
    adapter = TypeAdapter(ResponseStreamEvent)
    out = [adapter.validate_python(e) for e in events]
    assert [e.sequence_number for e in out] == list(range(len(out)))
    Response.model_validate(events[-1]["response"])
    return out


def test_events_and_response_parse_as_openais_types_text_then_a_call():
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Nice"}}\n</tool_call>'
    events, final = _run(f"Let me check.\n{call}", FORMATS["hermes"], None)
    kinds = [e.type for e in _parsed(events)]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert kinds.count("response.output_item.added") == 2 == kinds.count("response.output_item.done")
    assert "response.output_text.delta" in kinds and "response.function_call_arguments.delta" in kinds
    assert [it["type"] for it in final["output"]] == ["message", "function_call"]
    msg, fc = final["output"]
    assert msg["content"][0]["text"] == "Let me check." and fc["name"] == "get_weather"
    assert fc["arguments"] == '{"city": "Nice"}' and fc["call_id"].startswith("call_") and fc["status"] == "completed"
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert deltas == fc["arguments"]
    assert final["usage"]["total_tokens"] == 16 and final["status"] == "completed"


def test_reasoning_is_its_own_item_and_a_cut_answer_is_incomplete():
    events, final = _run("Short.</think>\n\nParis", None, REASONING_PARSERS["think"].splitter("<think>\n"), "length")
    parsed = _parsed(events)
    assert [it["type"] for it in final["output"]] == ["reasoning", "message"]
    assert final["output"][0]["content"] == [{"type": "reasoning_text", "text": "Short."}]
    assert "".join(e.delta for e in parsed if e.type == "response.reasoning_text.delta") == "Short."
    assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [it["status"] for it in final["output"]] == ["completed", "incomplete"]   # the message was cut
    assert parsed[-1].type == "response.incomplete"
    # nothing written at all: still one (empty) message, as OpenAI answers
    events, final = _run("", None, None)
    _parsed(events)
    assert [it["type"] for it in final["output"]] == ["message"] and final["output"][0]["content"][0]["text"] == ""
