"""Shared fixtures of the runtime-model tests: ONE converted SmolLM2 checkpoint, one fp32 bundle and
one copy of its weights per test session (executors built from it share the tensors)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / "build" / "test-cache"


def _helper():
    spec = importlib.util.spec_from_file_location("rt_bundle", Path(__file__).with_name("rt_bundle.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def rt_bundle_helper():
    return _helper()


@pytest.fixture(scope="session")
def smollm2_hf(request, rt_bundle_helper) -> Path:
    """SmolLM2 as an HF checkpoint dir: the builder's fixture when present, else our own conversion."""
    try:
        return Path(request.getfixturevalue("smollm2_hf_dir"))
    except pytest.FixtureLookupError:
        return rt_bundle_helper.hf_checkpoint(CACHE)


@pytest.fixture(scope="session")
def bundle_fp32(smollm2_hf, rt_bundle_helper) -> Path:
    # fp32: bf16 matmuls accumulate in a different order in HF and here, and greedy decoding of a
    # 135M model hits near-ties often enough that token identity would be luck, not correctness.
    return rt_bundle_helper.write_bundle(smollm2_hf, CACHE / "rt-bundle-fp32", "float32", max_kv_tokens=8192)


@pytest.fixture(scope="session")
def weights_fp32(bundle_fp32):
    from backend.runner import load_weights
    return load_weights(bundle_fp32, torch.device("cpu"))


@pytest.fixture(scope="session")
def make_executor(bundle_fp32, weights_fp32):
    """``make_executor(**engine_overrides)`` -> a started Executor on the shared fp32 weights."""
    from backend.executor import Executor
    made = []

    def make(start: bool = True, **overrides):
        ex = Executor(bundle_fp32, weights=weights_fp32, start=start, verify_hashes=False, **overrides)
        made.append(ex)
        return ex

    yield make
    for ex in made:
        ex.shutdown()


@pytest.fixture(scope="session")
def tokenizer(bundle_fp32):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(bundle_fp32 / "tokenizer" / "tokenizer.json"))


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
