"""Structured output (backend/engine/guided.py) on the real SmolLM2 fp32 bundle: sampled completions
under a JSON schema always validate, unconstrained ones do not; regex, EBNF and any-JSON guides; the
overlapped loop gives the synchronous loop's tokens; bad guides are refused before anything is queued."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from backend.engine.sampling_params import SamplingParams
from backend.speculative.accept import speculation_allowed
from harness.perf.grammar import PROMPTS, SCHEMAS

pytestmark = pytest.mark.slow

PER_SCHEMA = 10


def _valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def test_sampled_json_always_validates_against_its_schema(make_executor, tokenizer):
    """5 schemas x 10 completions at temperature 1 (fresh seeds each run): every one parses and
    validates; the same prompts without the guide do not always."""
    ex = make_executor(start=False, max_batch_size=128, max_kv_tokens=16384)
    names = list(SCHEMAS)
    prompts = [tokenizer.encode(PROMPTS[n]).ids for n in names for _ in range(PER_SCHEMA)]
    params = [SamplingParams(max_tokens=128, temperature=1.0, guide=("json_schema", json.dumps(SCHEMAS[n])))
              for n in names for _ in range(PER_SCHEMA)]
    results = ex.generate(prompts, params)
    for i, r in enumerate(results):
        name, text = names[i // PER_SCHEMA], tokenizer.decode(r.token_ids)
        assert r.finish_reason == "stop", (name, r.finish_reason, text)   # the grammar's end, then the end token
        assert _valid(text, SCHEMAS[name]), (name, text)
    free = ex.generate(prompts[::PER_SCHEMA // 2], SamplingParams(max_tokens=48, temperature=1.0))
    validity = [_valid(tokenizer.decode(r.token_ids), SCHEMAS[names[i // 2]]) for i, r in enumerate(free)]
    assert not all(validity), "unconstrained output validated too: the test would not see a missing mask"


def test_regex_ebnf_and_any_json(make_executor, tokenizer):
    ex = make_executor(start=False)
    prompt = tokenizer.encode("My phone number is").ids
    regex = r"\(\d{3}\) \d{3}-\d{4}"
    ebnf = 'root ::= "yes" | "no" | "maybe"'
    out = ex.generate([prompt] * 3, [SamplingParams(max_tokens=24, temperature=1.0, guide=("regex", regex)),
                                     SamplingParams(max_tokens=8, temperature=1.0, guide=("ebnf_grammar", ebnf)),
                                     SamplingParams(max_tokens=64, temperature=0.0, guide=("json", ""))])
    texts = [tokenizer.decode(r.token_ids) for r in out]
    assert re.fullmatch(regex, texts[0]), texts[0]
    assert texts[1] in ("yes", "no", "maybe"), texts[1]
    assert out[2].finish_reason == "stop" and json.loads(texts[2]) is not None, texts[2]


def test_guided_greedy_is_the_same_in_the_overlapped_loop(make_executor, tokenizer):
    prompts = [tokenizer.encode(PROMPTS[n]).ids for n in SCHEMAS] + [tokenizer.encode("Hello").ids]
    params = [SamplingParams(max_tokens=96, temperature=0.0, guide=("json_schema", json.dumps(s)))
              for s in SCHEMAS.values()] + [SamplingParams(max_tokens=12, temperature=0.0)]  # one unguided
    runs = []
    for overlap in (False, True):
        ex = make_executor(start=False, max_kv_tokens=4096, overlap_scheduling=overlap)
        runs.append([r.token_ids for r in ex.generate(prompts, params)])
    assert runs[0] == runs[1]
    for ids, s in zip(runs[0], SCHEMAS.values()):
        assert _valid(tokenizer.decode(ids), s)


def test_bad_guides_are_refused_before_anything_is_queued(make_executor, tokenizer):
    ex = make_executor(start=False)
    prompt = tokenizer.encode("Hi").ids
    for params, message in (
            (SamplingParams(guide=("json_schema", "{not json")), "sampling.guide: json_schema guide does not compile"),
            (SamplingParams(guide=("regex", "(unclosed")), "sampling.guide: regex guide does not compile"),
            (SamplingParams(guide=("yaml", "a: 1")), "sampling.guide: 'yaml': unknown kind; allowed: json, json_schema"),
            (SamplingParams(guide=("regex", "")), "needs a guide"),
            (SamplingParams(guide=("json", ""), ignore_eos=True), "cannot be combined with ignore_eos or min_tokens"),
            (SamplingParams(guide=("json", ""), min_tokens=2), "cannot be combined with ignore_eos or min_tokens")):
        with pytest.raises(ValueError, match=re.escape(message)):
            ex.submit(prompt, params)
    assert not ex.scheduler.has_unfinished() and not ex.table.guides


def test_guided_requests_may_speculate():
    # their drafts are checked against the grammar (tests/eagle/test_spec_e2e.py)
    assert speculation_allowed(SamplingParams(guide=("json", "")), 0)


def test_tree_masks_are_each_nodes_grammar_state(smollm2_bundle, tokenizer):
    """Guide.tree_masks (speculative verification): row i is the mask after node i's path, a node the
    grammar forbids leaves its subtree all-allowed, and the matcher ends where it started."""
    import torch
    from backend.engine.guided import GuideCompiler
    spec = json.loads((smollm2_bundle / "engine.json").read_text())["model"]
    comp = GuideCompiler(smollm2_bundle / "tokenizer" / "tokenizer.json", spec["eos_token_ids"], spec["vocab_size"])
    schema = ("json_schema", json.dumps(SCHEMAS["person"]))
    doc = tokenizer.encode('{"name": "Ada", "age": 3', add_special_tokens=False).ids
    bad = tokenizer.encode("hello", add_special_tokens=False).ids[0]
    g = comp.guide(*schema)
    g.accept(doc[:1])                                  # the root: the last emitted token
    # a chain along the document, with a forbidden sibling (and its child) at depth 1
    tokens = [doc[0], doc[1], bad, doc[2], doc[3], doc[3]]
    parents = [-1, 0, 0, 1, 3, 2]
    before = g.new_bitmask(1)
    g.fill(before, 0)
    got = g.tree_masks(tokens, parents)
    for node, path in ((0, doc[:1]), (1, doc[:2]), (3, doc[:3]), (4, doc[:4])):
        ref = comp.guide(*schema)
        ref.accept(path)
        want = ref.new_bitmask(1)
        ref.fill(want, 0)
        assert torch.equal(got[node], want[0]), node
    assert bool((got[2] == -1).all()) and bool((got[5] == -1).all())   # unreachable: never used
    after = g.new_bitmask(1)
    g.fill(after, 0)
    assert torch.equal(before, after)
