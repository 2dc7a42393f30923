"""The real Gemma 3 270M (Q4_K / Q5_0 / Q6_K / Q8_0 / F32 GGUF) through Kiln's importer: transformers'
Gemma3ForCausalLM runs the imported folder and continues "<bos>The capital of France is" as the
model does under llama.cpp, and every tensor equals what transformers' own GGUF loader makes.

The import (~40 s) is cached in build/test-cache/ under a key of the file's hash and the importer's
source, so it runs once per change; parallel workers race to a rename, not to half-written files.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from builder import gguf_dequant, gguf_import, gguf_tokenizer
from builder.gguf_models import GEMMA3_270M_SHA256, gemma3_270m_gguf
from tests.conftest import CACHE

PROMPT_IDS = [2, 818, 5279, 529, 7001, 563]   # "<bos>The capital of France is", as Gemma 3 was trained
DTYPE = torch.bfloat16

pytestmark = pytest.mark.slow


def _import_key() -> str:
    h = hashlib.sha256(f"{GEMMA3_270M_SHA256} {DTYPE}".encode())
    for mod in (gguf_import, gguf_dequant, gguf_tokenizer):
        h.update(Path(mod.__file__).read_bytes())
    return h.hexdigest()[:16]


@pytest.fixture(scope="module")
def gemma_hf_dir() -> Path:
    target = CACHE / f"gemma3-270m-import-{_import_key()}"
    if target.is_dir():
        return target
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=CACHE, prefix=".gemma3-270m-import-"))
    try:
        gguf_import.convert(gemma3_270m_gguf(), "gemma3", tmp, DTYPE)
        try:
            os.rename(tmp, target)
        except OSError:   # another worker finished first: its folder is the same import
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def test_greedy_continuation(gemma_hf_dir):
    from tokenizers import Tokenizer
    from transformers import Gemma3ForCausalLM

    tok = Tokenizer.from_file(str(gemma_hf_dir / "tokenizer.json"))
    assert tok.encode("The capital of France is").ids == PROMPT_IDS
    model = Gemma3ForCausalLM.from_pretrained(gemma_hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT_IDS]), max_new_tokens=10, do_sample=False)
    text = tok.decode(out[0, len(PROMPT_IDS):].tolist())
    assert text.startswith(" the capital of the country of France"), text


def test_tensors_equal_transformers_gguf_loader(gemma_hf_dir):
    """transformers' GGUF loader (the function from_pretrained(gguf_file=...) calls; that entry point
    adds only accelerate's weight placement) converts this file's weights correctly: compared in the
    imported dtype, every tensor is identical, and the architecture numbers agree."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, Gemma3ForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    cfg = AutoConfig.from_pretrained(gemma_hf_dir)
    with torch.device("meta"):   # the loader maps names by walking a model; ours has the same modules
        skeleton = Gemma3ForCausalLM(cfg)
    ref = load_gguf_checkpoint(str(gemma3_270m_gguf()), return_tensors=True, model_to_load=skeleton,
                               torch_dtype=torch.float32)   # one parse of the file: config and tensors
    ref_cfg = AutoConfig.for_model(**ref["config"])
    ref = ref["tensors"]
    ours = load_file(gemma_hf_dir / "model.safetensors")
    assert sorted(ours) == sorted(ref) and len(ours) == 18 * 13 + 2
    for name, t in ref.items():
        assert torch.equal(ours[name], t.to(DTYPE)), name
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "sliding_window", "rms_norm_eps", "layer_types",
                "rope_parameters", "query_pre_attn_scalar", "tie_word_embeddings", "hidden_activation",
                "max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(cfg, key) == getattr(ref_cfg, key), key


def test_the_named_source_resolves_to_the_assembled_gguf():
    """``model.source: gemma3-270m`` (configs/gemma3-270m-*.yaml) is the file assembled from the chunk wheels."""
    from builder import sources

    src = sources.resolve("gemma3-270m", "configs/gemma3-270m-bf16.yaml")
    assert (src.kind, src.path, src.architecture) == ("gguf", gemma3_270m_gguf(), "gemma3")
    assert src.files() == [gemma3_270m_gguf()]
