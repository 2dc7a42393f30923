"""Fused RMSNorm (+ residual) and rotary-embedding kernels vs references; rope tables vs transformers;
q/k RMS norms (Qwen3's x_normed * w, Gemma 3's x_normed * (1 + w)) fused into the rope + KV write, at
head dims 64, 128 and 256, with the reference's norms checked against transformers' own classes."""
import pytest
import torch

from plugins.reference.fused import head_rms_norm_ref, rope_write_kv_ref
from plugins.reference.norm import rms_norm_ref
from plugins.reference.rope import apply_rope_ref, rope_cos_sin, rope_inv_freq
from plugins.rmsnorm import rms_norm
from plugins.rope import apply_rope
from plugins.rope_kv import rope_write_kv
from tests.kernels.kernel_utils import assert_close, poison
from tests.kernels.test_fused_layer import assert_fp8_close


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


@pytest.mark.parametrize("one_plus", [False, True])
def test_head_rms_norm_ref_is_transformers_q_k_norm(fresh_seed, one_plus):
    """The reference's roundings are Qwen3RMSNorm's (w * x_normed.to(bf16)) and Gemma3RMSNorm's
    ((x_normed * (1 + w)).to(bf16)): bit for bit in bf16, where the two differ."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
    d, eps = 256, 1e-6
    x = (torch.randn(5, 4, d) * 3 + 0.5).bfloat16()
    w = (0.3 * torch.randn(d) + (0.0 if one_plus else 1.0)).bfloat16()
    hf = Gemma3RMSNorm(d, eps) if one_plus else Qwen3RMSNorm(d, eps)
    with torch.no_grad():
        hf.weight.copy_(w)
        want = hf.to(torch.bfloat16)(x)
    got = head_rms_norm_ref(x, w, eps, one_plus)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want), f"seed={fresh_seed}"
    # the other model's rounding gives other bits: the comparison above tells the two forms apart
    h = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    scale = (1.0 + w.float()) if one_plus else w.float()
    other = (h.bfloat16().float() * scale).bfloat16() if one_plus else (h * scale).bfloat16()
    assert not torch.equal(other, want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("form", ["rms", "rms_1p"])
@pytest.mark.parametrize("kv", ["act", "fp8"])
@pytest.mark.parametrize("T,hq,hkv,D", [(5, 4, 1, 256), (19, 9, 3, 64), (7, 8, 2, 128)])
def test_rope_write_kv_with_fused_qk_norm(device, fresh_seed, dtype, form, kv, T, hq, hkv, D):
    bs, num_blocks, eps = 16, 4, 1e-6
    qkv = (torch.randn(T, (hq + 2 * hkv) * D, device=device) * 3 + 0.5).to(dtype)
    base = 1.0 if form == "rms" else 0.0
    qw = (base + 0.3 * torch.randn(D, device=device)).to(dtype)
    kw = (base + 0.3 * torch.randn(D, device=device)).to(dtype)
    cos_sin = rope_cos_sin(256, rope_inv_freq(D, 1e6)).to(device)
    positions = torch.randint(0, 256, (T,), device=device)
    slots = torch.randperm(num_blocks * bs, device=device)[:T].long()
    slots[0] = -1                                  # padding: written nowhere
    cache_dtype = torch.float8_e4m3fn if kv == "fp8" else dtype
    caches = [poison(torch.empty(num_blocks, bs, hkv, D, dtype=cache_dtype, device=device)) for _ in range(4)]
    ks, vs = torch.tensor(0.05, device=device), torch.tensor(0.03, device=device)
    ref_qkv, plain_qkv = qkv.clone(), qkv.clone()
    q_ref = rope_write_kv_ref(ref_qkv, positions, cos_sin, caches[2], caches[3], slots, hq, hkv, ks, vs,
                              q_norm=qw, k_norm=kw, eps=eps, qk_norm=form)
    q = rope_write_kv(qkv, positions, cos_sin, caches[0], caches[1], slots, hq, hkv, ks, vs,
                      q_norm=qw, k_norm=kw, eps=eps, qk_norm=form)
    assert q.data_ptr() == qkv.data_ptr() and q.shape == (T, hq, D)
    assert_close(q, q_ref, dtype, f"normed rotated q ({form})", fresh_seed)
    assert torch.equal(qkv[:, hq * D:], ref_qkv[:, hq * D:]), "k and v must stay as they were in qkv"
    keep = slots[slots >= 0]
    for name, got, ref in (("k", caches[0], caches[2]), ("v", caches[1], caches[3])):
        g, r = got.view(-1, hkv, D)[keep], ref.view(-1, hkv, D)[keep]
        if kv == "fp8":
            assert_fp8_close(g, r, f"{name} cache codes", fresh_seed, max_frac=0.02 if name == "k" else 0.0)
        else:
            assert_close(g, r, dtype, f"{name} cache ({form})", fresh_seed)
    # the norm is not a no-op on these inputs: without it q comes out different
    q_plain = rope_write_kv_ref(plain_qkv, positions, cos_sin, caches[2].clone(), caches[3].clone(), slots, hq, hkv,
                                ks, vs)
    assert (q_plain.float() - q_ref.float()).abs().max() > 0.1


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_rope_write_kv_head_dim_256(device, fresh_seed, dtype):
    """Gemma 3's head dim without norms (the plain kernel; 128 halves per head)."""
    T, hq, hkv, D = 6, 4, 1, 256
    qkv = torch.randn(T, (hq + 2 * hkv) * D, device=device).to(dtype)
    cos_sin = rope_cos_sin(64, rope_inv_freq(D, 1e4)).to(device)
    positions = torch.randint(0, 64, (T,), device=device)
    slots = torch.randperm(32, device=device)[:T].long()
    caches = [poison(torch.empty(2, 16, hkv, D, dtype=dtype, device=device)) for _ in range(4)]
    ref_qkv = qkv.clone()
    q_ref = rope_write_kv_ref(ref_qkv, positions, cos_sin, caches[2], caches[3], slots, hq, hkv)
    q = rope_write_kv(qkv, positions, cos_sin, caches[0], caches[1], slots, hq, hkv)
    assert_close(q, q_ref, dtype, "rotated q (head dim 256)", fresh_seed)
    for got, ref in ((caches[0], caches[2]), (caches[1], caches[3])):
        assert_close(got.view(-1, hkv, D)[slots], ref.view(-1, hkv, D)[slots], dtype, "cache", fresh_seed)


def test_rope_write_kv_rejects_bad_norms(device):
    qkv = torch.zeros(2, 8 * 32, device=device)
    cache = torch.zeros(1, 16, 2, 32, device=device)
    cs = torch.zeros(16, 2, 16, device=device)
    pos = torch.zeros(2, dtype=torch.long, device=device)
    w = torch.ones(32, device=device)
    with pytest.raises(ValueError, match="q_norm and k_norm go together"):
        rope_write_kv(qkv, pos, cs, cache, cache, pos, 4, 2, q_norm=w)
    with pytest.raises(ValueError, match=r"must be contiguous \(32,\)"):
        rope_write_kv(qkv, pos, cs, cache, cache, pos, 4, 2, q_norm=w[:16], k_norm=w)
    with pytest.raises(ValueError, match="qk_norm 'gemma'; allowed: rms, rms_1p"):
        rope_write_kv(qkv, pos, cs, cache, cache, pos, 4, 2, q_norm=w, k_norm=w, qk_norm="gemma")
