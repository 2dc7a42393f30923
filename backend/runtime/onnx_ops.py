"""Kiln's custom ONNX nodes for onnx's ReferenceEvaluator, backed by the kernels' PyTorch references.

The decoder graph (builder/tensorrt/onnx_export.py) has three nodes no ONNX operator expresses; on a
TensorRT host they are the AOT plugins, here they run ``plugins/reference`` (the functions every Triton
kernel is tested against). Arrays cross as views, not copies (bf16 and fp8 through their integer
bits), so ``kiln_rope_kv_write`` writes into the very pool the runner owns and returns it as its
``*_cache_out`` outputs: the aliasing TensorRT gets by binding both to one address.
"""
from __future__ import annotations

import warnings

import ml_dtypes
import numpy as np
import torch
from onnx.reference.op_run import OpRun

from plugins import registry
from plugins.reference.gemm import dequant_int4_awq, dequant_nvfp4

# The custom nodes' kernels: the table's reference (torch) rows, what every Triton kernel is tested against
paged_prefill_ref = registry.load("paged_prefill", "torch")
rope_write_kv_ref = registry.load("rope_write_kv", "torch")

# numpy dtypes torch cannot take directly -> (the integer view numpy can share, torch dtype)
_VIA_BITS = {np.dtype(ml_dtypes.bfloat16): (np.int16, torch.bfloat16),
             np.dtype(ml_dtypes.float8_e4m3fn): (np.uint8, torch.float8_e4m3fn)}
_TO_NUMPY = {torch.bfloat16: (torch.int16, ml_dtypes.bfloat16), torch.float8_e4m3fn: (torch.uint8, ml_dtypes.float8_e4m3fn)}


def to_torch(a: np.ndarray) -> torch.Tensor:
    """A tensor sharing ``a``'s memory (a copy only when ``a`` is not contiguous). The evaluator's
    constants are read-only arrays: the ops below write only the pool and their own outputs, so
    torch's warning about non-writable memory is silenced rather than paid for with a copy."""
    a = np.ascontiguousarray(a)
    bits, dt = _VIA_BITS.get(a.dtype, (None, None))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a.view(bits)).view(dt) if bits else torch.from_numpy(a)


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """An array sharing ``t``'s memory (``t`` on the CPU, contiguous)."""
    if t.dtype in _TO_NUMPY:
        bits, dt = _TO_NUMPY[t.dtype]
        return t.view(bits).numpy().view(dt)
    return t.numpy()


def _scale(a: np.ndarray, cache: torch.Tensor) -> torch.Tensor | None:
    """A layer's KV scale, which only an fp8 pool reads (others get a 1-element placeholder)."""
    return to_torch(a).float().reshape(()) if cache.dtype == torch.float8_e4m3fn else None


class kiln_rope_kv_write(OpRun):  # noqa: N801 - the class name is the op type the evaluator matches
    op_domain = "kiln"

    def _run(self, qkv, k_cache, v_cache, positions, slot_mapping, cos_sin, k_scale, v_scale,
             num_heads=None, num_kv_heads=None, head_dim=None, plugin_namespace=None, aot=None):
        kc, vc = to_torch(k_cache), to_torch(v_cache)
        out = np.array(qkv, copy=True)   # q is rotated in place: never in the caller's array
        rope_write_kv_ref(to_torch(out), to_torch(positions), to_torch(cos_sin), kc, vc, to_torch(slot_mapping),
                          int(num_heads), int(num_kv_heads), _scale(k_scale, kc), _scale(v_scale, vc))
        return out, k_cache, v_cache


class kiln_paged_prefill(OpRun):  # noqa: N801
    op_domain = "kiln"

    def _run(self, qkv, k_cache, v_cache, block_tables, query_start_loc, context_lens, tree_mask, k_scale,
             v_scale, sm_scale, num_heads=None, num_kv_heads=None, head_dim=None, plugin_namespace=None, aot=None):
        t, hq, d = qkv.shape[0], int(num_heads), int(head_dim)
        q = to_torch(qkv)[:, :hq * d].reshape(t, hq, d)
        kc, vc = to_torch(k_cache), to_torch(v_cache)
        tree = to_torch(tree_mask) if tree_mask.shape[1] else None   # width 0: plain causal
        out = paged_prefill_ref(q, kc, vc, to_torch(block_tables), to_torch(query_start_loc),
                                to_torch(context_lens), float(sm_scale.reshape(-1)[0]), _scale(k_scale, kc),
                                _scale(v_scale, vc), tree)
        return (to_numpy(out.reshape(t, hq * d).contiguous()),)


def _int4_awq(weight, weight_scale, weight_scale_2):
    return dequant_int4_awq(weight, weight_scale)   # its pre_quant_scale is a Mul before the node


# the node's `fmt` attribute (the kernel's FMT: plugins/tensorrt/variants.py W4A16) -> the reference's
# dequantizer; the product is the reference linears' (plugins/reference/gemm.py): x @ W^T in fp32
_DEQUANT = {0: _int4_awq, 1: dequant_nvfp4}


class kiln_w4a16_gemm(OpRun):  # noqa: N801
    op_domain = "kiln"
    _packed: tuple = ()
    _dense: torch.Tensor | None = None

    def _run(self, x, weight, weight_scale, weight_scale_2, fmt=None, group_size=None, plugin_namespace=None,
             aot=None):
        assert 2 * weight.shape[1] == group_size * weight_scale.shape[1], (weight.shape, weight_scale.shape, group_size)
        # the weight tensors are the same arrays every step (initializers, folded constants): dequantized
        # once per node, as the dense graph's weight casts are folded once (onnx_runner.fold_constants).
        # Kept by identity, and holding them keeps an id from being reused by another array.
        packed = (weight, weight_scale, weight_scale_2)
        if len(self._packed) != 3 or any(a is not b for a, b in zip(self._packed, packed)):
            self._dense = _DEQUANT[int(fmt)](*(to_torch(a) for a in packed))
            self._packed = packed
        xt = to_torch(x)
        return (to_numpy((xt.float() @ self._dense.t()).to(xt.dtype).contiguous()),)


CUSTOM_OPS = [kiln_rope_kv_write, kiln_paged_prefill, kiln_w4a16_gemm]
