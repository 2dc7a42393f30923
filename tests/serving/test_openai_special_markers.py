"""Chat answers keep the special tokens a family's tool or reasoning syntax is written in: Mistral's
``[TOOL_CALLS]`` and gpt-oss's ``<|channel|>`` are special tokens of their vocabularies, which a
default decode drops, so their parsers would never see a call. Checked on SmolLM2's tokenizer with
those markers added as special tokens, as those vocabularies have them."""
from __future__ import annotations

import asyncio
import dataclasses

import pytest

from harness.openai.reasoning import choose_reasoning
from harness.openai.served_model import markers_are_special
from harness.openai.tool_parsers import FORMATS


@pytest.fixture
def tok(smollm2_hf_dir):
    from tokenizers import AddedToken, Tokenizer

    from backend.serving.conversion.tokenizer import TextTokenizer
    t = Tokenizer.from_file(str(smollm2_hf_dir / "tokenizer.json"))
    t.add_special_tokens([AddedToken(s, special=True, normalized=False)
                          for s in ("[TOOL_CALLS]", "[ARGS]", "<|channel|>", "<|message|>", "<|end|>")])
    return TextTokenizer(t)


def test_rows_whose_markers_are_special_tokens_are_found(tok):
    assert markers_are_special(tok, [FORMATS["mistral"], None])
    assert markers_are_special(tok, [None, choose_reasoning("harmony", None)])
    assert not markers_are_special(tok, [FORMATS["hermes"], choose_reasoning("think", None)])
    assert not markers_are_special(tok, [None, None])


def test_the_engine_decoder_keeps_them_and_drops_the_end_tokens(tok):
    ids = tok.tokenizer.encode("[TOOL_CALLS]get_time[ARGS]{}", add_special_tokens=False).ids
    end = tok.tokenizer.token_to_id("<|im_end|>")
    assert tok.decode(ids + [end]) == "get_time{}"    # the default: special tokens skipped
    assert tok.keeping_special([end]).decode(ids + [end]) == "[TOOL_CALLS]get_time[ARGS]{}"


def test_chat_on_such_a_model_asks_the_engine_for_them(tok):
    from harness.openai.engine_client import engine_inputs
    from harness.openai.limits import Limits
    from harness.openai.request_plan import plan_request
    from harness.openai.served_model import ServedModel
    tok.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    base = ServedModel("m", "tensorrt_llm", None, tok, 100, 200, tok.vocab_size, 0, FORMATS["mistral"], None)

    def sent(model, body) -> dict:
        plan = asyncio.run(plan_request(model, Limits(), {"max_tokens": 4, **body}, chat="messages" in body))
        return {i.name(): i for i in engine_inputs(plan.ids, plan.max_tokens, plan.sampling, model.vocab_size)}
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    marked = dataclasses.replace(base, markers_are_special=True)
    assert "skip_special_tokens" in sent(marked, chat)   # sent only as false
    assert "skip_special_tokens" not in sent(base, chat)
    assert "skip_special_tokens" not in sent(marked, {"prompt": "hi"})   # completions: the text as asked
    assert "skip_special_tokens" not in sent(marked, {**chat, "skip_special_tokens": True})
