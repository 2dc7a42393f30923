"""Tensor parallelism over fewer KV heads than ranks, pure: each rank holds the KV head its query heads
read (replicated over tp / num_kv_heads ranks), in every quantization format, with no process.

The expected rows are computed here from the rule itself (rank r's query heads [r*Hq/tp, (r+1)*Hq/tp)
read KV head (r*Hq/tp) // (Hq/Hkv)), not from ``tp_rules``. The gloo runs against transformers are
test_family_tp.py.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from backend.runtime.tp_shard import ShardError, check_tp, shard_config, shard_tensor, shard_weights, unshard_tensor
from quant import formats
from tests.runtime.test_tp_shard import FORMATS, _parts, _same, _tiny, _tiny_weights

# (query heads, KV heads, tp): multi-query over 2 ranks, and 2 KV heads over 4 ranks
SPLITS = [(4, 1, 2), (8, 2, 4)]


def _kv_head(r: int, heads: int, kv: int, tp: int) -> int:
    return (r * heads // tp) // (heads // kv)


@pytest.mark.parametrize("heads,kv,tp", SPLITS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_each_rank_holds_the_kv_head_its_query_heads_read(fmt, heads, kv, tp):
    """Each rank's fused qkv is its q heads | the k rows of its KV head | that head's v rows, on the raw
    tensors (weight, per-row or per-group scales, bias: packed 4-bit and fp8 block scales included) and on
    the dense weight they dequantize to; per-tensor scales and the shared [head_dim] q/k norms are copied."""
    c = _tiny(heads=heads, kv=kv, vocab=12)
    full = _tiny_weights(c, fmt)
    g = torch.Generator().manual_seed(2)
    for n in ("q_norm", "k_norm"):
        full[f"layers.0.{n}.weight"] = torch.randn(c.head_dim, generator=g)
    q, d = c.q_size, c.head_dim
    dense = formats.dequantize(fmt, _parts(full, "qkv"))

    def rows(t: torch.Tensor, r: int) -> torch.Tensor:
        h = _kv_head(r, heads, kv, tp)
        qs, ks, vs = t.split((q, c.kv_size, c.kv_size))
        return torch.cat([qs.chunk(tp)[r], ks[h * d:(h + 1) * d], vs[h * d:(h + 1) * d]])
    for r in range(tp):
        s = shard_weights(full, c, fmt, tp, r)
        for part in ("weight", "weight_scale", "bias"):
            t = full.get(f"layers.0.qkv.{part}")
            if t is not None and t.dim() > 0:
                assert _same(s[f"layers.0.qkv.{part}"], rows(t, r)), (r, part)
        assert torch.equal(formats.dequantize(fmt, _parts(s, "qkv")), rows(dense, r))
        for name, t in full.items():
            if name.endswith(("input_scale", "weight_scale_2", "k_scale", "v_scale", "norm.weight")):
                assert _same(s[name], t), name
        assert s["layers.0.qkv.weight"].shape[0] == q // tp + 2 * d
    # the ranks sharing a KV head hold the same rows of it, bit for bit
    k_of = [shard_tensor("layers.0.qkv.weight", full["layers.0.qkv.weight"], c, tp, r)[q // tp:] for r in range(tp)]
    for r in range(tp):
        twin = next(o for o in range(tp) if _kv_head(o, heads, kv, tp) == _kv_head(r, heads, kv, tp))
        assert _same(k_of[r], k_of[twin])
    assert len({_kv_head(r, heads, kv, tp) for r in range(tp)}) == kv       # every KV head is held somewhere


@pytest.mark.parametrize("heads,kv,tp", SPLITS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_unshard_keeps_one_copy_of_a_replicated_head(fmt, heads, kv, tp):
    """``unshard_tensor`` of the ranks' parts is the tensor itself bit for bit: a replicated KV head's
    rows come back once, in place."""
    c = _tiny(heads=heads, kv=kv, vocab=12)
    for name, t in _tiny_weights(c, fmt).items():
        parts = [shard_tensor(name, t, c, tp, r) for r in range(tp)]
        assert _same(unshard_tensor(name, parts, c), t), name


@pytest.mark.parametrize("heads,kv,tp", SPLITS)
def test_a_rank_computes_its_heads_over_one_kv_head(heads, kv, tp):
    """The model a rank runs (its KV cache's heads and the attention's GQA group: heads / KV heads), and
    the kernels the build compiles for it, have one KV head and heads/tp query heads over it."""
    from builder.stages.compile import kernel_shapes
    c = shard_config(_tiny(heads=heads, kv=kv, vocab=12), tp)
    assert (c.num_heads, c.num_kv_heads, c.num_heads // c.num_kv_heads) == (heads // tp, 1, heads // tp)
    manifest = SimpleNamespace(
        model=SimpleNamespace(dtype="bfloat16", num_heads=heads, num_kv_heads=kv, head_dim=64, hidden_size=512,
                              intermediate_size=1024),
        quantization=SimpleNamespace(format="fp8", group_size=None),
        engine=SimpleNamespace(kv_cache_dtype="fp8_e4m3", kv_block_size=16, tp_size=tp), speculative=None)
    shapes = kernel_shapes(manifest)
    assert (shapes.num_heads, shapes.num_kv_heads) == (heads // tp, 1)


def test_kv_heads_that_neither_split_nor_replicate_are_refused_in_one_line():
    """2 KV heads on 3 ranks: a rank's query heads would read parts of two heads. The one line names
    num_key_value_heads and tp_size with their values, and the sizes that work."""
    c = _tiny(heads=6, kv=2, inter=12)
    with pytest.raises(ShardError) as err:
        check_tp(c, "none", 3)
    msg = str(err.value)
    assert "\n" not in msg and "num_key_value_heads=2, tp_size=3" in msg and msg.endswith("allowed: 1 | 2 | 6")
    with pytest.raises(ShardError, match=r"tp_size=8 does not divide the model's 4 attention heads"):
        check_tp(_tiny(heads=4, kv=1, vocab=16), "none", 8)      # query heads still split evenly
    check_tp(_tiny(heads=4, kv=1), "nvfp4", 2)
    check_tp(_tiny(heads=8, kv=2), "int4_awq", 4, group_size=8)


def test_engine_json_records_replication_only_where_it_happens():
    """engine.kv_heads_per_rank is written by the build where the ranks outnumber the KV heads, and left out
    otherwise, so the bundles that need no replication read as before in every runtime."""
    from backend.bundle_schema import EngineSettings, as_dict
    from builder.stages.compile import _kv_replication
    assert _kv_replication({"num_kv_heads": 1}, 2) == {"kv_heads_per_rank": 1}
    assert _kv_replication({"num_kv_heads": 2}, 8) == {"kv_heads_per_rank": 1}
    assert _kv_replication({"num_kv_heads": 4}, 2) == {} and _kv_replication({"num_kv_heads": 1}, 1) == {}
    assert "kv_heads_per_rank" not in as_dict(EngineSettings())
    assert as_dict(EngineSettings(tp_size=2, kv_heads_per_rank=1))["kv_heads_per_rank"] == 1
