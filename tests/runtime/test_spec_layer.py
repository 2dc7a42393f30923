"""The spec layer's parts (backend/model/spec_layer.py) against transformers' Gemma 3 modules, bit for bit in
bf16, and what the plan reads from a spec."""
from __future__ import annotations

import pytest
import torch

from backend.arch_spec import ArchSpec, Attention, Rope
from backend.model import spec_layer

GEMMA_LIKE = ArchSpec(("sliding", "full", "sliding"),
                      (Attention("sliding", Rope(theta=1e4), 8), Attention("full", Rope(theta=1e6))),
                      norm="rms_one_plus", norm_placement="pre_post", activation="gelu_tanh", qk_norm=True,
                      embedding_scale="sqrt_hidden", query_pre_attn_scalar=24.0)


class _Config:
    num_layers, hidden_size, head_dim, max_position_embeddings = 3, 64, 32, 64
    sliding_window, rope_theta, rope_scaling = None, 1e4, None


def test_one_plus_norm_is_transformers_gemma3_rmsnorm_in_bf16():
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    torch.manual_seed(0)
    ref = Gemma3RMSNorm(64, eps=1e-6)
    with torch.no_grad():
        ref.weight.normal_()
    ref = ref.to(torch.bfloat16)
    x = torch.randn(5, 64).to(torch.bfloat16)
    got = spec_layer.norm(x, spec_layer.one_plus_weight(ref.weight.detach()), 1e-6, one_plus=True)
    assert got.dtype == torch.bfloat16 and torch.equal(got, ref(x))


def test_the_embedding_scale_rounds_to_the_model_dtype_first_as_transformers():
    from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding

    torch.manual_seed(0)
    emb = Gemma3TextScaledWordEmbedding(10, 640, 0, embed_scale=640 ** 0.5).to(torch.bfloat16)
    ids = torch.arange(10)
    plan = spec_layer.plan_of(GEMMA_LIKE, type("C", (_Config,), {"hidden_size": 640})())
    rows = torch.nn.functional.embedding(ids, emb.weight.detach())
    ours = rows * torch.tensor(plan.embedding_scale, dtype=rows.dtype)
    assert torch.equal(ours, emb(ids))


def test_the_plan_reads_windows_ropes_and_the_query_scalar_per_layer():
    plan = spec_layer.plan_of(GEMMA_LIKE, _Config())
    assert plan.windows == (8, None, 8) and plan.rope_of == ("sliding", "full", "sliding")
    assert plan.scale == 24.0 ** -0.5 and plan.one_plus and plan.post_norms and not plan.plain
    ropes = spec_layer.rope_tables(GEMMA_LIKE, _Config(), "cpu")
    assert set(ropes) == {"sliding", "full"}
    assert not torch.allclose(ropes["sliding"].cos, ropes["full"].cos)   # two bases, two tables
    # a bundle from before the spec: the Llama layer, model.sliding_window on every layer
    old = spec_layer.plan_of(None, type("C", (_Config,), {"sliding_window": 16})())
    assert old.plain and old.windows == (16, 16, 16) and old.scale == 32 ** -0.5


def test_every_kind_gets_its_rope_and_a_partial_rotary_one_is_refused_in_one_line():
    """Each attention kind's table rotates with its own rope, every variant the runtime computes
    (yarn here); a rope the tables cannot apply (a partial rotary factor) is refused naming the field."""
    from backend.model.decoder_parts import rope_of

    yarn = Rope(type="yarn", theta=1e4, factor=4.0, original_max_position_embeddings=32)
    theta, scaling = rope_of(yarn, "model.arch.attention.full.rope")
    assert theta == 1e4 and scaling["type"] == "yarn" and scaling["factor"] == 4.0
    with pytest.raises(ValueError) as exc:
        rope_of(Rope(theta=1e4, partial_rotary_factor=0.5), "model.arch.attention.full.rope")
    assert str(exc.value) == ("engine.json: model.arch.attention.full.rope.partial_rotary_factor: 0.5 is not run "
                              "by this runtime yet; allowed: 1.0")
