"""Fused RMSNorm (+ residual) and rotary-embedding kernels vs references; rope tables vs transformers."""
import pytest
import torch

from plugins.reference.norm import rms_norm_ref
from plugins.reference.rope import apply_rope_ref, rope_cos_sin, rope_inv_freq
from plugins.rmsnorm import rms_norm
from plugins.rope import apply_rope
from tests.kernels.kernel_utils import assert_close


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("hidden", [576, 1024])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(device, fresh_seed, dtype, hidden, with_residual):
    x = torch.randn(7, hidden, device=device).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, device=device)).to(dtype)
    res = torch.randn(7, hidden, device=device).to(dtype) if with_residual else None
    got = rms_norm(x, w, 1e-5, res)
    ref = rms_norm_ref(x, w, 1e-5, res)
    if with_residual:
        assert torch.equal(got[1], ref[1]), "the residual sum must be exactly x + residual"
        got, ref = got[0], ref[0]
    assert_close(got, ref, dtype, "rms_norm", fresh_seed)


def test_rms_norm_rejects_bad_weight(device):
    with pytest.raises(ValueError, match="weight shape"):
        rms_norm(torch.zeros(2, 8, device=device), torch.ones(9, device=device), 1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (8, 1, 128)])
def test_rope_in_place_on_fused_qkv_views(device, fresh_seed, dtype, hq, hkv, d):
    T = 6
    qkv = torch.randn(T, (hq + 2 * hkv) * d, device=device).to(dtype)
    q = qkv[:, :hq * d].view(T, hq, d)          # strided views, as the model splits its fused projection
    k = qkv[:, hq * d:(hq + hkv) * d].view(T, hkv, d)
    v_before = qkv[:, (hq + hkv) * d:].clone()
    pos = torch.randint(0, 4000, (T,), device=device)
    table = rope_cos_sin(4096, rope_inv_freq(d, 500000.0, {"rope_type": "llama3", "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192})).to(device)
    rq, rk = apply_rope_ref(q.clone(), k.clone(), pos, table)
    apply_rope(q, k, pos, table)
    assert_close(q, rq, dtype, "rope q", fresh_seed)
    assert_close(k, rk, dtype, "rope k", fresh_seed)
    assert torch.equal(qkv[:, (hq + hkv) * d:], v_before), "v must be untouched"


@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 2.0},
                                     {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}])
def test_rope_inv_freq_matches_transformers(scaling):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    cfg = LlamaConfig(hidden_size=2048, num_attention_heads=16, rope_theta=500000.0,
                      max_position_embeddings=131072, rope_scaling=scaling)
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        expected = 1.0 / (500000.0 ** (torch.arange(0, 128, 2).float() / 128))
    else:
        expected, _ = ROPE_INIT_FUNCTIONS[kind](cfg, "cpu")
    torch.testing.assert_close(rope_inv_freq(128, 500000.0, scaling), expected.float(), rtol=1e-5, atol=0)


def test_rope_rejects_bad_table(device):
    q, k = torch.zeros(2, 4, 64, device=device), torch.zeros(2, 2, 64, device=device)
    with pytest.raises(ValueError, match=r"cos_sin shape \(10, 64\)"):
        apply_rope(q, k, torch.zeros(2, dtype=torch.long, device=device), torch.zeros(10, 64, device=device))


def test_rope_rejects_unknown_scaling():
    with pytest.raises(ValueError, match="rope_type: 'dynamic'"):
        rope_inv_freq(64, 1e4, {"rope_type": "dynamic", "factor": 2.0})
