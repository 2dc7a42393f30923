"""Mixture-of-experts checkpoints (Mixtral, Qwen3-MoE, Qwen2-MoE): the config.json transformers' own config class writes
maps to the spec's ``Experts`` (count, top-k, renormalisation, which layers are sparse, expert width, a shared
expert and its gate); what
cannot be mapped, and what the build has no expert path for yet, is refused in one line naming the key; the
packed expert tensors are the checkpoint's, in every layout checkpoints store them."""
from __future__ import annotations

import json

import pytest
import torch

from backend.arch_spec import ArchSpec, ArchSpecError, Experts
from builder import families
from builder.config import BuildConfig
from builder.config_model import check_against_model
from builder.expert_weights import expert_tensors, shared_expert_tensors
from builder.schema import ConfigError
from builder.stages.base import StageError
from tests.builder.test_families import saved


def spec_of(tmp_path, cls, **kw) -> ArchSpec:
    hf, path = saved(tmp_path, cls, **kw)
    _, spec = families.read_spec(hf, path)
    assert ArchSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec   # engine.json round trip
    return spec


def test_mixtral_routes_top_k_renormalised_on_every_layer(tmp_path):
    spec = spec_of(tmp_path, "MixtralConfig", num_local_experts=4, num_experts_per_tok=2)
    assert spec.experts == Experts(num_experts=4, top_k=2, intermediate_size=96, layers=(0, 1), renormalize=True)
    assert [a.kind for a in spec.attention] == ["full"]    # MixtralConfig: no window unless sliding_window


@pytest.mark.parametrize("kw, layers, renorm", [
    ({"mlp_only_layers": [0]}, (1, 2), False),
    ({"decoder_sparse_step": 2, "norm_topk_prob": True}, (1,), True),
    ({"decoder_sparse_step": 2, "mlp_only_layers": [1]}, None, False),    # no sparse layer left
])
def test_qwen3_moe_sparse_layers_follow_step_and_mlp_only_layers(tmp_path, kw, layers, renorm):
    args = dict(num_hidden_layers=3, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16, **kw)
    if layers is None:
        with pytest.raises(StageError, match="no layer has experts"):
            spec_of(tmp_path, "Qwen3MoeConfig", **args)
        return
    spec = spec_of(tmp_path, "Qwen3MoeConfig", **args)
    assert spec.experts == Experts(8, 2, 32, layers, renormalize=renorm) and spec.qk_norm
    assert [spec.sparse(i) for i in range(3)] == [i in layers for i in range(3)]


@pytest.mark.parametrize("cls, change, field", [
    ("MixtralConfig", {"scoring_func": "sigmoid"}, "scoring_func"),          # another router: not ignored
    ("MixtralConfig", {"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ("Qwen3MoeConfig", {"num_experts_per_tok": 0}, "num_experts_per_tok"),
    ("Qwen3MoeConfig", {"mlp_only_layers": [7]}, "mlp_only_layers"),
    ("Qwen3MoeConfig", {"shared_expert_intermediate_size": 64}, "shared_expert_intermediate_size"),
])
def test_unmappable_expert_fields_are_refused_by_name(tmp_path, cls, change, field):
    hf, path = saved(tmp_path, cls, num_experts_per_tok=2, **({"num_local_experts": 8} if cls == "MixtralConfig"
                                                               else {"num_experts": 8, "head_dim": 16}))
    hf.update(change)
    with pytest.raises(StageError) as exc:
        families.read_spec(hf, path)
    assert str(exc.value).startswith(f"{path}: {field}: ") and "\n" not in str(exc.value)


QWEN2_MOE = dict(num_hidden_layers=3, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                 shared_expert_intermediate_size=48)


@pytest.mark.parametrize("kw, layers, renorm", [
    ({"mlp_only_layers": [1]}, (0, 2), False),
    ({"decoder_sparse_step": 2, "norm_topk_prob": True}, (1,), True),
])
def test_qwen2_moe_has_a_gated_shared_expert_beside_the_routed_ones(tmp_path, kw, layers, renorm):
    spec = spec_of(tmp_path, "Qwen2MoeConfig", **QWEN2_MOE, **kw)
    assert spec.experts == Experts(8, 2, 32, layers, renormalize=renorm, shared_intermediate_size=48, shared_gate=True)
    assert spec.qkv_bias and not spec.o_bias and not spec.qk_norm
    assert not spec_of(tmp_path, "Qwen2MoeConfig", **QWEN2_MOE, qkv_bias=False).qkv_bias
    assert spec_of(tmp_path, "Qwen2MoeConfig", **{**QWEN2_MOE, "num_experts": 0}).experts is None   # all dense


def test_qwen2_moe_windows_follow_its_own_layer_rule(tmp_path):
    """Qwen2MoeConfig slides the even-indexed layers below max_window_layers (Qwen2 the ones from it on):
    the file's layer_types, and the same rule when a hand-made file leaves them out."""
    hf, path = saved(tmp_path, "Qwen2MoeConfig", **QWEN2_MOE, use_sliding_window=True, sliding_window=16,
                     max_window_layers=2)
    assert hf["layer_types"] == ["sliding_attention", "full_attention", "full_attention"]
    for data in (hf, {k: v for k, v in hf.items() if k != "layer_types"}):
        _, spec = families.read_spec(data, path)
        assert spec.layer_types == ("sliding", "full", "full") and spec.layer(0).window == 16


@pytest.mark.parametrize("change, field", [
    ({"shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"mlp_only_layers": [7]}, "mlp_only_layers"),
    ({"qkv_bias": "yes"}, "qkv_bias"),
    ({"scoring_func": "sigmoid"}, "scoring_func"),
    ({"moe_shared_expert_ungated": True}, "moe_shared_expert_ungated"),   # unknown: refused, not ignored
])
def test_qwen2_moe_refuses_what_it_cannot_map_by_name(tmp_path, change, field):
    hf, path = saved(tmp_path, "Qwen2MoeConfig", **QWEN2_MOE)
    hf.update(change)
    with pytest.raises(StageError) as exc:
        families.read_spec(hf, path)
    assert str(exc.value).startswith(f"{path}: {field}: ") and "\n" not in str(exc.value)


def test_a_hand_made_config_gets_the_config_classes_expert_defaults(tmp_path):
    """A config.json without num_experts_per_tok routes as the config class would (Qwen3-MoE: 8, Qwen2-MoE: 4)."""
    for cls, kw, top_k in (("Qwen3MoeConfig", {"num_experts": 8, "moe_intermediate_size": 32, "head_dim": 16}, 8),
                           ("Qwen2MoeConfig", QWEN2_MOE, 4)):
        hf, path = saved(tmp_path, cls, **kw)
        del hf["num_experts_per_tok"]
        assert families.read_spec(hf, path)[1].experts.top_k == top_k, cls


def test_a_shared_expert_is_in_the_spec_only_when_present():
    """engine.json of a bundle without one keeps its keys (its bytes); with one it round-trips."""
    plain = Experts(4, 2, 8, (0,), renormalize=True)
    assert list(plain.to_dict()) == ["num_experts", "top_k", "intermediate_size", "layers", "router", "renormalize"]
    shared = Experts(4, 2, 8, (0,), shared_intermediate_size=16, shared_gate=True)
    assert Experts.from_dict(json.loads(json.dumps(shared.to_dict()))) == shared
    with pytest.raises(ArchSpecError, match="^shared_gate: true without a shared expert"):
        Experts(4, 2, 8, (0,), shared_gate=True)
    with pytest.raises(ArchSpecError, match="^shared_intermediate_size: 0 is not a positive integer"):
        Experts(4, 2, 8, (0,), shared_intermediate_size=0)


def test_the_spec_refuses_a_bad_expert_entry():
    with pytest.raises(ArchSpecError, match="^arch.experts.router: 'sigmoid' is not supported; allowed: softmax_topk"):
        ArchSpec.from_dict({"layer_types": ["full"], "experts": {"num_experts": 4, "top_k": 2, "intermediate_size": 8,
                                                                 "layers": [0], "router": "sigmoid"}})
    with pytest.raises(ArchSpecError, match="^arch.experts.layers: layer 3 does not exist"):
        ArchSpec(layer_types=("full",), experts=Experts(4, 2, 8, (3,)))


MOE_MODEL = {"architecture": "mixtral", "num_kv_heads": 2, "num_heads": 4, "head_dim": 16, "hidden_size": 64,
             "intermediate_size": 96, "num_layers": 2, "max_position_embeddings": 8192, "vocab_size": 256,
             "arch": {"experts": {"num_experts": 4}}}


@pytest.mark.parametrize("override, key, allowed", [
    ("quantization.format=fp8", "quantization.format", "none"),
    ("quantization.format=nvfp4", "quantization.format", "none"),
    ("quantization.kv_cache=fp8", "quantization.kv_cache", "none"),
    ("engine.tp_size=2", "engine.tp_size", "1"),
    ("speculative.method=eagle3", "speculative.method", "none"),
    ("tensorrt.enabled=true", "tensorrt.enabled", "false"),
])
def test_the_build_refuses_what_has_no_expert_path_yet(override, key, allowed):
    base = ["quantization.format=none", "quantization.kv_cache=none"]
    cfg = BuildConfig.from_dict({}, "x.yaml", [*base, override])
    with pytest.raises(ConfigError) as exc:
        check_against_model(cfg, MOE_MODEL)
    msg = str(exc.value)
    assert msg.startswith(f"x.yaml: {key}: ") and msg.endswith(f"allowed: {allowed}") and "mixture-of-experts" in msg
    check_against_model(BuildConfig.from_dict({}, "x.yaml", base), MOE_MODEL)   # the plain build passes


@pytest.mark.parametrize("backend", ["torch", "triton", "auto"])
def test_every_attention_backend_builds_an_expert_model(backend):
    """The fused Triton layer runs expert layers (the fused expert kernel), so no backend is refused."""
    base = ["quantization.format=none", "quantization.kv_cache=none", f"engine.attention_backend={backend}"]
    check_against_model(BuildConfig.from_dict({}, "x.yaml", base), MOE_MODEL)


def test_an_expert_bundle_plans_the_fused_expert_kernel():
    """kernel_shapes reads the experts from engine.json's model.arch, so the AOT stage compiles the fused
    expert kernel's variants (both GEMMs, both row blocks) for an expert bundle, and none for a dense one."""
    from types import SimpleNamespace

    from builder.stages.compile import kernel_shapes
    from plugins import aot

    def manifest(experts):
        arch = None if experts is None else ArchSpec(layer_types=("full",) * 3, experts=experts)
        return SimpleNamespace(
            model=SimpleNamespace(dtype="bfloat16", num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64,
                                  intermediate_size=96, arch_spec=arch),
            quantization=SimpleNamespace(format="none", group_size=None),
            engine=SimpleNamespace(kv_cache_dtype="auto", kv_block_size=16, tp_size=1), speculative=None)
    shapes = kernel_shapes(manifest(Experts(8, 2, 32, (1, 2))))
    assert (shapes.num_experts, shapes.moe_intermediate_size) == (8, 32)
    moe = [v for v in aot.plan(shapes) if v.fn.__name__ == "moe_gemm_kernel"]
    assert len(moe) == 4 and {v.constexprs["GATED"] for v in moe} == {True, False}
    dense = kernel_shapes(manifest(None))
    assert dense.num_experts == 0 and not any(v.fn.__name__ == "moe_gemm_kernel" for v in aot.plan(dense))


class FakeCheckpoint(dict):
    path = "ckpt"

    def get(self, name):
        return self[name]


def test_every_checkpoint_layout_packs_to_the_same_tensors():
    """Mixtral's per-expert w1/w3/w2, Qwen's per-expert gate/up/down_proj and transformers 5's packed
    gate_up_proj/down_proj give the same [E, 2I, H] / [E, H, I] tensors (gate rows, then up rows)."""
    g = torch.Generator().manual_seed(0)
    e, i, h = 3, 4, 5
    gate, up, down = (torch.randn(e, i, h, generator=g), torch.randn(e, i, h, generator=g),
                      torch.randn(e, h, i, generator=g))
    router = torch.randn(e, h, generator=g)
    b = "model.layers.0"
    layouts = {
        "mixtral": {f"{b}.block_sparse_moe.gate.weight": router,
                    **{f"{b}.block_sparse_moe.experts.{k}.{w}.weight": t[k] for k in range(e)
                       for w, t in (("w1", gate), ("w3", up), ("w2", down))}},
        "qwen": {f"{b}.mlp.gate.weight": router,
                 **{f"{b}.mlp.experts.{k}.{w}.weight": t[k] for k in range(e)
                    for w, t in (("gate_proj", gate), ("up_proj", up), ("down_proj", down))}},
        "packed": {f"{b}.mlp.gate.weight": router, f"{b}.mlp.experts.gate_up_proj": torch.cat([gate, up], dim=1),
                   f"{b}.mlp.experts.down_proj": down},
    }
    for name, tensors in layouts.items():
        got = dict(expert_tensors(FakeCheckpoint(tensors), b, 0, e, torch.float32))
        assert set(got) == {"layers.0.router.weight", "layers.0.experts.gate_up.weight", "layers.0.experts.down.weight"}
        assert torch.equal(got["layers.0.router.weight"], router), name
        assert torch.equal(got["layers.0.experts.gate_up.weight"][:, :i], gate), name
        assert torch.equal(got["layers.0.experts.gate_up.weight"][:, i:], up), name
        assert torch.equal(got["layers.0.experts.down.weight"], down), name
    incomplete = {k: v for k, v in layouts["mixtral"].items() if "experts.2.w2" not in k}
    with pytest.raises(StageError, match="experts.2.w2.weight is missing"):
        dict(expert_tensors(FakeCheckpoint(incomplete), b, 0, e, torch.float32))


def test_a_shared_expert_packs_gate_then_up_rows_and_its_gate():
    g = torch.Generator().manual_seed(0)
    h, i = 5, 3
    gate, up, down, out_gate = (torch.randn(i, h, generator=g), torch.randn(i, h, generator=g),
                                torch.randn(h, i, generator=g), torch.randn(1, h, generator=g))
    b = "model.layers.2"
    tensors = {f"{b}.mlp.shared_expert.gate_proj.weight": gate, f"{b}.mlp.shared_expert.up_proj.weight": up,
               f"{b}.mlp.shared_expert.down_proj.weight": down, f"{b}.mlp.shared_expert_gate.weight": out_gate}
    got = dict(shared_expert_tensors(FakeCheckpoint(tensors), b, 2, True, torch.float32))
    assert torch.equal(got["layers.2.shared_expert.gate_up.weight"], torch.cat([gate, up]))
    assert torch.equal(got["layers.2.shared_expert.down.weight"], down)
    assert torch.equal(got["layers.2.shared_expert_gate.weight"], out_gate)
    del tensors[f"{b}.mlp.shared_expert_gate.weight"]
    assert "layers.2.shared_expert_gate.weight" not in dict(shared_expert_tensors(FakeCheckpoint(tensors), b, 2, False,
                                                                                   torch.float32))
    with pytest.raises(StageError, match="shared_expert_gate.weight is missing"):
        dict(shared_expert_tensors(FakeCheckpoint(tensors), b, 2, True, torch.float32))
