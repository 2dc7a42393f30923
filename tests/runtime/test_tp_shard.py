"""Tensor-parallel sharding (#20), pure: a small random model in every quantization format, no process.

Each rank's tensors dequantize to its share of the dense weight, ``unshard_tensor`` inverts
``shard_tensor`` bit for bit, the runtime's linears on the shards sum to the whole linear, and splits
that would cut heads or scale groups are refused. The real-model runs are test_tensor_parallel.py.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from backend.bundle_schema import ModelConfig
from backend.runtime.tp_shard import ShardError, check_tp, shard_config, shard_tensor, shard_weights, unshard_tensor
from quant import formats

FORMATS = ("none", "fp8", "nvfp4", "int4_awq", "w4a8_awq", "int8_sq")     # every format Kiln builds
TINY_GROUP = 8    # the tiny model's AWQ group: each rank's 16 input features of o/down hold two groups


def _tiny(heads: int = 4, kv: int = 2, vocab: int = 12, inter: int = 64) -> ModelConfig:
    # hidden 32 and head_dim 8: every in-feature count (32, heads*8, inter) holds whole nvfp4 blocks
    # of 16 on each of 2 ranks, so the tiny model exercises every format's row-parallel split
    return ModelConfig(architecture="llama", hidden_size=32, intermediate_size=inter, num_layers=1, num_heads=heads,
                       num_kv_heads=kv, head_dim=8, vocab_size=vocab, rms_norm_eps=1e-5, rope_theta=1e4,
                       max_position_embeddings=64, tie_word_embeddings=False, dtype="float32")


def _linear(g: torch.Generator, fmt: str, out: int, inp: int, group: int = TINY_GROUP) -> dict[str, torch.Tensor]:
    """One linear's runtime tensors in ``fmt`` (quant/formats.py's reference quantizers), with every
    optional scale the format has, each distinct per row/group/column so a misplaced one shows."""
    w = torch.randn(out, inp, generator=g)
    t = formats.quantize_int4(w, group) if fmt in ("int4_awq", "w4a8_awq") else formats.get_format(fmt).quantize(w)
    t = dict(t)
    if fmt in ("fp8", "nvfp4", "w4a8_awq", "int8_sq"):
        t["input_scale"] = torch.tensor(0.05)
    if fmt == "w4a8_awq":
        t["weight_scale_2"] = torch.tensor(0.01)
    if fmt in ("int4_awq", "w4a8_awq", "int8_sq"):
        t["pre_quant_scale"] = torch.rand(inp, generator=g) + 0.5
    return t


def _tiny_weights(c: ModelConfig, fmt: str, group: int = TINY_GROUP) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g)

    w = {"embed_tokens.weight": r(c.vocab_size, c.hidden_size), "lm_head.weight": r(c.vocab_size, c.hidden_size),
         "norm.weight": r(c.hidden_size), "layers.0.input_norm.weight": r(c.hidden_size),
         "layers.0.post_attn_norm.weight": r(c.hidden_size)}
    for name, (out, inp) in _shapes(c).items():
        p = f"layers.0.{name}"
        w.update({f"{p}.{k}": t for k, t in _linear(g, fmt, out, inp, group).items()})
        w[f"{p}.bias"] = r(out)
    if fmt != "none":
        w["layers.0.attn.k_scale"], w["layers.0.attn.v_scale"] = torch.tensor(0.1), torch.tensor(0.2)
    return w


def _shapes(c: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of each linear."""
    return {"qkv": (c.q_size + 2 * c.kv_size, c.hidden_size), "o": (c.hidden_size, c.q_size),
            "gate_up": (2 * c.intermediate_size, c.hidden_size), "down": (c.hidden_size, c.intermediate_size)}


def _parts(w: dict[str, torch.Tensor], lin: str) -> dict[str, torch.Tensor]:
    p = f"layers.0.{lin}."
    return {n[len(p):]: t for n, t in w.items() if n.startswith(p) and n[len(p):] != "bias"}


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (fp8 included: compared as bytes)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("fmt", FORMATS)
def test_shards_reassemble_the_full_linears(fmt):
    """Each rank's fused qkv is its q heads | its k heads | its v heads, its gate_up its gate | its up
    slice; o/down split by input columns (packed 4-bit bytes and group scales on group boundaries,
    pre-quant scales with their columns); per-row scales go with their rows, per-tensor ones are
    copied. Checked on the raw tensors and on the dense weight each rank's tensors dequantize to."""
    c, tp = _tiny(), 2
    full = _tiny_weights(c, fmt)
    shards = [shard_weights(full, c, fmt, tp, r) for r in range(tp)]
    q, kv = c.q_size, c.kv_size
    dense = {lin: formats.dequantize(fmt, _parts(full, lin)) for lin in _shapes(c)}
    for r, s in enumerate(shards):
        assert set(s) == set(full)
        for part in ("weight", "weight_scale", "bias"):
            name = f"layers.0.qkv.{part}"
            if name in full and full[name].dim() > 0:
                qs, ks, vs = full[name].split((q, kv, kv))
                assert _same(s[name], torch.cat([qs.chunk(tp)[r], ks.chunk(tp)[r], vs.chunk(tp)[r]]))
            name = f"layers.0.gate_up.{part}"
            if name in full and full[name].dim() > 0:
                gate, up = full[name].chunk(2)
                assert _same(s[name], torch.cat([gate.chunk(tp)[r], up.chunk(tp)[r]]))
        for lin in ("o", "down"):
            for part in ("weight", "weight_scale"):     # [out, in], [out, in/2] packed, [out, in/group]
                t = full.get(f"layers.0.{lin}.{part}")
                if t is None:
                    continue
                want = t.chunk(tp, dim=1)[r] if t.dim() == 2 else t     # per-row or per-tensor: whole
                assert _same(s[f"layers.0.{lin}.{part}"], want)
            assert _same(s[f"layers.0.{lin}.bias"], full[f"layers.0.{lin}.bias"])   # added once, after the reduce
        assert _same(s["embed_tokens.weight"], full["embed_tokens.weight"].chunk(tp)[r])
        assert _same(s["lm_head.weight"], full["lm_head.weight"].chunk(tp)[r])
        for name, t in full.items():
            if name.endswith(("input_scale", "weight_scale_2", "k_scale", "v_scale", "norm.weight")):
                assert _same(s[name], t), name
            elif name.endswith("pre_quant_scale"):     # multiplies the input: whole where it is not split
                want = t.chunk(tp)[r] if ".o." in name or ".down." in name else t
                assert _same(s[name], want), name
        # what each rank multiplies by: its rows of the full dense weight, or its columns for o/down
        for lin, d in dense.items():
            got = formats.dequantize(fmt, _parts(s, lin))
            if lin == "qkv":
                qs, ks, vs = d.split((q, kv, kv))
                want = torch.cat([qs.chunk(tp)[r], ks.chunk(tp)[r], vs.chunk(tp)[r]])
            elif lin == "gate_up":
                gate, up = d.chunk(2)
                want = torch.cat([gate.chunk(tp)[r], up.chunk(tp)[r]])
            else:
                want = d.chunk(tp, dim=1)[r]
            assert torch.equal(got, want), lin
        assert s["layers.0.qkv.weight"].shape[0] == (q + 2 * kv) // tp
    # row-parallel: the ranks' partial products sum to the full one
    x = torch.randn(3, q)
    parts = sum(x.chunk(tp, dim=1)[r] @ formats.dequantize(fmt, _parts(shards[r], "o")).T for r in range(tp))
    torch.testing.assert_close(parts, x @ dense["o"].T)
    assert shard_config(c, tp) == dataclasses.replace(c, num_heads=2, num_kv_heads=1, intermediate_size=32, vocab_size=6)


@pytest.mark.parametrize("fmt", FORMATS)
def test_unshard_is_shard_inverse_bit_for_bit(fmt):
    """``unshard_tensor(shard_tensor(...) for each rank)`` is the tensor itself, bit for bit, for every
    tensor of every format (packed bytes, fp8 block scales and all), and for each tp the model allows."""
    c = _tiny()
    full = _tiny_weights(c, fmt)
    for tp in (1, 2):
        for name, t in full.items():
            parts = [shard_tensor(name, t, c, tp, r) for r in range(tp)]
            assert all(p.dtype == t.dtype for p in parts)
            assert _same(unshard_tensor(name, parts, c), t), (tp, name)


@pytest.mark.parametrize("fmt", FORMATS)
def test_rank_linears_sum_to_the_full_linear(fmt):
    """The runtime's own linears (backend/ops/linear.py, CPU path) built from each rank's tensors: the
    column-parallel ones give the rank's rows of the full output, the row-parallel ones partial sums
    of it (activation quantization included: per-tensor scales, nvfp4 blocks whole on each rank)."""
    from backend.ops.linear import make_linear
    c, tp = _tiny(), 2
    full = _tiny_weights(c, fmt)
    shards = [shard_weights(full, c, fmt, tp, r) for r in range(tp)]
    g = torch.Generator().manual_seed(1)
    for lin, (_, inp) in _shapes(c).items():
        x = torch.randn(5, inp, generator=g)
        ref = make_linear(fmt, _parts(full, lin), torch.float32, "cpu")(x)
        ranks = [make_linear(fmt, _parts(s, lin), torch.float32, "cpu") for s in shards]
        if lin in ("o", "down"):
            got = sum(m(xr) for m, xr in zip(ranks, x.chunk(tp, dim=1)))
        else:       # each rank's output columns are its weight rows: put them back as the weight's
            got = unshard_tensor(f"layers.0.{lin}.weight", [m(x).T for m in ranks], c).T
        # only the order of the sums differs (no activation code moves on this small random input)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


def test_grouped_formats_split_on_group_boundaries_only():
    """A rank must hold whole scale groups of o/down's input features: refused by the rules (nvfp4's
    16, an AWQ group_size given) and, where the group size is not known, by the scales' own shape."""
    with pytest.raises(ShardError, match=r"tp_size=2 gives each rank 24 of the 48 input features of down "
                                         r"\(intermediate_size\), not a multiple of nvfp4's block 16.*; allowed: 1$"):
        check_tp(_tiny(inter=48), "nvfp4", 2)
    with pytest.raises(ShardError, match=r"tp_size=2 gives each rank 16 of the 32 input features of o "
                                         r"\(num_heads\*head_dim\), not a multiple of int4_awq's group_size 32"):
        check_tp(_tiny(), "int4_awq", 2, group_size=32)
    check_tp(_tiny(inter=48), "int4_awq", 2, group_size=8)      # 24 = 3 groups of 8
    c = _tiny(inter=48)
    w = _tiny_weights(c, "w4a8_awq", group=16)                  # down: 3 groups, 1.5 per rank
    with pytest.raises(ShardError, match=r"layers.0.down.weight_scale: 3 scale groups of 16 input features do "
                                         r"not split 2 ways: each rank's 24 of the 48 input features would cut one"):
        shard_weights(w, c, "w4a8_awq", 2, 0)


def test_shards_are_views_of_nothing():
    """A rank keeps its share only: no shard is a view into the full tensor's storage."""
    c = _tiny()
    full = _tiny_weights(c, "none")
    s = shard_weights(full, c, "none", 2, 1)
    ptrs = {t.untyped_storage().data_ptr() for t in full.values()}
    assert not any(t.untyped_storage().data_ptr() in ptrs for t in s.values())


def test_sharding_refuses_what_it_cannot_split():
    c = _tiny(heads=9, kv=3, vocab=12)
    with pytest.raises(ShardError, match=r"tp_size=2 does not divide the model's 9 attention heads"):
        check_tp(c, "none", 2)
    with pytest.raises(ShardError, match=r"tp_size=3 neither divides the model's 2 KV heads nor is a multiple"):
        check_tp(_tiny(heads=6, kv=2, inter=12), "none", 3)
    with pytest.raises(ShardError, match=r"tp_size=3 does not divide the model's 8 intermediate_size"):
        check_tp(dataclasses.replace(c, intermediate_size=8), "none", 3)
    with pytest.raises(ShardError, match=r"tp_size=3 does not divide the model's 10 vocab_size"):
        check_tp(dataclasses.replace(c, intermediate_size=6, vocab_size=10), "none", 3)
    with pytest.raises(ShardError, match=r"'int3' cannot be sharded for tp_size=3; allowed: none, fp8, nvfp4"):
        check_tp(c, "int3", 3)
    w = _tiny_weights(_tiny(), "none")
    w["layers.0.qkv.pre_quant_scale"] = torch.ones(8)
    with pytest.raises(ShardError, match=r"layers.0.qkv: tensors pre_quant_scale"):
        shard_weights(w, _tiny(), "none", 2, 0)
    w = _tiny_weights(_tiny(), "none")
    w["draft.fc.weight"] = torch.ones(2, 2)
    with pytest.raises(ShardError, match=r"not covered by tensor-parallel sharding: draft.fc.weight"):
        shard_weights(w, _tiny(), "none", 2, 0)


# ---- the real model: a tp_size=3 bundle, and three gloo ranks against the unsharded model -------


def test_per_head_qk_norms_go_whole_to_every_rank():
    """Qwen3's q/k norms weigh each head's dimensions alike: each rank gets the [head_dim] weight as it is
    (its heads are a subset); the rest of the layer still splits."""
    c = _tiny()
    w = _tiny_weights(c, "none")
    g = torch.Generator().manual_seed(1)
    w["layers.0.q_norm.weight"] = torch.randn(c.head_dim, generator=g)
    w["layers.0.k_norm.weight"] = torch.randn(c.head_dim, generator=g)
    for rank in range(2):
        s = shard_weights(w, c, "none", 2, rank)
        for name in ("layers.0.q_norm.weight", "layers.0.k_norm.weight"):
            assert torch.equal(s[name], w[name])
        assert s["layers.0.qkv.weight"].shape[0] == w["layers.0.qkv.weight"].shape[0] // 2
