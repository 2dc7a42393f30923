"""Shared fixtures of the runtime-model tests: ONE converted SmolLM2 checkpoint, one fp32 bundle and
one copy of its weights per test session (executors built from it share the tensors)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch



@pytest.fixture(scope="session")
def smollm2_hf(smollm2_hf_dir) -> Path:
    """SmolLM2 as an HF checkpoint dir (the builder's import stage, shared with the other tests)."""
    return Path(smollm2_hf_dir)


@pytest.fixture(scope="session")
def smollm2_bundle(build_bundle) -> Path:
    """The real bf16 SmolLM2 engine bundle from the build pipeline (shared with the other
    tests, built once per session)."""
    # verify off: the verify stage has its own tests; this shares the builder tests' bundle
    return Path(build_bundle("smollm2-135m-bf16", ["verify.enabled=false"]))


@pytest.fixture(scope="session")
def weights_fp32(smollm2_bundle):
    """The bundle's weights upcast ONCE to fp32 (exact) and shared by every executor below.

    fp32 compute: bf16 matmuls accumulate in a different order in HF and here, and greedy decoding
    of a 135M model hits near-ties often enough that token identity would be luck, not correctness."""
    from backend.runtime.native import load_weights
    w = load_weights(smollm2_bundle, torch.device("cpu"))
    return {k: v.float() if v.is_floating_point() and v.element_size() == 2 else v for k, v in w.items()}


ENGINE_DEFAULTS = {"max_kv_tokens": 8192, "max_batch_size": 64}


@pytest.fixture
def make_executor(smollm2_bundle, weights_fp32):
    """``make_executor(**engine_overrides)`` -> a started fp32 Executor on the shared weights.

    Per test: each executor holds a KV pool of hundreds of MB (8192 tokens of fp32 KV), so they are
    shut down and dropped when their test ends (session-wide, the suite outgrew a 24 GB machine)."""
    from backend.engine.executor import Executor
    made = []

    def make(start: bool = True, **overrides):
        ex = Executor(smollm2_bundle, dtype=torch.float32, weights=weights_fp32, start=start,
                      verify_hashes=False, **{**ENGINE_DEFAULTS, **overrides})
        made.append(ex)
        return ex

    yield make
    for ex in made:
        ex.shutdown()
    made.clear()


@pytest.fixture(scope="session")
def tokenizer(smollm2_bundle):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(smollm2_bundle / "tokenizer" / "tokenizer.json"))


@pytest.fixture(scope="session")
def hf_model_fp32(smollm2_hf):
    from transformers import LlamaForCausalLM
    return LlamaForCausalLM.from_pretrained(smollm2_hf, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def varied_prompts(smollm2_hf, tokenizer) -> list[list[int]]:
    """16 prompts: short, long, code, chat-templated, non-English (token ids, BOS-free like HF's)."""
    from transformers import AutoTokenizer
    hf_tok = AutoTokenizer.from_pretrained(smollm2_hf)
    texts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time",
        "Hi",
        "La capitale de l'Allemagne est",
        "Der schnellste Weg nach Berlin ist",
        "東京は日本の首都で、",
        "Москва — столица",
        "List three prime numbers:",
        "import numpy as np\nx = np.arange(10)\n",
        ("Photosynthesis is the process by which green plants and some other organisms use sunlight "
         "to synthesize foods from carbon dioxide and water. " * 6) + "In summary,",
        "Q: What is 12 + 30?\nA:",
    ]
    ids = [tokenizer.encode(t).ids for t in texts]
    chats = [
        [{"role": "user", "content": "What is the tallest mountain in the world?"}],
        [{"role": "user", "content": "Write a haiku about autumn."}],
        [{"role": "system", "content": "You answer in French."},
         {"role": "user", "content": "How are you today?"}],
        [{"role": "user", "content": "Explain what a hash table is in two sentences."}],
    ]
    for c in chats:
        out = hf_tok.apply_chat_template(c, tokenize=True, add_generation_prompt=True)
        if not isinstance(out, list):  # transformers 5 returns a BatchEncoding
            out = out["input_ids"]
        ids.append(list(out))
    return ids
