"""References of the fused decode-layer kernels: each is the unfused sequence of ops it replaces, so a
fused kernel is right when it gives these numbers (same roundings: the residual sum and the normed /
activated value are rounded to the activation dtype before the fp8 quantization, as the unfused model does).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .kv_cache import quantize_fp8, write_kv_ref
from .norm import rms_norm_ref
from .rope import apply_rope_ref


def add_rms_norm_quant_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                           input_scale: torch.Tensor | None = None):
    """x: [T, H]; weight: [H]; residual: optional [T, H]; input_scale: optional fp32 [] (the next GEMM's).
    -> (y, new_residual): y = rms_norm(x + residual) in x.dtype, or float8_e4m3fn codes of y / input_scale
    with a scale; new_residual = x + residual (x itself without a residual)."""
    if residual is None:
        y, res = rms_norm_ref(x, weight, eps), x
    else:
        y, res = rms_norm_ref(x, weight, eps, residual)
    return (y if input_scale is None else quantize_fp8(y, input_scale)), res


def silu_mul_quant_ref(gate_up: torch.Tensor, input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """gate_up: [T, 2I] (gate | up) -> silu(gate) * up [T, I] in gate_up.dtype, or its float8_e4m3fn codes
    of value / input_scale."""
    gate, up = gate_up.chunk(2, dim=-1)
    y = F.silu(gate.float()).to(gate_up.dtype) * up
    return y if input_scale is None else quantize_fp8(y, input_scale)


def head_rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, one_plus: bool) -> torch.Tensor:
    """x: [..., D] (one head per row); weight: [D] -> RMSNorm over D in x.dtype, as transformers' q/k norms:
    Qwen3RMSNorm rounds x_normed to x.dtype and then multiplies by w (one_plus False), Gemma3RMSNorm
    multiplies by (1 + w) in fp32 and rounds once (one_plus True)."""
    h = x.float()
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if one_plus:
        return (y * (1.0 + weight.float())).to(x.dtype)
    return (weight.float() * y.to(x.dtype).float()).to(x.dtype)


def rope_write_kv_ref(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int,
                      k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                      q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None, eps: float = 1e-6,
                      qk_norm: str = "rms") -> torch.Tensor:
    """qkv: [T, (Hq + 2 Hkv) D] (q | k | v); rotates q in place and writes rotated k and v into the paged
    caches at slot_mapping (-1 skips; fp8 caches store x / scale) -> q as a [T, Hq, D] view of qkv.
    k in qkv is left as it was (attention reads keys from the cache). With q_norm / k_norm ([D] weights),
    q and k are RMS-normed per head first (head_rms_norm_ref; qk_norm "rms_1p" is Gemma's (1 + w) form)."""
    T = qkv.shape[0]
    D = qkv.shape[1] // (num_heads + 2 * num_kv_heads)
    q, k, v = qkv.split((num_heads * D, num_kv_heads * D, num_kv_heads * D), dim=-1)
    q, k, v = q.view(T, num_heads, D), k.view(T, num_kv_heads, D), v.view(T, num_kv_heads, D)
    qn, kn = q, k
    if q_norm is not None:
        qn = head_rms_norm_ref(q, q_norm, eps, qk_norm == "rms_1p")
        kn = head_rms_norm_ref(k, k_norm, eps, qk_norm == "rms_1p")
    q_rot, k_rot = apply_rope_ref(qn, kn, positions, cos_sin)
    write_kv_ref(k_rot, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    q.copy_(q_rot)
    return q
