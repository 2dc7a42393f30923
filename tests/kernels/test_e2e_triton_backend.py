"""End to end: the real SmolLM2 (fp32 bundle) generates the same greedy tokens with the "triton"
attention backend (our kernels, in the interpreter here) as with the "torch" reference backend,
over a batch that mixes prefill and decode steps."""
import importlib.util
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / "build" / "test-cache"
# two prompts of different lengths, three tokens: one mixed prefill step, then decode steps (the
# interpreter runs 30 layers of kernels per step, so this is kept small on purpose)
PROMPTS = ["The capital of France is", "Hi"]
MAX_TOKENS = 3


def _rt_bundle():
    # the runtime area's helper that writes a bundle straight from the HF weights (seconds, cached)
    spec = importlib.util.spec_from_file_location("rt_bundle", REPO / "tests" / "runtime" / "rt_bundle.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_greedy_tokens_equal_torch_backend(device):
    from tokenizers import Tokenizer

    from backend.executor import Executor
    from backend.runner import load_weights
    from backend.sampling_params import SamplingParams

    rt = _rt_bundle()
    bundle = rt.write_bundle(rt.hf_checkpoint(CACHE), CACHE / "rt-bundle-fp32", "float32", max_kv_tokens=8192)
    tok = Tokenizer.from_file(str(bundle / "tokenizer" / "tokenizer.json"))
    prompts = [tok.encode(p).ids for p in PROMPTS]
    weights = load_weights(bundle, torch.device(device))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    results = {}
    for name in ("torch", "triton"):
        ex = Executor(bundle, device=device, weights=weights, start=False, attention_backend=name,
                      max_batch_size=4, kv_block_size=16, max_kv_tokens=1024)
        try:
            assert ex.runner.attention.name == name
            results[name] = [r.token_ids for r in ex.generate(prompts, params)]
        finally:
            ex.shutdown()
    assert all(len(t) == MAX_TOKENS for t in results["torch"])
    assert results["triton"] == results["torch"]
