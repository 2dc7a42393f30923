"""backend/model/layers.py's rope variants equal transformers' ROPE_INIT_FUNCTIONS (inverse frequencies and the
cos/sin attention factor), each reached as the runtime reaches it: config.json -> the family's architecture spec
(builder/families) -> ``decoder_parts.rope_args`` -> ``ROPE_TYPES``."""
from __future__ import annotations

import json

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from backend.model import decoder_parts
from backend.model.layers import ROPE_TYPES, RotaryEmbedding, rope_attention_factor, rope_type
from builder import families

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, max_position_embeddings=4096)
HEAD_DIM = 16
CASES = {
    "default": ("LlamaConfig", {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}),
    "linear": ("LlamaConfig", {"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}}),
    "llama3": ("LlamaConfig", {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 512,
                                                   "rope_theta": 500000.0}}),
    "dynamic": ("LlamaConfig", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}}),
    "yarn": ("Qwen3Config", {"head_dim": HEAD_DIM, "rope_parameters": {
        "rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6, "original_max_position_embeddings": 1024}}),
    "yarn_untruncated_betas": ("Qwen3Config", {"head_dim": HEAD_DIM, "rope_parameters": {
        "rope_type": "yarn", "factor": 8.0, "rope_theta": 10000.0, "original_max_position_embeddings": 512,
        "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False}}),
    "yarn_mscale": ("LlamaConfig", {"rope_parameters": {
        "rope_type": "yarn", "factor": 40.0, "rope_theta": 10000.0, "original_max_position_embeddings": 100,
        "mscale": 1.0, "mscale_all_dim": 0.707}}),
    "yarn_attention_factor": ("LlamaConfig", {"rope_parameters": {
        "rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "original_max_position_embeddings": 1024,
        "attention_factor": 1.3}}),
    "longrope": ("Phi3Config", {"pad_token_id": 0, "original_max_position_embeddings": 512, "rope_parameters": {
        "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + i / 8 for i in range(8)],
        "long_factor": [1.5 + i for i in range(8)]}}),
}


def _both(name: str, tmp_path):
    """(transformers' config, the runtime's theta and scaling) for one case."""
    cls, change = CASES[name]
    hf_config = getattr(transformers, cls)(**{**TINY, **change})
    hf_config.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    _, spec = families.read_spec(json.loads(path.read_text()), path)
    return hf_config, decoder_parts.rope_args(None, spec)


@pytest.mark.parametrize("name", sorted(CASES))
def test_inverse_frequencies_and_attention_factor_equal_transformers(name, tmp_path):
    hf_config, (theta, scaling) = _both(name, tmp_path)
    kind = rope_type(scaling)
    assert kind == name.split("_")[0]
    # transformers keeps the default rope on each model's rotary class, not in the table
    init = ROPE_INIT_FUNCTIONS.get(kind) or transformers.models.llama.modeling_llama.LlamaRotaryEmbedding \
        .compute_default_rope_parameters
    want, want_factor = init(hf_config, "cpu")
    got = ROPE_TYPES[kind](HEAD_DIM, theta, scaling)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert rope_attention_factor(scaling) == pytest.approx(want_factor, rel=1e-12)


def test_longrope_switches_to_the_long_factors_past_the_pretraining_length(tmp_path):
    """transformers' long frequencies (what it uses once a sequence passes 512 positions) are the ones the
    runtime's table rotates positions 512 and on with; the positions before keep the short ones."""
    hf_config, (theta, scaling) = _both("longrope", tmp_path)
    long, factor = ROPE_INIT_FUNCTIONS["longrope"](hf_config, "cpu", seq_len=513)
    short, _ = ROPE_INIT_FUNCTIONS["longrope"](hf_config, "cpu")
    assert not torch.equal(long, short)
    rope = RotaryEmbedding(HEAD_DIM, 1024, theta, scaling)
    for pos, inv_freq in ((511, short), (512, long), (1000, long)):
        angles = torch.cat([pos * inv_freq] * 2)
        torch.testing.assert_close(rope.cos[pos], angles.cos() * factor, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(rope.sin[pos], angles.sin() * factor, rtol=1e-5, atol=1e-6)


def test_dynamic_is_the_default_rope_within_max_position_embeddings(tmp_path):
    """transformers recomputes a dynamic rope only past max_position_embeddings, where no bundle runs."""
    _, (theta, scaling) = _both("dynamic", tmp_path)
    torch.testing.assert_close(ROPE_TYPES["dynamic"](HEAD_DIM, theta, scaling), ROPE_TYPES["default"](HEAD_DIM, theta, None))


def test_a_partial_rotary_factor_is_refused_in_one_line(tmp_path):
    transformers.LlamaConfig(**TINY, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                      "partial_rotary_factor": 0.5}).save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    _, spec = families.read_spec(json.loads(path.read_text()), path)
    with pytest.raises(ValueError) as exc:
        decoder_parts.rope_args(None, spec)
    assert str(exc.value) == ("engine.json: model.arch.attention.full.rope.partial_rotary_factor: 0.5 is not run by "
                              "this runtime yet; allowed: 1.0")
