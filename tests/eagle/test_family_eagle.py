"""EAGLE-3 on the newer families: a draft trained by the build (ModelOpt, briefly) on Qwen3 (per-head q/k
norms, head_dim apart from hidden / heads), Gemma 3 (2 sliding : 1 full layers, (1 + w) norms, a scaled
embedding) and an all-sliding Mistral, and greedy output that is transformers' own.

Random tiny checkpoints written by transformers' classes (tests/runtime/test_family_parity.py), with the
vocabulary of SmolLM2's real tokenizer so the draft stage trains on the target's answers to real text.
A draft trained 24 steps on a random target rarely guesses right, so speculation's accepting path is
driven a second way too: an oracle drafter (the test double of tests/runtime/test_executor_speculation.py)
that proposes transformers' own continuation with a wrong token planted every other step, through
windows shorter than every sequence, so accepted drafts, rejections and KV rollback all cross them
(on Gemma 3 in the sliding layers' own KV pool, while the draft reads the full layers' blocks).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backend.engine.sampling_params import SamplingParams
from tests.eagle.conftest import eagle_overrides
from tests.runtime.hf_reference import hf_greedy
from tests.runtime.test_executor_speculation import OracleSpeculator
from tests.runtime.test_family_parity import _checkpoint, _hf_model

pytestmark = pytest.mark.slow

VOCAB = 49152                       # SmolLM2's tokenizer, which the draft stage's prompts go through
NEW_TOKENS = 24
PROMPT_LENS = (5, 23, 41)           # the families' window is 16: every sequence outgrows it
FAMILIES = ("qwen3", "gemma3", "mistral_window")
ENGINE = dict(max_kv_tokens=2048, max_batch_size=4)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory, smollm2_hf_dir):
    """(name, HF model, bundle with its EAGLE-3 draft, transformers' greedy tokens per prompt, prompts)"""
    from builder.config import BuildConfig
    from builder.pipeline import run_pipeline

    name = request.param
    root = tmp_path_factory.mktemp(f"eagle-{name}")
    src = _checkpoint(name, root / "src", Path(smollm2_hf_dir), vocab_size=VOCAB)
    cfg = BuildConfig.from_dict({}, f"{name}.yaml", [
        f"model.source={src}", "model.dtype=float32", "quantization.format=none", "quantization.kv_cache=none",
        "engine.max_seq_len=256", "engine.max_input_len=128", "engine.max_kv_tokens=2048",
        # small steps: Gemma 3's sliding layers then get a KV pool of their own (backend/engine/kv_groups.py)
        "engine.max_num_tokens=64",
        "speculative.method=eagle3", *eagle_overrides(verify=False)])
    result = run_pipeline(cfg, root / "out", until="compile", log=lambda m: None)
    assert result.results["draft"].status == "built"
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]
    model = _hf_model(src)
    ref = [hf_greedy(model, p, NEW_TOKENS) for p in prompts]
    return name, result.bundle, ref, prompts


def _executor(bundle, speculative: bool):
    from backend.engine.executor import Executor
    return Executor(bundle, dtype="float32", start=False, speculative=speculative, verify_hashes=False, **ENGINE)


PARAMS = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def test_the_built_draft_speculates_and_the_tokens_are_transformers(family):
    name, bundle, ref, prompts = family
    ex = _executor(bundle, speculative=True)
    try:
        assert ex.speculator is not None, f"{name}: the bundle's EAGLE-3 draft was not attached"
        got = [r.token_ids for r in ex.generate(prompts, PARAMS)]
        stats = ex.speculator.stats.as_dict()
    finally:
        ex.shutdown()
    assert got == ref
    assert stats["spec_verify_steps"] > 0 and stats["draft_tokens_proposed"] > 0
    assert (ex.runner.window_kv is not None) == (name == "gemma3")


def test_accepted_drafts_across_windows_keep_the_tokens(family):
    name, bundle, ref, prompts = family
    ex = _executor(bundle, speculative=False)
    oracle = OracleSpeculator({f"r{i}": toks for i, toks in enumerate(ref)})
    oracle.capture_hidden_layers = (1,)            # the tiny models' second layer
    ex.speculator = oracle
    try:
        handles = [ex.submit(p, PARAMS, request_id=f"r{i}") for i, p in enumerate(prompts)]
        while not all(h.finished for h in handles):
            ex.step()
        got = [h.result().token_ids for h in handles]
        s = ex.stats()
    finally:
        ex.shutdown()
    assert got == ref, name
    assert 0 < s["accepted_draft_tokens"] < s["draft_tokens"]     # accepted and rejected drafts both
    assert s["kv_blocks_used"] == 0
