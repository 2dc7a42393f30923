"""Kiln's kernels with their parameters in TensorRT's AOT order: (inputs..., int32 scalars..., outputs...).

TensorRT launches an AOT plugin's PTX with the plugin's input pointers, then its int32 extra arguments,
then its output pointers, and nothing else (see plugins/tensorrt/__init__.py). Kiln's kernels take their
outputs first and float scalars as arguments, so each wrapper here reorders the parameters and calls
the unchanged kernel, which Triton inlines. The floats: RMSNorm's eps is a constexpr (EPS, baked into
the PTX per bundle; the compiled code is the native kernel's with an immediate for the parameter); the
softmax scale is an fp32[1] input tensor (`sm_scale_ptr`), loaded and passed on as the runtime value
the native kernel gets, because baked in as a constexpr it changed the code: with 0.125 (head_dim 64)
LLVM moved the fp16-dot decode's q scaling past its fp16 conversion (mul.f16x2 instead of mul.f32),
which rounds differently where q * scale is fp16-subnormal. Constexpr names are the native kernel's
(so a plan Variant's constexprs apply unchanged) plus EPS. In-place ops (rope + KV write) take the
buffer both as an input and as an output that TensorRT aliases to it (`TensorDesc.aliased()`); the
kernel writes through the output pointer.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..gemm_w4a16 import w4a16_gemm_kernel
from ..norm_quant import add_rms_norm_quant_kernel
from ..paged_decode import paged_decode_kernel, paged_decode_reduce_kernel
from ..paged_prefill import paged_prefill_kernel
from ..rope_kv import rope_kv_write_kernel


@triton.jit
def trt_paged_decode(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, k_scale_ptr, v_scale_ptr,
                     out_scale_ptr, sm_scale_ptr, stride_qb, stride_qh, stride_ob, stride_oh, stride_bt,
                     tokens_per_split, num_splits, out_ptr,
                     NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, KV_FP8: tl.constexpr, SPLIT: tl.constexpr,
                     OUT_FP8: tl.constexpr, DOT_F16: tl.constexpr, HEADS_FIRST: tl.constexpr, V_U16: tl.constexpr):
    # unsplit: the partial buffers are never touched, so the output stands in for them (as natively)
    sm_scale = tl.load(sm_scale_ptr)
    paged_decode_kernel(out_ptr, out_ptr, out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
                        k_scale_ptr, v_scale_ptr, out_scale_ptr, sm_scale, stride_qb, stride_qh, stride_ob, stride_oh,
                        stride_bt, tokens_per_split, num_splits, NUM_KV_HEADS, GROUP, GROUP_PAD, HEAD_DIM, BLOCK_SIZE,
                        TILE, KV_FP8, SPLIT, OUT_FP8, DOT_F16, HEADS_FIRST, V_U16)


@triton.jit
def trt_paged_decode_split(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, k_scale_ptr, v_scale_ptr,
                           sm_scale_ptr, stride_qb, stride_qh, stride_bt, tokens_per_split, num_splits, part_acc_ptr,
                           part_ml_ptr,
                           NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                           HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, KV_FP8: tl.constexpr,
                           SPLIT: tl.constexpr, OUT_FP8: tl.constexpr, DOT_F16: tl.constexpr,
                           HEADS_FIRST: tl.constexpr, V_U16: tl.constexpr):
    # split: only the partials are written (the reduction plugin writes the output), so the output
    # pointer, its strides and out_scale are not parameters; the partials stand in for the unused ones
    sm_scale = tl.load(sm_scale_ptr)
    paged_decode_kernel(part_acc_ptr, part_acc_ptr, part_ml_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr,
                        seq_lens_ptr, k_scale_ptr, v_scale_ptr, k_scale_ptr, sm_scale, stride_qb, stride_qh, 0, 0,
                        stride_bt, tokens_per_split, num_splits, NUM_KV_HEADS, GROUP, GROUP_PAD, HEAD_DIM, BLOCK_SIZE,
                        TILE, KV_FP8, SPLIT, OUT_FP8, DOT_F16, HEADS_FIRST, V_U16)


@triton.jit
def trt_paged_decode_reduce(part_acc_ptr, part_ml_ptr, act_ptr, out_scale_ptr, stride_ob, stride_oh, num_splits,
                            out_ptr, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, SPLITS_PAD: tl.constexpr,
                            OUT_FP8: tl.constexpr):
    paged_decode_reduce_kernel(out_ptr, part_acc_ptr, part_ml_ptr, act_ptr, out_scale_ptr, stride_ob, stride_oh,
                               num_splits, NUM_HEADS, HEAD_DIM, SPLITS_PAD, OUT_FP8)


@triton.jit
def trt_paged_prefill(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_ptr, context_lens_ptr,
                      tree_mask_ptr, k_scale_ptr, v_scale_ptr, sm_scale_ptr, stride_qt, stride_qh, stride_ot,
                      stride_oh, stride_bt, stride_tm, out_ptr,
                      NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                      HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK: tl.constexpr, TILE: tl.constexpr,
                      KV_FP8: tl.constexpr, HAS_TREE: tl.constexpr):
    sm_scale = tl.load(sm_scale_ptr)
    paged_prefill_kernel(out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_ptr,
                         context_lens_ptr, tree_mask_ptr, k_scale_ptr, v_scale_ptr, sm_scale, stride_qt, stride_qh,
                         stride_ot, stride_oh, stride_bt, stride_tm, NUM_KV_HEADS, GROUP, GROUP_PAD, HEAD_DIM,
                         BLOCK_SIZE, BLOCK, TILE, KV_FP8, HAS_TREE)


@triton.jit
def trt_rope_kv_write(qkv_in_ptr, k_cache_in_ptr, v_cache_in_ptr, pos_ptr, slot_ptr, cos_sin_ptr, k_scale_ptr,
                      v_scale_ptr, num_tokens, stride_t, qkv_ptr, k_cache_ptr, v_cache_ptr,
                      NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, Q_PAD: tl.constexpr,
                      KV_PAD: tl.constexpr, HALF: tl.constexpr, TOKENS: tl.constexpr, KV_FP8: tl.constexpr):
    # the *_in pointers equal the outputs (aliased); they are declared only because TensorRT passes them
    rope_kv_write_kernel(qkv_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, slot_ptr, cos_sin_ptr, k_scale_ptr, v_scale_ptr,
                         num_tokens, stride_t, NUM_Q_HEADS, NUM_KV_HEADS, Q_PAD, KV_PAD, HALF, TOKENS, KV_FP8)


@triton.jit
def trt_w4a16_gemm(x_ptr, w_ptr, ws_ptr, ws2_ptr, M, N, K, k_per_split, stride_xm, stride_om, stride_wn, stride_sn,
                   out_ptr, FMT: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, ROW_SCALE: tl.constexpr):
    w4a16_gemm_kernel(out_ptr, x_ptr, w_ptr, ws_ptr, ws2_ptr, M, N, K, k_per_split, stride_xm, stride_om, stride_wn,
                      stride_sn, FMT, GROUP, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT, ROW_SCALE)


@triton.jit
def trt_add_rms_norm_quant(x_ptr, res_ptr, w_ptr, scale_ptr, stride_x, stride_r, stride_o, stride_ro, out_ptr,
                           res_out_ptr, EPS: tl.constexpr, HIDDEN: tl.constexpr, BLOCK: tl.constexpr,
                           HAS_RESIDUAL: tl.constexpr, QUANT: tl.constexpr):
    add_rms_norm_quant_kernel(out_ptr, res_out_ptr, x_ptr, res_ptr, w_ptr, scale_ptr, EPS, stride_x, stride_r,
                              stride_o, stride_ro, HIDDEN, BLOCK, HAS_RESIDUAL, QUANT)


@triton.jit
def trt_rms_norm_quant(x_ptr, w_ptr, scale_ptr, stride_x, stride_o, out_ptr, EPS: tl.constexpr, HIDDEN: tl.constexpr,
                       BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, QUANT: tl.constexpr):
    # no residual: the residual pointers and strides are never read, so x / out stand in for them
    add_rms_norm_quant_kernel(out_ptr, out_ptr, x_ptr, x_ptr, w_ptr, scale_ptr, EPS, stride_x, stride_x, stride_o,
                              stride_o, HIDDEN, BLOCK, HAS_RESIDUAL, QUANT)
