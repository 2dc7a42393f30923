"""backend/arch_spec.py: the architecture spec is checked at construction, every bad value refused in one
line naming the field and the allowed values, and it round-trips through JSON unchanged."""
from __future__ import annotations

import json

import pytest

from backend.arch_spec import ROPE_PARAMETERS, ArchSpec, ArchSpecError, Attention, Rope

GEMMA3 = ArchSpec(
    layer_types=("sliding",) * 5 + ("full",),
    attention=(Attention("sliding", Rope(theta=10000.0), window=512), Attention("full", Rope(theta=1e6))),
    norm="rms_one_plus", norm_placement="pre_post", activation="gelu_tanh", qk_norm=True,
    tie_word_embeddings=True, embedding_scale="sqrt_hidden", query_pre_attn_scalar=256)

# one rope of each variant with every parameter it may take
ROPES = {
    "default": Rope(theta=500000.0),
    "linear": Rope(type="linear", factor=4.0),
    "dynamic": Rope(type="dynamic", factor=2.0, original_max_position_embeddings=4096),
    "llama3": Rope(type="llama3", theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192),
    "yarn": Rope(type="yarn", theta=1e6, factor=4.0, original_max_position_embeddings=32768, attention_factor=1.1,
                 beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0, truncate=False),
    "longrope": Rope(type="longrope", factor=32.0, short_factor=(1.0, 1.1), long_factor=(2.0, 3.5),
                     original_max_position_embeddings=4096, attention_factor=1.19, partial_rotary_factor=0.75),
}


def roundtrip(spec: ArchSpec) -> ArchSpec:
    return ArchSpec.from_dict(json.loads(json.dumps(spec.to_dict())))


def test_a_spec_round_trips_through_json_and_answers_per_layer():
    assert roundtrip(GEMMA3) == GEMMA3
    assert GEMMA3.num_layers == 6 and GEMMA3.layer(0).window == 512 and GEMMA3.layer(5).window is None
    assert (GEMMA3.layer(0).rope.theta, GEMMA3.layer(5).rope.theta) == (10000.0, 1e6)
    assert GEMMA3.query_scale(head_dim=64) == 256 ** -0.5 and ArchSpec(("full",)).query_scale(64) == 0.125
    d = GEMMA3.to_dict()
    assert list(d["attention"]) == ["sliding", "full"] and d["attention"]["full"] == {
        "rope": {"type": "default", "theta": 1e6, "partial_rotary_factor": 1.0}}


@pytest.mark.parametrize("kind", sorted(ROPE_PARAMETERS))
def test_each_rope_variant_round_trips(kind):
    rope = ROPES[kind]
    assert rope.type == kind
    spec = ArchSpec(("full", "full"), attention=(Attention("full", rope),))
    assert roundtrip(spec) == spec and roundtrip(spec).layer(1).rope == rope
    needed, optional = ROPE_PARAMETERS[kind]
    assert set(rope.to_dict()) == {"type", "theta", "partial_rotary_factor", *needed, *optional}


@pytest.mark.parametrize("doc, message", [
    ({"layer_types": ["full"], "norm": "layer"}, "arch.norm: 'layer' is not supported; allowed: rms | rms_one_plus"),
    ({"layer_types": ["full"], "activation": "relu"}, "arch.activation: 'relu' is not supported; allowed: silu | "
                                                      "gelu_tanh"),
    ({"layer_types": ["full"], "qk_norm": 1}, "arch.qk_norm: 1 is not a boolean; allowed: true | false"),
    ({"layer_types": ["full"], "moe": True}, "arch.moe: unknown field; allowed: layer_types, attention,"),
    ({"layer_types": []}, "arch.layer_types: (); allowed: a non-empty list, one per layer"),
    ({"layer_types": ["full", "local"]}, "arch.layer_types[1]: 'local' is not supported; allowed: full"),
    ({"layer_types": ["full"], "attention": {"full": {}, "sliding": {"window": 4}}},
     "arch.attention.sliding: no layer uses it; allowed: full"),
    ({"layer_types": ["sliding"], "attention": {"sliding": {}}},
     "arch.attention.sliding.window: None is not a positive integer"),
    ({"layer_types": ["full"], "attention": {"full": {"window": 8}}},
     "arch.attention.full.window: 8 on a full attention; allowed: null (no window)"),
    ({"layer_types": ["full"], "attention": {"full": {"rope": {"type": "ntk"}}}},
     "arch.attention.full.rope.type: 'ntk' is not supported; allowed: default | linear | dynamic | llama3 | yarn"),
    ({"layer_types": ["full"], "attention": {"full": {"rope": {"type": "yarn", "factor": 4.0}}}},
     "arch.attention.full.rope.original_max_position_embeddings: missing; a yarn rope needs it"),
    ({"layer_types": ["full"], "attention": {"full": {"rope": {"factor": 4.0}}}},
     "arch.attention.full.rope.factor: 4.0 is not a parameter of a default rope; allowed: none"),
    ({"layer_types": ["full"], "attention": {"full": {"rope": {"theta": -1}}}},
     "arch.attention.full.rope.theta: -1 is not a positive number"),
    ({"layer_types": ["full"], "attention": {"full": {"rope": {"partial_rotary_factor": 1.5}}}},
     "arch.attention.full.rope.partial_rotary_factor: 1.5; allowed: a number in (0, 1]"),
    ({"layer_types": ["full"], "attention": {"full": {"rope": {
        "type": "longrope", "factor": 2.0, "original_max_position_embeddings": 4096, "short_factor": [1.0],
        "long_factor": [1.0, 2.0]}}}}, "arch.attention.full.rope.long_factor: 2 values but short_factor has 1"),
    ({"layer_types": ["full"], "attention": {"full": {"rope": {
        "type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
        "original_max_position_embeddings": 8192}}}}, "arch.attention.full.rope.low_freq_factor: 4.0 is not below"),
    ("llama", "arch: 'llama'; allowed: an object with layer_types,"),
])
def test_a_bad_value_is_refused_in_one_line_naming_the_field(doc, message):
    with pytest.raises(ArchSpecError) as exc:
        ArchSpec.from_dict(doc)
    text = str(exc.value)
    assert "\n" not in text and text.startswith(message), text


def test_direct_construction_is_checked_too():
    with pytest.raises(ArchSpecError, match=r"^arch.attention: kinds \['full', 'full'\] repeat"):
        ArchSpec(("full",), attention=(Attention("full"), Attention("full")))
    with pytest.raises(ArchSpecError, match=r"^factor: missing; a linear rope needs it"):
        Rope(type="linear")
    with pytest.raises(ArchSpecError, match=r"^arch.layer_types: \['full'\]"):
        ArchSpec(["full"])   # a list would make the frozen spec unhashable
    assert hash(GEMMA3) == hash(roundtrip(GEMMA3))


MODEL = {"architecture": "llama", "hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 4,
         "num_kv_heads": 2, "head_dim": 16, "vocab_size": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
         "max_position_embeddings": 512}


def manifest_doc(model: dict) -> dict:
    return {"format": "kiln-engine", "format_version": 1, "model": model, "quantization": {"format": "none"},
            "engine": {}, "files": {}}


def test_engine_json_holds_the_spec_as_model_arch():
    from backend import bundle
    spec = ArchSpec(("full", "full"), tie_word_embeddings=True)
    m = bundle.Manifest.from_dict(manifest_doc({**MODEL, "arch": spec.to_dict()}))
    assert m.model.arch_spec == spec and m.model.num_layers == 2
    written = bundle.as_dict(m)["model"]
    assert list(written)[-1] == "arch" and written["arch"] == spec.to_dict()
    assert bundle.Manifest.from_dict(json.loads(json.dumps(bundle.as_dict(m)))) == m
    old = bundle.Manifest.from_dict(manifest_doc(MODEL))   # bundles built before the spec: no arch key
    assert old.model.arch_spec is None and "arch" not in bundle.as_dict(old)["model"]


def test_a_bad_spec_in_engine_json_is_refused_naming_the_field():
    from backend import bundle
    bad = dict(ArchSpec(("full",)).to_dict(), norm="layer")
    with pytest.raises(bundle.BundleError) as exc:
        bundle.Manifest.from_dict(manifest_doc({**MODEL, "arch": bad}))
    assert str(exc.value).startswith("engine.json: model.arch.norm: 'layer' is not supported; allowed: rms | "
                                     "rms_one_plus; rebuild with: make build"), str(exc.value)
