"""The OpenAI front door (harness/openai) on the real stack: ``python -m harness.serve --openai-port``
(what ``make serve`` runs) starts the real Triton server on the real SmolLM2 build and the front door
beside it, ONCE for this module; the official ``openai`` package is the client. Answers are checked
against the ensemble (greedy text), the tokenizer (prompt tokens) and the engine model itself
(generated tokens); cancellation against Kiln's metrics.
"""
from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest
import requests

from harness.model_names import DEFAULT as NAMES
from harness.serving_client import grpc_generate
from harness.serving_server import free_port

pytestmark = [pytest.mark.slow, pytest.mark.server]

MODEL = "smollm2-135m-bf16"   # the serving build's config stem: the model id the front door serves
ASK = "Tell me about Paris"   # greedy answers run on for many tokens: finish_reason "length"
SHORT = "What is the capital of France?"  # greedy answer ends with the end token in 8 tokens


class Stack:
    def __init__(self, proc, banner, ports):
        self.proc, self.banner = proc, banner
        self.http, self.grpc, self.metrics, self.openai = ports
        self.base = f"http://127.0.0.1:{self.openai}/v1"
        self.root = f"http://127.0.0.1:{self.openai}"
        self.grpc_url = f"127.0.0.1:{self.grpc}"

    def client(self, **kw):
        import openai
        return openai.OpenAI(base_url=self.base, api_key="unused", max_retries=0, timeout=120, **kw)

    def metric(self, name: str, **labels) -> float:
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics}/metrics", timeout=5).read().decode()
        want = {"model": NAMES.engine, **labels}
        for line in text.splitlines():
            m = re.match(rf"^{name}\{{([^}}]*)\}} (\S+)$", line)
            if m and all(f'{k}="{v}"' in m.group(1) for k, v in want.items()):
                return float(m.group(2))
        raise AssertionError(f"{name} {want} not in Triton's metrics")


@pytest.fixture(scope="module")
def stack(serving_build):
    ports = [free_port() for _ in range(4)]
    assert len(set(ports)) == 4
    proc = subprocess.Popen([sys.executable, "-m", "harness.serve", "--model-repository",
                             str(serving_build / "model_repository"), "--http-port", str(ports[0]),
                             "--grpc-port", str(ports[1]), "--metrics-port", str(ports[2]),
                             "--openai-port", str(ports[3])],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "Ctrl-C stops the server" in line:
                break
        assert "Ctrl-C stops the server" in "".join(lines), "".join(lines)
        yield Stack(proc, "".join(lines), ports)
        # make serve's Ctrl-C stops the front door too, and the whole thing exits cleanly
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, "".join(lines) + rest
        with pytest.raises(requests.ConnectionError):
            requests.get(f"http://127.0.0.1:{ports[3]}/health", timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def ensemble_text(stack: Stack, prompt: str, max_tokens: int, chat: bool) -> str:
    """The same prompt through Triton's ensemble, greedy (it sets neither top_k nor top_p)."""
    res = grpc_generate(stack.grpc_url, NAMES.ensemble, prompt, max_tokens=max_tokens, apply_chat_template=chat)
    assert res.error is None, res.error
    return res.text


def engine_token_count(stack: Stack, prompt_ids: list[int], max_tokens: int) -> int:
    """Generated ids of a greedy request straight to the engine model (no front door)."""
    import tritonclient.grpc as g
    inputs = []
    for name, arr, dt in [("input_ids", np.array([prompt_ids], np.int32), "INT32"),
                          ("request_output_len", np.array([[max_tokens]], np.int32), "INT32"),
                          ("streaming", np.array([[True]]), "BOOL")]:
        inp = g.InferInput(name, list(arr.shape), dt)
        inp.set_data_from_numpy(arr)
        inputs.append(inp)
    got, done = [], []
    client = g.InferenceServerClient(stack.grpc_url)
    client.start_stream(callback=lambda result, error: (got.append((result, error)), done.append(
        error is not None or result.as_numpy("finish_reason").reshape(-1)[0] != b"")))
    client.async_stream_infer(NAMES.engine, inputs)
    client.stop_stream()  # waits for the stream's end
    client.close()
    assert all(e is None for _, e in got) and any(done), got
    return sum(r.as_numpy("output_ids").size for r, _ in got)


def sse_events(resp) -> list[str]:
    return [line[5:].strip() for line in resp.iter_lines(decode_unicode=True) if line.startswith("data:")]


def sse_events_of(text: str) -> list[str]:
    return [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]


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
    """README "OpenAI API": its curl lines for port 9000, run with this stack's port and model id."""
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
        else:
            assert body["choices"][0]["message"]["content"].strip() and body["usage"]["completion_tokens"] > 0
        if "response_format" in cmd:  # the structured-output example: its schema holds
            import jsonschema
            schema = json.loads(cmd.split("-d '", 1)[1].rsplit("'", 1)[0])["response_format"]["json_schema"]["schema"]
            jsonschema.validate(json.loads(body["choices"][0]["message"]["content"]), schema)
            assert body["choices"][0]["finish_reason"] == "stop"
    assert any("response_format" in c for c in cmds), "README 'OpenAI API' lost its structured-output example"


# ---- structured output (response_format, vLLM's guided_*) -----------------------------------------
# The engine masks every token with the grammar, so a sampled (temperature 1) answer of a 135M model
# still parses and validates; without the mask these answers are prose. Bounded strings and numbers
# keep every answer short: each must end on its own ("stop"), not at max_tokens.

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 16},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "sunny", "celsius"],
           "properties": {"city": {"enum": ["Paris", "Lyon", "Nice"]}, "sunny": {"type": "boolean"},
                          "celsius": {"type": "integer", "minimum": -20, "maximum": 45}}}
TAGS = {"type": "object", "additionalProperties": False, "required": ["tags"],
        "properties": {"tags": {"type": "array", "minItems": 1, "maxItems": 3,
                                "items": {"enum": ["red", "green", "blue"]}}}}


def _schema_format(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def test_json_schema_answers_validate_sampled_streamed_and_not(stack):
    import jsonschema
    client, n = stack.client(), 96
    answers = []  # (schema, text, finish_reason)
    for seed in (1, 2):  # chat, not streamed
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Invent a person; answer in JSON."}], max_tokens=n,
            temperature=1.0, seed=seed, response_format=_schema_format("person", PERSON))
        answers.append((PERSON, r.choices[0].message.content, r.choices[0].finish_reason))
        assert r.usage.completion_tokens < n
    chunks = list(client.chat.completions.create(  # chat, streamed
        model=MODEL, messages=[{"role": "user", "content": "The weather in France today, as JSON."}], max_tokens=n,
        temperature=1.0, seed=3, stream=True, response_format=_schema_format("weather", WEATHER)))
    answers.append((WEATHER, "".join(c.choices[0].delta.content or "" for c in chunks if c.choices),
                    [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason][-1]))
    # completions (vLLM accepts response_format there too), streamed; and vLLM's guided_json as text
    pieces = list(client.completions.create(model=MODEL, prompt="Some colours as JSON:", max_tokens=n, temperature=1.0,
                                            seed=4, stream=True, extra_body={"response_format": _schema_format("tags", TAGS)}))
    answers.append((TAGS, "".join(p.choices[0].text for p in pieces), pieces[-1].choices[0].finish_reason))
    r = client.completions.create(model=MODEL, prompt="A person as JSON:", max_tokens=n, temperature=1.0, seed=5,
                                  extra_body={"guided_json": json.dumps(PERSON)})
    answers.append((PERSON, r.choices[0].text, r.choices[0].finish_reason))
    for schema, text, finish in answers:
        assert finish == "stop", (text, finish)
        jsonschema.validate(json.loads(text), schema)


def test_json_object_regex_and_grammar_constrain_the_text(stack):
    client = stack.client()
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe Paris as a JSON object with its country."}],
        max_tokens=96, temperature=0, response_format={"type": "json_object"})
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(text), dict), text
    regex = r"[A-Z][a-z]{1,9}( [a-z]{1,9}){1,3}\."
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell me about Paris"}],
                                       max_tokens=48, temperature=1.0, seed=6, extra_body={"guided_regex": regex})
    assert r.choices[0].finish_reason == "stop" and re.fullmatch(regex, r.choices[0].message.content), r
    pieces = list(client.completions.create(model=MODEL, prompt="The first three numbers:", max_tokens=24,
                                            temperature=1.0, seed=7, stream=True,
                                            extra_body={"guided_regex": r" [0-9]{1,2}(, [0-9]{1,2}){2}"}))
    text = "".join(p.choices[0].text for p in pieces)
    assert re.fullmatch(r" [0-9]{1,2}(, [0-9]{1,2}){2}", text) and pieces[-1].choices[0].finish_reason == "stop", text
    r = client.completions.create(model=MODEL, prompt="Is Paris in France? Answer:", max_tokens=8, temperature=1.0,
                                  seed=8, extra_body={"guided_grammar": 'root ::= " yes" | " no"'})
    assert r.choices[0].text in (" yes", " no") and r.choices[0].finish_reason == "stop", r


def test_a_guide_the_engine_cannot_compile_is_a_400_naming_its_field(stack):
    import openai
    client = stack.client()
    msgs = [{"role": "user", "content": "Hi"}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8,
                                       response_format=_schema_format("bad", {"type": "bogus"}))
    assert e.value.param == "response_format" and "bogus" in e.value.message, e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=8, extra_body={"guided_regex": "(a"})
    assert e.value.param == "guided_regex" and "not closed" in e.value.message, e.value.message  # xgrammar's words
    # streamed: still a real 400 (the engine refuses before the first token, before the headers)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 8, "stream": True, "guided_json": {"type": "bogus"}}
    r = requests.post(f"{stack.base}/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_json", r.text
    # and the server goes on serving constrained requests
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=8, extra_body={"guided_regex": "ab"})
    assert (r.choices[0].text, r.choices[0].finish_reason) == ("ab", "stop")


def test_conflicting_constraints_are_refused(stack):
    import openai
    client = stack.client()
    msgs = [{"role": "user", "content": "Hi"}]
    cases = [  # (extra fields, param, words)
        ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex",
         "response_format and guided_regex both constrain"),
        ({"guided_json": PERSON, "guided_grammar": 'root ::= "a"'}, "guided_grammar", "guided_json and guided_grammar"),
        ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos", "response_format"),
        ({"guided_regex": "a+", "min_tokens": 2}, "min_tokens", "guided_regex"),
    ]
    for extra, param, words in cases:
        for create in (lambda **kw: client.chat.completions.create(messages=msgs, **kw),
                       lambda **kw: client.completions.create(prompt="x", **kw)):
            with pytest.raises(openai.BadRequestError) as e:
                create(model=MODEL, max_tokens=4, extra_body=extra)
            assert e.value.param == param and words in e.value.message, (extra, e.value.message)
    # text is no constraint: with one guide it is fine
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=4,
                                  extra_body={"response_format": {"type": "text"}, "guided_regex": "ab"})
    assert r.choices[0].text == "ab"


# ---- cancellation --------------------------------------------------------------------------------

def _wait(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:.0f} s: {what}")


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_goes_away_frees_its_kv_blocks(stack, stream):
    """The request could run ~900 tokens (tens of seconds); the client leaves after a moment and the
    engine cancels it: the KV blocks are back within seconds and the engine counts a cancellation."""
    idle = stack.metric("kiln_kv_blocks_used")
    cancelled = stack.metric("kiln_request_errors_total", kind="cancelled")
    body = {"model": MODEL, "prompt": ASK, "max_tokens": 900, "ignore_eos": True, "stream": stream}
    if stream:
        with requests.post(f"{stack.base}/completions", json=body, stream=True, timeout=60) as r:
            lines = r.iter_lines()
            assert [next(lines) for _ in range(4)]  # a few events: the request runs in the engine
            _wait(lambda: stack.metric("kiln_kv_blocks_used") > idle, 10, "the request holds KV blocks")
    else:
        with pytest.raises(requests.exceptions.ReadTimeout):
            requests.post(f"{stack.base}/completions", json=body, timeout=(5, 1.5))
    _wait(lambda: stack.metric("kiln_kv_blocks_used") == idle, 10, "KV blocks back to their idle count")
    assert stack.metric("kiln_request_errors_total", kind="cancelled") == cancelled + 1
    # and the server goes on serving
    r = stack.client().completions.create(model=MODEL, prompt=ASK, max_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2


# ---- refusals ------------------------------------------------------------------------------------

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
LONG = " ".join(["Paris"] * 600)  # over the serving build's max_input_len=512

MALFORMED = [  # (route, body, status, param, words in the message)
    ("chat/completions", b"{not json", 400, None, "not valid JSON"),
    ("chat/completions", {"messages": CHAT["messages"]}, 400, "model", "required"),
    ("chat/completions", {"model": MODEL}, 400, "messages", "required"),
    ("chat/completions", {**CHAT, "messages": []}, 400, "messages", "non-empty"),
    ("chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role", "wizard"),
    ("chat/completions", {**CHAT, "temperature": 3}, 400, "temperature", "out of range"),
    ("chat/completions", {**CHAT, "top_p": "high"}, 400, "top_p", "finite number"),
    ("chat/completions", {**CHAT, "max_tokens": 0}, 400, "max_tokens", "out of range"),
    ("chat/completions", {**CHAT, "max_tokens": 5000}, 400, "max_tokens", "max_seq_len"),
    ("chat/completions", {**CHAT, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "at most 4"),
    ("chat/completions", {**CHAT, "n": 2}, 400, "n", "n=1"),
    ("chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", "allowed: [0, 20]"),
    ("chat/completions", {**CHAT, "stream_options": {"include_usage": True}}, 400, "stream_options", "stream"),
    ("chat/completions", {**CHAT, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, 400, "messages[0].content[0]", "only text"),
    ("chat/completions", {**CHAT, "response_format": {"type": "xml"}}, 400, "response_format", "allowed: text, json_object"),
    ("chat/completions", {**CHAT, "response_format": "json"}, 400, "response_format", "expected an object"),
    ("chat/completions", {**CHAT, "response_format": {"type": "json_schema"}}, 400, "response_format", "json_schema object"),
    ("chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, 400,
     "response_format", "json_schema.schema"),
    ("completions", {"model": MODEL, "prompt": "x", "guided_json": "{not json"}, 400, "guided_json", "not valid JSON"),
    ("completions", {"model": MODEL, "prompt": "x", "guided_regex": ""}, 400, "guided_regex", "non-empty string"),
    ("completions", {"model": MODEL, "prompt": "x", "guided_choice": ["a", "b"]}, 400, "guided_choice", "guided_regex"),
    ("chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools", "not supported"),
    ("completions", {"model": MODEL, "prompt": LONG}, 400, "prompt", "max_input_len"),
    ("completions", {"model": MODEL, "prompt": "x", "logprobs": 6}, 400, "logprobs", "allowed: [0, 5]"),
    ("completions", {"model": MODEL, "prompt": "x", "logit_bias": {"50": 101}}, 400, "logit_bias", "[-100, 100]"),
    ("completions", {"model": MODEL, "prompt": "x", "logit_bias": {"hello": 1}}, 400, "logit_bias", "not a token id"),
    ("completions", {"model": MODEL, "prompt": "x", "logit_bias": {"999999": 1}}, 400, "logit_bias", "outside the vocabulary"),
    ("completions", {"model": MODEL, "prompt": ["a", "b"]}, 400, "prompt", "one prompt"),
    ("completions", {"model": "gpt-4o", "prompt": "x"}, 404, "model", "does not exist"),
]


def test_malformed_requests_are_refused_and_the_server_goes_on(stack):
    failures = []
    for route, body, status, param, words in MALFORMED:
        kw = {"data": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, bytes) else {"json": body}
        r = requests.post(f"{stack.base}/{route}", timeout=30, **kw)
        err = r.json().get("error", {}) if r.headers.get("content-type", "").startswith("application/json") else {}
        if r.status_code != status or err.get("param") != param or words not in err.get("message", ""):
            failures.append((route, str(body)[:80], r.status_code, r.text[:200]))
    assert not failures, failures
    r = stack.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": SHORT}],
                                               max_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3 and r.choices[0].message.content


def test_the_official_client_sees_openai_errors(stack):
    import openai
    client = stack.client()
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    assert e.value.code == "model_not_found" and "no-such-model" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], n=3)
    assert e.value.param == "n" and e.value.status_code == 400
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=LONG, max_tokens=1)
    assert e.value.code == "context_length_exceeded"


def test_without_a_ready_engine_health_and_requests_answer_503(serving_build):
    """A front door whose Triton is not there (not started yet, or gone): 503, and it keeps running."""
    from harness.openai.process import OpenAIServer
    with OpenAIServer(serving_build / "model_repository", f"127.0.0.1:{free_port()}", None,
                      port=free_port()) as oai:
        h = requests.get(f"http://127.0.0.1:{oai.port}/health", timeout=10)
        assert h.status_code == 503 and h.json()["error"]["code"] == "engine_unavailable"
        r = requests.post(f"{oai.base_url}/chat/completions", json=CHAT, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
        assert requests.get(f"{oai.base_url}/models", timeout=10).json()["data"][0]["id"] == MODEL
