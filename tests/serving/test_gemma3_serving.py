"""The real Gemma 3 270M served as a user serves it: ``python -m harness.serve`` (what ``make serve``
runs) over the repository built from configs/gemma3-270m-bf16.yaml, asked through Triton's ensemble
with tritonclient, through the engine model with token ids, and through the OpenAI front door with
the ``openai`` package, its chat request rendered with the chat template the GGUF carries.

What each answer is held to:
- the ensemble's greedy continuation of "The capital of France is" is the one transformers and
  llama.cpp's own server give from this file (tests/builder/test_gguf_gemma_real.py), and it is the
  engine model's answer to the prompt's ids as Gemma 3 was trained to read them;
- an OpenAI chat request's prompt is Gemma 3's turn format (one ``<bos>``, ``<start_of_turn>user``,
  ``<end_of_turn>``, ``<start_of_turn>model``) in Kiln's SentencePiece tokenization, counted in
  ``usage.prompt_tokens``, and its greedy text is the engine model's for exactly those ids.
"""
from __future__ import annotations

import json
import signal

import pytest

from harness.model_names import DEFAULT as NAMES
from harness.serving_client import grpc_generate
from harness.serving_server import free_port
from tests.serving.openai_stack import engine_stream
from tests.serving.serve_process import READY, start_serve

pytestmark = pytest.mark.slow

FRANCE = "The capital of France is"
FRANCE_IDS = [2, 818, 5279, 529, 7001, 563]   # "<bos>The capital of France is", as Gemma 3 was trained
# greedy from FRANCE_IDS: transformers' Gemma3ForCausalLM and llama.cpp's server on the same GGUF
CONTINUATION = " the capital of the country of France. It is the largest"
QUESTION = "What is the capital of France?"
# Gemma 3's chat turns, as its chat template writes one user message and the model's turn opening
CHAT_PROMPT = f"<bos><start_of_turn>user\n{QUESTION}<end_of_turn>\n<start_of_turn>model\n"
MODEL = "gemma3-270m-bf16"   # the front door serves the config's stem


@pytest.fixture(scope="module")
def gemma_served(build_bundle):
    # the same build as tests/runtime/test_gemma3_real.py (one cached bundle for both)
    engine = build_bundle("gemma3-270m-bf16", ["engine.max_kv_tokens=4096", "verify.enabled=false"])
    ports = [free_port() for _ in range(4)]
    proc, lines = start_serve(engine.parent / "model_repository", ports)
    try:
        assert READY in "".join(lines), "".join(lines)
        yield engine, ports
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, "".join(lines) + rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def tokenizer(gemma_served):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(gemma_served[0] / "tokenizer" / "tokenizer.json"))


def _engine_greedy(grpc_port: int, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], str]:
    """Token ids straight to the engine model, streamed: (generated ids, the engine's output_text)."""
    got = engine_stream(f"127.0.0.1:{grpc_port}", prompt_ids, max_tokens)
    ids = [int(t) for r in got for t in r.as_numpy("output_ids").reshape(-1)]
    text = "".join(t.decode() for r in got for t in r.as_numpy("output_text").reshape(-1))
    return ids, text


def test_the_ensemble_continues_as_transformers_and_llama_cpp_do(gemma_served, tokenizer):
    _, ports = gemma_served
    assert tokenizer.encode(FRANCE).ids == FRANCE_IDS  # Kiln's SentencePiece tokenizer, <bos> included
    n = len(tokenizer.encode(CONTINUATION, add_special_tokens=False).ids)
    res = grpc_generate(f"127.0.0.1:{ports[1]}", NAMES.ensemble, FRANCE, max_tokens=n)
    assert res.error is None, res.error
    assert res.text == CONTINUATION
    ids, text = _engine_greedy(ports[1], FRANCE_IDS, n)
    assert text == CONTINUATION  # the engine's output_text, decoded once there
    assert tokenizer.decode(FRANCE_IDS + ids, skip_special_tokens=True) == FRANCE + CONTINUATION


def test_an_openai_chat_request_speaks_gemmas_turn_format(gemma_served, tokenizer):
    import openai

    _, ports = gemma_served
    chat_ids = tokenizer.encode(CHAT_PROMPT, add_special_tokens=False).ids
    assert chat_ids[0] == 2 and chat_ids.count(2) == 1  # one <bos>: the template's, none added twice
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{ports[3]}/v1", api_key="unused", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == [MODEL]
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                          max_tokens=12, temperature=0)
    assert resp.usage.prompt_tokens == len(chat_ids), (resp.usage, chat_ids)
    ids, text = _engine_greedy(ports[1], chat_ids, 12)
    assert resp.choices[0].message.content == text, json.dumps(resp.model_dump(), indent=1)
    assert resp.usage.completion_tokens == len(ids)
    # the ensemble's own chat template path (Kiln's apply_chat_template input) renders the same turns
    res = grpc_generate(f"127.0.0.1:{ports[1]}", NAMES.ensemble, QUESTION, max_tokens=12, apply_chat_template=True)
    assert res.error is None and res.text == text, res


def test_100_sampled_tool_calls_on_gemma_all_parse_and_validate(gemma_served):
    """The tool-calling guarantee on a second family: Gemma 3's template has no tools, so the
    built-in Hermes prompt and parser serve them (the model card says so), and every sampled
    ``required`` or named call is valid by construction through Gemma's 262k-piece vocabulary."""
    import openai

    from tests.serving.test_openai_tools import assert_100_sampled_calls_validate

    _, ports = gemma_served
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{ports[3]}/v1", api_key="unused", max_retries=0, timeout=300)
    card = client.models.retrieve(MODEL).model_dump()
    assert (card.get("tool_parser"), card.get("tool_prompt")) == ("hermes", "builtin_hermes"), card
    assert_100_sampled_calls_validate(client, MODEL, 2000)
