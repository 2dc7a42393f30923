"""The OpenAI front door (harness/openai) on the real stack, what it serves: models, health,
metrics, chat and completions checked against the ensemble (greedy text), the tokenizer (prompt
tokens) and the engine model itself (generated tokens), sampling parameters, log-probabilities,
streams and the README's curl lines. The official ``openai`` package is the client; the stack
(tests/serving/openai_stack.py) starts once for the package."""
from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import requests

from harness.model_names import DEFAULT as NAMES
from tests.serving.openai_stack import (ASK, MODEL, SHORT, engine_token_count, ensemble_text, sse_events,
                                        sse_events_of)

pytestmark = [pytest.mark.slow, pytest.mark.server]


# ---- what is served ------------------------------------------------------------------------------

def test_serve_banner_models_health_metrics(stack):
    assert stack.base in stack.banner and "/chat/completions" in stack.banner and f'"{MODEL}"' in stack.banner
    models = stack.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert requests.get(f"{stack.base}/models/{MODEL}", timeout=10).json()["id"] == MODEL
    h = requests.get(f"{stack.root}/health", timeout=10)
    assert h.status_code == 200 and h.json()["engine_model"] == NAMES.engine
    m = requests.get(f"{stack.root}/metrics", timeout=10)
    assert m.status_code == 200 and "kiln_kv_blocks_used" in m.text


# ---- answers -------------------------------------------------------------------------------------

def test_chat_greedy_equals_ensemble_streamed_and_not(stack, text_tokenizer):
    client, n = stack.client(), 12
    want = ensemble_text(stack, ASK, n, chat=True)
    assert want.strip()
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ASK}],
                                       max_tokens=n, temperature=0, logprobs=True, top_logprobs=1)
    assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "length"
    # the chosen token's log-probability per generated token; greedy, so it is also the top one
    lps = r.choices[0].logprobs.content
    assert len(lps) == n and "".join(e.token for e in lps) == want and all(e.logprob <= 0 for e in lps)
    assert all([(t.token, t.logprob) for t in e.top_logprobs] == [(e.token, e.logprob)] for e in lps)
    prompt_tokens = len(text_tokenizer.encode(ASK, chat=True))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (prompt_tokens, n, prompt_tokens + n)

    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ASK}],
                                                 max_completion_tokens=n, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == r.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_greedy_equals_ensemble_with_logprobs(stack, text_tokenizer):
    client, n = stack.client(), 10
    prompt = "The capital of France is"
    want = ensemble_text(stack, prompt, n, chat=False)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0, logprobs=1)
    c = r.choices[0]
    assert c.text == want and c.finish_reason == "length"
    assert r.usage.prompt_tokens == len(text_tokenizer.encode(prompt)) and r.usage.completion_tokens == n
    # one log-probability per generated token, the chosen (= most likely, greedy) one as top-1
    assert len(c.logprobs.tokens) == n and "".join(c.logprobs.tokens) == want
    assert all(lp <= 0 for lp in c.logprobs.token_logprobs)
    assert c.logprobs.top_logprobs == [{t: lp} for t, lp in zip(c.logprobs.tokens, c.logprobs.token_logprobs)]
    # streamed, and the prompt as token ids: the same text
    ids = text_tokenizer.encode(prompt)
    streamed = list(client.completions.create(model=MODEL, prompt=ids, max_tokens=n, temperature=0, stream=True))
    assert "".join(x.choices[0].text for x in streamed) == want
    assert streamed[-1].choices[0].finish_reason == "length"


def test_top_logprobs_are_the_engines_alternatives(stack):
    """Sampled chat with top_logprobs 5 and completions with logprobs 3: each token lists that many
    distinct alternatives, most likely first; the chosen token, when among them, has the same
    log-probability, and none is above the most likely one (the engine's top_logprobs extension)."""
    client, n = stack.client(), 8
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ASK}], max_tokens=n,
                                       temperature=1.0, seed=11, logprobs=True, top_logprobs=5)
    entries = r.choices[0].logprobs.content
    assert len(entries) == n
    for e in entries:
        alts = [(a.token, a.logprob) for a in e.top_logprobs]
        assert len(alts) == 5 and len({t for t, _ in alts}) == 5, alts
        assert [v for _, v in alts] == sorted((v for _, v in alts), reverse=True)
        assert e.logprob <= alts[0][1] + 1e-6
        same = [v for t, v in alts if t == e.token]
        assert not same or abs(same[0] - e.logprob) < 1e-5, (e.token, e.logprob, alts)
    c = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=n, temperature=0,
                                  logprobs=3).choices[0]
    assert len(c.logprobs.top_logprobs) == n
    for tok, lp, alts in zip(c.logprobs.tokens, c.logprobs.token_logprobs, c.logprobs.top_logprobs):
        assert len(alts) == 3 and max(alts.values()) == alts.get(tok) == lp   # greedy: the chosen is the top


def test_usage_counts_the_engines_tokens(stack, text_tokenizer):
    """An answer that ends on the end token before max_tokens: completion_tokens is what the engine
    model generates for the same ids, prompt_tokens what the tokenizer gives for the template."""
    r = stack.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": SHORT}],
                                               max_tokens=16, temperature=0)
    ids = text_tokenizer.encode(SHORT, chat=True)
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == engine_token_count(stack, ids, 16) < 16


def test_conversation_renders_every_message(stack, text_tokenizer):
    """system (as OpenAI's "developer"), user, assistant, user: the chat template's ChatML, spelled
    out by hand here, is what the engine is given."""
    msgs = [{"role": "developer", "content": "Answer briefly."}, {"role": "user", "content": "Hi!"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": [{"type": "text", "text": "Name a "}, {"type": "text", "text": "colour."}]}]
    chatml = ("<|im_start|>system\nAnswer briefly.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
              "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nName a colour.<|im_end|>\n"
              "<|im_start|>assistant\n")
    r = stack.client().chat.completions.create(model=MODEL, messages=msgs, max_tokens=1, temperature=0)
    assert r.usage.prompt_tokens == len(text_tokenizer.tokenizer.encode(chatml, add_special_tokens=False).ids)
    assert r.usage.completion_tokens == 1


def test_stop_strings_cut_the_text(stack):
    client, n = stack.client(), 16
    full = client.completions.create(model=MODEL, prompt=ASK, max_tokens=n, temperature=0).choices[0].text
    words = full.split()
    assert len(words) >= 3, full
    stop = words[2]
    want = full[: full.index(stop)]
    r = client.completions.create(model=MODEL, prompt=ASK, max_tokens=n, temperature=0, stop=[stop, "\x00never"])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (want, "stop")
    assert r.usage.completion_tokens < n
    streamed = list(client.completions.create(model=MODEL, prompt=ASK, max_tokens=n, temperature=0, stop=stop,
                                              stream=True))
    assert "".join(x.choices[0].text for x in streamed) == want
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_sampling_defaults_sample_and_seed_repeats(stack):
    """OpenAI's defaults (temperature 1, top_p 1) must sample, not fall into the engine's greedy
    default for requests without top_p; the same seed gives the same text."""
    client, n = stack.client(), 8
    greedy = client.completions.create(model=MODEL, prompt=ASK, max_tokens=n, temperature=0).choices[0].text
    texts = [client.completions.create(model=MODEL, prompt=ASK, max_tokens=n, seed=s).choices[0].text for s in (1, 2, 3)]
    assert any(t != greedy for t in texts), texts
    again = client.completions.create(model=MODEL, prompt=ASK, max_tokens=n, seed=1).choices[0].text
    assert again == texts[0]


def test_penalties_and_vllm_extensions_reach_the_engine(stack):
    """frequency_penalty changes a greedy answer; top_k 1 samples greedily; ignore_eos runs past the
    end token to max_tokens."""
    client, n = stack.client(), 16
    count = "1, 2, 3, 4, 5,"  # greedy goes on " 6, 7, ...": the comma repeats, a penalty must change it
    plain = client.completions.create(model=MODEL, prompt=count, max_tokens=n, temperature=0).choices[0].text
    penalized = client.completions.create(model=MODEL, prompt=count, max_tokens=n, temperature=0,
                                          frequency_penalty=2.0).choices[0].text
    assert plain.startswith(" 6, 7,") and penalized != plain, (plain, penalized)
    greedy = client.completions.create(model=MODEL, prompt=ASK, max_tokens=n, temperature=0).choices[0].text
    top1 = client.completions.create(model=MODEL, prompt=ASK, max_tokens=n, temperature=1.0, seed=5,
                                     extra_body={"top_k": 1}).choices[0].text
    assert top1 == greedy
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": SHORT}], max_tokens=12,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (12, "length")


def test_logit_bias_reaches_the_engine(stack, text_tokenizer):
    """logit_bias -100 on the greedy answer's first token makes it start otherwise; +100 on another
    token makes the answer start with it (through the engine's embedding_bias)."""
    client, n = stack.client(), 6
    count = "1, 2, 3, 4, 5,"
    enc = lambda text: text_tokenizer.tokenizer.encode(text, add_special_tokens=False).ids  # noqa: E731
    first_token = lambda answer: enc(count + answer)[len(enc(count))]  # noqa: E731
    plain = client.completions.create(model=MODEL, prompt=count, max_tokens=n, temperature=0).choices[0].text
    first = first_token(plain)
    banned = client.completions.create(model=MODEL, prompt=count, max_tokens=n, temperature=0,
                                       logit_bias={str(first): -100}).choices[0].text
    assert banned and first_token(banned) != first, (plain, banned)
    forced = text_tokenizer.tokenizer.encode(" banana", add_special_tokens=False).ids[0]
    pushed = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": SHORT}], max_tokens=n,
                                            temperature=0, logit_bias={str(forced): 100})
    assert pushed.choices[0].message.content.lstrip().startswith("banana"), pushed


def test_skip_special_tokens_false_keeps_special_tokens_but_never_the_end_token(stack):
    """vLLM's ``skip_special_tokens``: false reaches the engine, whose text then spells a special
    token the model wrote (<|im_start|>, forced by logit_bias); the end token that stops an answer
    is never text, kept or not."""
    client = stack.client()

    def text(bias: dict, **extra) -> tuple[str, str, int]:
        c = client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=2, temperature=0,
                                      logit_bias=bias, extra_body=extra)
        return c.choices[0].text, c.choices[0].finish_reason, c.usage.completion_tokens
    im_start, im_end = "1", "2"   # SmolLM2's special tokens; <|im_end|> (2) is its end token
    assert text({im_start: 100}) == ("", "length", 2)   # skipped by default, still generated
    assert text({im_start: 100}, skip_special_tokens=False) == ("<|im_start|><|im_start|>", "length", 2)
    assert text({im_end: 100}, skip_special_tokens=False)[:2] == ("", "stop")
    r = requests.post(f"{stack.base}/completions", timeout=60, json={
        "model": MODEL, "prompt": "1,", "max_tokens": 2, "skip_special_tokens": "no"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "skip_special_tokens", r.text


def test_raw_stream_ends_with_done_and_usage(stack):
    body = {"model": MODEL, "messages": [{"role": "user", "content": SHORT}], "max_tokens": 4,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    with requests.post(f"{stack.base}/chat/completions", json=body, stream=True, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 4


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed on this machine")
def test_readme_openai_curl_examples_work_as_printed(stack):
    """docs/openai.md: its curl lines for port 9000, run with this stack's port and model id."""
    from tests.serving.test_readme_examples import readme_curl_commands
    cmds = [c for c in readme_curl_commands() if "localhost:9000" in c]
    assert len(cmds) >= 3 and any("/v1/chat/completions" in c for c in cmds), cmds
    for cmd in cmds:
        local = cmd.replace("localhost:9000", f"127.0.0.1:{stack.openai}").replace('"smollm2-135m-fp8"', f'"{MODEL}"')
        run = subprocess.run(["bash", "-o", "pipefail", "-c", local], capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, (local, run.stderr[-1000:])
        if '"stream":true' in cmd:
            events = sse_events_of(run.stdout)
            assert events[-1] == "[DONE]" and "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]).strip()
            continue
        body = json.loads(run.stdout)
        assert "error" not in body, body
        if cmd.rstrip().endswith("/v1/models"):
            assert body["data"][0]["id"] == MODEL
        elif '"tools"' in cmd:  # the tool-calling example: one call, its arguments valid
            import jsonschema
            tool = json.loads(cmd.split("-d '", 1)[1].rsplit("'", 1)[0])["tools"][0]["function"]
            (call,) = body["choices"][0]["message"]["tool_calls"]
            assert call["function"]["name"] == tool["name"] and body["choices"][0]["finish_reason"] == "tool_calls"
            jsonschema.validate(json.loads(call["function"]["arguments"]), tool["parameters"])
        else:
            assert body["choices"][0]["message"]["content"].strip() and body["usage"]["completion_tokens"] > 0
        if "response_format" in cmd:  # the structured-output example: its schema holds
            import jsonschema
            schema = json.loads(cmd.split("-d '", 1)[1].rsplit("'", 1)[0])["response_format"]["json_schema"]["schema"]
            jsonschema.validate(json.loads(body["choices"][0]["message"]["content"]), schema)
            assert body["choices"][0]["finish_reason"] == "stop"
    assert any("response_format" in c for c in cmds), "README 'OpenAI API' lost its structured-output example"
    assert any('"tools"' in c for c in cmds), "docs/openai.md lost its tool-calling example"


# ---- structured output (response_format, vLLM's guided_*) -----------------------------------------
# The engine masks every token with the grammar, so a sampled (temperature 1) answer of a 135M model
# still parses and validates; without the mask these answers are prose. Bounded strings and numbers
# keep every answer short: each must end on its own ("stop"), not at max_tokens.
