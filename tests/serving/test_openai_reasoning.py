"""Reasoning output through the real server: a second front door over the stack's Triton serves
SmolLM2 with a ``<think>`` chat template (``--chat-template``, tests/serving/think_template.py), so
``--reasoning-parser auto`` picks ``think``. SmolLM2 does not think on its own; a grammar
(``guided_grammar``) makes it write reasoning, ``</think>`` and an answer, greedily, so every run
gives the same text, and the split is checked against that same text from ``/v1/completions``."""
from __future__ import annotations

import re

import pytest
import requests

from harness.openai.process import OpenAIServer
from harness.serving_server import free_port
from tests.serving.openai_stack import MODEL
from tests.serving.think_template import THINK_TEMPLATE

pytestmark = [pytest.mark.slow, pytest.mark.server]

THOUGHT = '[a-zA-Z ,.]{1,60} "</think>\\n\\n" [a-zA-Z ,.]{1,40}'
GRAMMAR = f"root ::= {THOUGHT}"
PLAIN = "root ::= [a-zA-Z ,.]{1,40}"
ASK = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def thinker(stack, serving_build, tmp_path_factory):
    d = tmp_path_factory.mktemp("think")
    (d / "think.jinja").write_text(THINK_TEMPLATE)
    srv = OpenAIServer(serving_build / "model_repository", stack.grpc_url, None, port=free_port(),
                       log_file=d / "openai.log", extra_args=("--chat-template", str(d / "think.jinja")))
    with srv:
        yield srv


def _client(srv):
    import openai
    return openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=120)


def _chat(srv, **kw):
    body = {"model": MODEL, "messages": ASK, "temperature": 0, "max_tokens": 80, "guided_grammar": GRAMMAR, **kw}
    return _client(srv).chat.completions.create(**{k: v for k, v in body.items() if k in (
        "model", "messages", "temperature", "max_tokens", "stream", "reasoning_effort")},
        extra_body={k: v for k, v in body.items() if k in ("guided_grammar", "chat_template_kwargs")})


def test_reasoning_is_split_from_the_answer(thinker, serving_build):
    from harness.openai.prompts import chat_prompt
    from harness.openai.served_model import load_served_model
    r = _chat(thinker)
    msg = r.choices[0].message
    reasoning, content = msg.reasoning_content, msg.content
    assert reasoning and content and r.choices[0].finish_reason == "stop", msg
    assert "think>" not in reasoning + content
    # the same prompt, the same grammar, unsplit: the engine's own text is reasoning</think>\n\ncontent
    model = load_served_model(serving_build / "model_repository", chat_template=THINK_TEMPLATE)
    ids, text = chat_prompt(model, ASK)
    assert text.endswith("<think>\n")
    raw = requests.post(f"{thinker.base_url}/completions", timeout=120, json={
        "model": MODEL, "prompt": ids, "max_tokens": 80, "temperature": 0, "guided_grammar": GRAMMAR}).json()
    thought, _, answer = raw["choices"][0]["text"].partition("</think>")
    assert (thought, answer.lstrip()) == (reasoning, content)
    assert r.usage.prompt_tokens == len(ids)
    card = requests.get(f"{thinker.base_url}/models", timeout=10).json()["data"][0]
    assert card["reasoning_parser"] == "think"


def test_streamed_reasoning_comes_first_and_joins_to_the_answer(thinker, stack):
    whole = _chat(thinker).choices[0].message
    kinds, got = [], {"reasoning_content": "", "content": ""}
    for chunk in _chat(thinker, stream=True):
        d = chunk.choices[0].delta
        for k in got:
            piece = getattr(d, k, None)
            if piece:
                got[k] += piece
                kinds.append(k)
    assert got == {"reasoning_content": whole.reasoning_content, "content": whole.content}
    assert kinds.index("content") > max(i for i, k in enumerate(kinds) if k == "reasoning_content")
    assert len(kinds) > 2   # in pieces, not one delta each
    # the bundle's own template (the stack's front door) does not think: no reasoning field at all
    plain = stack.client().chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=8)
    assert getattr(plain.choices[0].message, "reasoning_content", None) is None
    card = requests.get(f"{stack.base}/models", timeout=10).json()["data"][0]
    assert card["reasoning_parser"] is None


def test_template_kwargs_reach_the_template(thinker):
    thinking = _chat(thinker)
    off = _chat(thinker, guided_grammar=PLAIN, chat_template_kwargs={"enable_thinking": False})
    msg = off.choices[0].message
    # the template wrote an empty block into the prompt: the answer is all content
    assert msg.reasoning_content is None and re.fullmatch(r"[a-zA-Z ,.]{1,40}", msg.content), msg
    assert off.usage.prompt_tokens > thinking.usage.prompt_tokens
    effort = _chat(thinker, reasoning_effort="high")
    assert effort.usage.prompt_tokens > thinking.usage.prompt_tokens + 3   # the template's system line
    import openai
    with pytest.raises(openai.BadRequestError) as e:
        _chat(thinker, reasoning_effort="extreme")
    assert e.value.body["param"] == "reasoning_effort"
    with pytest.raises(openai.BadRequestError) as e:
        _chat(thinker, chat_template_kwargs={"messages": []})
    assert e.value.body["param"] == "chat_template_kwargs"


def test_the_responses_api_gives_reasoning_its_own_item(thinker):
    msg = _chat(thinker).choices[0].message
    r = _client(thinker).responses.create(model=MODEL, input=ASK[0]["content"], temperature=0, max_output_tokens=80,
                                          extra_body={"guided_grammar": GRAMMAR})
    assert r.status == "completed" and [it.type for it in r.output] == ["reasoning", "message"], r
    assert r.output[0].content[0].text == msg.reasoning_content and r.output_text == msg.content
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
