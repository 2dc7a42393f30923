"""backend/model/decoder_parts.py: the spec fields the runtime refuses at load, and Qwen3's per-head q/k
RMSNorm against transformers' own module."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from backend.arch_spec import ArchSpec
from backend.model import decoder_parts

QWEN3 = ArchSpec(("full", "full"), qk_norm=True)


def test_the_llama_layer_and_qwen3_on_the_torch_path_load():
    decoder_parts.check_spec(None)
    decoder_parts.check_spec(ArchSpec(("full",)))
    decoder_parts.check_spec(QWEN3)


def test_qk_norm_runs_on_the_fused_path():
    # the rope + KV-write kernel applies Qwen3's q/k norms (tests/runtime/test_fused_families.py)
    decoder_parts.check_spec(QWEN3)


SPEC_LAYER_FIELDS = [("norm", "rms_one_plus"), ("norm_placement", "pre_post"), ("activation", "gelu_tanh"),
                     ("embedding_scale", "sqrt_hidden"), ("query_pre_attn_scalar", 256.0)]


@pytest.mark.parametrize("field", ["qkv", "gate_up"])
def test_fused_checkpoint_layouts_run_on_both_paths(field):
    """``qkv`` / ``gate_up`` say how the checkpoint stores them; the bundle always holds them fused."""
    spec = dataclasses.replace(ArchSpec(("full",)), **{field: "fused"})
    decoder_parts.check_spec(spec)


@pytest.mark.parametrize("field, value", SPEC_LAYER_FIELDS)
def test_the_spec_layer_fields_run_on_both_paths(field, value):
    # the fused layer computes Gemma 3's (tests/runtime/test_fused_families.py)
    spec = dataclasses.replace(ArchSpec(("full",)), **{field: value})
    decoder_parts.check_spec(spec)


def test_a_field_no_path_computes_is_refused_in_one_line():
    # a value the spec may take one day (arch_spec.py validates against today's values, so set it past
    # that): the runtime refuses it at load instead of running the Llama layer
    spec = ArchSpec(("full",))
    object.__setattr__(spec, "mlp", "dense")
    with pytest.raises(ValueError) as exc:
        decoder_parts.check_spec(spec)
    assert str(exc.value) == "engine.json: model.arch.mlp: 'dense' is not run by this runtime yet; allowed: 'gated'"


def test_qk_norm_equals_transformers_qwen3_rmsnorm():
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    torch.manual_seed(0)
    heads, kv_heads, d, eps = 6, 2, 32, 1e-6
    q_mod, k_mod = Qwen3RMSNorm(d, eps), Qwen3RMSNorm(d, eps)
    with torch.no_grad():
        q_mod.weight.copy_(torch.randn(d)), k_mod.weight.copy_(torch.randn(d))
    qk = torch.randn(5, heads + kv_heads, d) * 3
    got = decoder_parts.qk_norm(qk, q_mod.weight.detach(), k_mod.weight.detach(), heads, eps)
    with torch.no_grad():
        want = torch.cat([q_mod(qk[:, :heads]), k_mod(qk[:, heads:])], dim=1)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_layer_qk_norms_are_a_pair_and_agree_with_the_spec():
    w = torch.ones(8)
    got = decoder_parts.layer_qk_norms({"layers.0.q_norm.weight": w, "layers.0.k_norm.weight": w}, "layers.0",
                                       torch.float32, torch.device("cpu"))
    assert set(got) == {"q_norm", "k_norm"} and all(v is not None for v in got.values())
    assert decoder_parts.layer_qk_norms({}, "layers.0", torch.float32, torch.device("cpu")) == \
        {"q_norm": None, "k_norm": None}
    with pytest.raises(KeyError, match="missing tensor 'layers.0.k_norm.weight'"):
        decoder_parts.layer_qk_norms({"layers.0.q_norm.weight": w}, "layers.0", torch.float32, torch.device("cpu"))

    class Layer:
        q_norm = None
    with pytest.raises(KeyError, match="'layers.0.q_norm.weight' missing"):
        decoder_parts.check_qk_norms(QWEN3, [Layer()])
    decoder_parts.check_qk_norms(ArchSpec(("full",)), [Layer()])
    Layer.q_norm = w
    with pytest.raises(KeyError, match="present, but model.arch.qk_norm is not true"):
        decoder_parts.check_qk_norms(None, [Layer()])
