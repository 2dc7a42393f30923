"""The decoder of an engine bundle as one ONNX graph (opset 21) for TensorRT, weights left in place.

The graph computes what the native runner's unfused layer computes (backend/model/llama.py
``decoder_layer``), op for op: RMSNorm in fp32 cast back before the weight multiply, the QKV / O /
gate-up / down linears, SiLU x up, residual adds, the final norm, the logits rows, the lm_head, and
Qwen3's per-head q/k RMS norms as standard nodes where the bundle has them (``_check_spec`` refuses what
the graph does not compute: windows that bind, Gemma 3's layer, a rope per attention kind). Three
steps have no ONNX or TensorRT layer and are Kiln plugins (custom nodes, see onnx_graph.py):
``kiln_rope_kv_write`` (rotary embedding of q and k, k and v written into the paged pool at the
step's slots, fp8 with the layer's scales) and ``kiln_paged_prefill`` (varlen paged attention over
context + new tokens, causal, with the EAGLE tree mask; decode is its one-query case) and
``kiln_w4a16_gemm`` (a linear on packed 4-bit weights, nvfp4 or int4_awq, unpacked inside the GEMM).
Their inputs are ordered as plugins/tensorrt/convention.py's SPECS, so TensorRT hands the AOT PTX
exactly those.

FP8 linears are explicit Q/DQ (TensorRT 11 networks are strongly typed): the activation quantized
with the calibrated per-tensor fp32 input scale and dequantized, the fp8 weight dequantized with its
per-output-row scale, the product in fp32 then cast to the compute dtype. 4-bit linears compute what
the native runner's GPU path does (W4A16, backend/ops/linear.py): AWQ's pre_quant_scale multiplies
the activation first, nvfp4's activations stay 16-bit (its input_scale is for W4A4, which Hopper has
no tensor cores for) and its global scale weight_scale_2 is a plugin input. Where the graph's compute
dtype (the model's) enters is a ``Cast`` after every weight and before every output, so a runtime can
evaluate the same graph in float32 by retargeting those casts (backend/runtime/onnx_runner.py does, for
parity with the native runner in fp32). Inputs, outputs and dims: backend/runtime/graph_io.py.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from backend import bundle
from backend.runtime import graph_io
from backend.model.decoder_parts import LLAMA_LAYER, rope_args
from backend.model.layers import RotaryEmbedding
from plugins.tensorrt.variants import W4A16

from .onnx_graph import KILN_DOMAIN, Graph, value_info
from .safetensors_refs import read_refs

OPSET = 21
GRAPH = "decoder.onnx"
DTYPES = {"bfloat16": TensorProto.BFLOAT16, "float16": TensorProto.FLOAT16, "float32": TensorProto.FLOAT}
KV_TYPES = dict(DTYPES, fp8_e4m3=TensorProto.FLOAT8E4M3FN, float8_e4m3fn=TensorProto.FLOAT8E4M3FN)
# quantization formats the graph expresses; int8_sq and w4a8_awq need GEMM plugins not exported yet
FORMATS = ("none", "fp8", *W4A16)
# every plugin the graph can name, in the order engine.json lists those a graph uses (used_plugins)
PLUGINS = ("kiln_rope_kv_write", "kiln_paged_prefill", "kiln_w4a16_gemm")


class ExportError(ValueError):
    """The bundle cannot be exported: one line naming the tensor, key or format."""


def _dense(g: Graph, x: str, w: str, p: str, cd: int, fmt: str = "none") -> str:
    wt = g.cast(g.weight(w), cd, f"{p}.weight.cast")
    return g.op("MatMul", [x, g.op("Transpose", [wt], f"{p}.weight.t", perm=[1, 0])], f"{p}.matmul")


def _fp8(g: Graph, x: str, w: str, p: str, cd: int, fmt: str) -> str:
    """Q/DQ: fp8(x / s_in) * s_in in fp32 times the dequantized weight, cast to the compute dtype."""
    s_in = g.weight(f"{p}.input_scale")
    zero = g.const("fp8_zero", np.array(0, dtype=_fp8_numpy()))
    xf = g.cast(x, TensorProto.FLOAT, f"{p}.input.f32")
    xq = g.op("QuantizeLinear", [xf, s_in, zero], f"{p}.input.q", saturate=1)
    xd = g.op("DequantizeLinear", [xq, s_in], f"{p}.input.dq")
    wd = g.op("DequantizeLinear", [g.weight(w), g.weight(f"{p}.weight_scale")], f"{p}.weight.dq", axis=0)
    y = g.op("MatMul", [xd, g.op("Transpose", [wd], f"{p}.weight.t", perm=[1, 0])], f"{p}.matmul")
    return g.cast(y, cd, f"{p}.out.cast")


def _fp8_numpy():
    import ml_dtypes   # onnx's own dependency: numpy has no fp8 type
    return ml_dtypes.float8_e4m3fn


def _int4_scales(g: Graph, p: str, cd: int) -> tuple[str, str]:
    # group scales in the model dtype; the int4 variant never reads its second scale, so the graph
    # feeds weight_scale there again (the native wrapper does the same)
    s = g.cast(g.weight(f"{p}.weight_scale"), cd, f"{p}.weight_scale.cast")
    return s, s


def _nvfp4_scales(g: Graph, p: str, cd: int) -> tuple[str, str]:
    return g.weight(f"{p}.weight_scale"), g.weight(f"{p}.weight_scale_2")   # fp8 [N, K/16], fp32 []


# a 4-bit format -> its two scale inputs of the plugin node (types: plugins/tensorrt/variants.py W4A16)
W4_SCALES = {"int4_awq": _int4_scales, "nvfp4": _nvfp4_scales}


def _w4a16(g: Graph, x: str, w: str, p: str, cd: int, fmt: str) -> str:
    """Packed 4-bit weight [N, K/2] uint8: the W4A16 GEMM plugin, inputs in SPECS order (x, weight,
    weight_scale, weight_scale_2), attributes its FMT and scale group (the PTX variant's constexprs)."""
    if g.has(f"{p}.pre_quant_scale"):   # AWQ smoothing, on the activation as the native GEMM path does
        x = g.op("Mul", [x, g.cast(g.weight(f"{p}.pre_quant_scale"), cd, f"{p}.pre_quant_scale.cast")],
                 f"{p}.pre_quant_scale.mul")
    scale, scale_2 = W4_SCALES[fmt](g, p, cd)
    group = 2 * g.refs[w].shape[1] // g.refs[f"{p}.weight_scale"].shape[1]
    return g.plugin("kiln_w4a16_gemm", [x, g.weight(w), scale, scale_2], f"{p}.w4a16_gemm", [f"{p}.w4a16_gemm"],
                    fmt=W4A16[fmt].fmt, group_size=group)[0]


ANY = "*"
# (a linear's stored weight dtype, the bundle's quantization.format) -> how the graph multiplies by it.
# Per linear: a quantized bundle keeps its quantization.exclude modules dense, so the dtype decides
# (ANY format); packed 4-bit weights are uint8 in both 4-bit formats, so there the format decides.
LINEARS = {("BF16", ANY): _dense, ("F16", ANY): _dense, ("F32", ANY): _dense, ("F8_E4M3", ANY): _fp8,
           **{("U8", f): _w4a16 for f in W4A16}}


def linear(g: Graph, x: str, p: str, cd: int, fmt: str = "none") -> str:
    """``x @ W^T (+ bias)`` for the bundle linear ``p``; ``fmt``: the bundle's quantization.format (an EAGLE
    draft's linears are dense: the default)."""
    w = f"{p}.weight"
    if not g.has(w):
        raise ExportError(f"{g.location}: missing tensor {w!r}")
    kind = g.refs[w].dtype
    emit = LINEARS.get((kind, fmt), LINEARS.get((kind, ANY)))
    if emit is None:
        raise ExportError(f"{g.location}: {w} is {kind} in a {fmt} bundle: the ONNX export has no node for it; "
                          f"allowed quantization.format with tensorrt.enabled: {', '.join(FORMATS)}")
    y = emit(g, x, w, p, cd, fmt)
    if g.has(f"{p}.bias"):
        y = g.op("Add", [y, g.cast(g.weight(f"{p}.bias"), cd, f"{p}.bias.cast")], f"{p}.bias.add")
    return y


def rms_norm(g: Graph, x: str, w: str, p: str, cd: int) -> str:
    """HF Llama's RMSNorm: normalize in fp32, cast back, then multiply by the weight."""
    xf = g.cast(x, TensorProto.FLOAT, f"{p}.f32")
    ms = g.op("ReduceMean", [g.op("Mul", [xf, xf], f"{p}.sq"), g.const("axis_last", np.array([-1], np.int64))],
              f"{p}.mean", keepdims=1)
    inv = g.op("Reciprocal", [g.op("Sqrt", [g.op("Add", [ms, "rms_eps"], f"{p}.eps")], f"{p}.sqrt")], f"{p}.rsqrt")
    y = g.cast(g.op("Mul", [xf, inv], f"{p}.scale"), cd, f"{p}.cast")
    return g.op("Mul", [g.cast(g.weight(w), cd, f"{p}.weight.cast"), y], f"{p}.weight.mul")


def _kv_scale(g: Graph, i: int, kind: str, kv_fp8: bool) -> str:
    return g.weight(f"layers.{i}.attn.{kind}_scale") if kv_fp8 else "kv_scale_unused"


def paged_attention(g: Graph, c, qkv: str, caches: tuple[str, str], caches_out: tuple[str, str],
                    scales: tuple[str, str], p: str) -> str:
    """The two Kiln nodes of one attention: q and k rotated and k, v written into the paged pool
    (``caches`` in, aliased by ``caches_out``), then varlen paged attention over it with the tree mask.
    ``c``: the layer's heads (a model or draft config); ``scales``: the pool's fp8 k/v scales or the placeholder."""
    heads = dict(num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim)
    roped, k_out, v_out = g.plugin(
        "kiln_rope_kv_write", [qkv, *caches, "positions", "slot_mapping", "cos_sin", *scales], f"{p}.rope_kv_write",
        [f"{p}.qkv_roped", *caches_out], **heads)
    return g.plugin("kiln_paged_prefill", [roped, k_out, v_out, "block_tables", "query_start_loc", "context_lens",
                                           "tree_mask", *scales, "sm_scale"], f"{p}.attention", [f"{p}.attn"],
                    **heads)[0]


def silu_mul(g: Graph, gate: str, up: str, p: str) -> str:
    """SwiGLU's activation: SiLU(gate) x up."""
    return g.op("Mul", [g.op("Mul", [gate, g.op("Sigmoid", [gate], f"{p}.sigmoid")], f"{p}.silu"), up], f"{p}.act")


def layer_constants(g: Graph, c, max_positions: int) -> None:
    """What every layer's norms and Kiln nodes read: rms_eps, sm_scale, the placeholder scale of a
    non-fp8 pool (the kernels never read it) and the rotary table [max_positions, 2, D/2] in fp32,
    the fused native path's. ``c``: a model or draft config."""
    g.const("rms_eps", np.array(c.rms_norm_eps, np.float32))
    g.const("sm_scale", np.array([1.0 / math.sqrt(c.head_dim)], np.float32))
    g.const("kv_scale_unused", np.ones(1, np.float32))
    rope = RotaryEmbedding(c.head_dim, max_positions, *rope_args(c, c.arch_spec))  # as the runtime
    half = c.head_dim // 2
    g.const("cos_sin", np.stack([rope.cos[:, :half].numpy(), rope.sin[:, :half].numpy()], axis=1))


def qk_norm(g: Graph, c, qkv: str, p: str, cd: int) -> str:
    """Qwen3's per-head RMSNorm of q and k, before the rope plugin rotates them: each head of
    ``qkv [T, (Hq + 2 Hkv) D]``'s q and k parts normalized over D in fp32, cast back, then times the
    layer's q_norm weight (query heads) or k_norm weight (key heads); v passes as it is."""
    hq, hkv, d = c.num_heads, c.num_kv_heads, c.head_dim
    qk, v = g.node("Split", [qkv, g.const(f"qk_v_split", np.array([(hq + hkv) * d, hkv * d], np.int64))],
                   f"{p}.qk_norm.split", 2, axis=-1)
    heads = g.op("Reshape", [qk, g.const("qk_heads_shape", np.array([0, hq + hkv, d], np.int64))], f"{p}.qk_norm.heads")
    xf = g.cast(heads, TensorProto.FLOAT, f"{p}.qk_norm.f32")
    ms = g.op("ReduceMean", [g.op("Mul", [xf, xf], f"{p}.qk_norm.sq"), g.const("axis_last", np.array([-1], np.int64))],
              f"{p}.qk_norm.mean", keepdims=1)
    inv = g.op("Reciprocal", [g.op("Sqrt", [g.op("Add", [ms, "rms_eps"], f"{p}.qk_norm.eps")], f"{p}.qk_norm.sqrt")],
               f"{p}.qk_norm.rsqrt")
    y = g.cast(g.op("Mul", [xf, inv], f"{p}.qk_norm.scale"), cd, f"{p}.qk_norm.cast")
    # the weight of each head: q_norm's on the Hq query heads, k_norm's on the Hkv key heads -> [Hq + Hkv, D]
    per_head = [g.op("Expand", [g.cast(g.weight(f"{p}.{w}.weight"), cd, f"{p}.{w}.cast"),
                                g.const(f"{w}_heads", np.array([n, d], np.int64))], f"{p}.{w}.heads")
                for w, n in (("q_norm", hq), ("k_norm", hkv))]
    weight = g.op("Concat", per_head, f"{p}.qk_norm.weight", axis=0)
    normed = g.op("Reshape", [g.op("Mul", [weight, y], f"{p}.qk_norm.weight.mul"),
                              g.const("qk_flat_shape", np.array([0, (hq + hkv) * d], np.int64))], f"{p}.qk_norm.flat")
    return g.op("Concat", [normed, v], f"{p}.qk_norm.qkv", axis=-1)


def decoder_layer(g: Graph, c, i: int, h: str, cd: int, kv_fp8: bool, fmt: str) -> str:
    p = f"layers.{i}"
    x = rms_norm(g, h, f"{p}.input_norm.weight", f"{p}.input_norm", cd)
    qkv = linear(g, x, f"{p}.qkv", cd, fmt)
    if g.has(f"{p}.q_norm.weight"):
        qkv = qk_norm(g, c, qkv, p, cd)
    scales = _kv_scale(g, i, "k", kv_fp8), _kv_scale(g, i, "v", kv_fp8)
    attn = paged_attention(g, c, qkv, (graph_io.k_cache(i), graph_io.v_cache(i)),
                           (graph_io.k_cache_out(i), graph_io.v_cache_out(i)), scales, p)
    h = g.op("Add", [h, linear(g, attn, f"{p}.o", cd, fmt)], f"{p}.attn.residual")
    x = rms_norm(g, h, f"{p}.post_attn_norm.weight", f"{p}.post_attn_norm", cd)
    gate, up = g.node("Split", [linear(g, x, f"{p}.gate_up", cd, fmt)], f"{p}.gate_up.split", 2, axis=-1,
                      num_outputs=2)
    return g.op("Add", [h, linear(g, silu_mul(g, gate, up, p), f"{p}.down", cd, fmt)], f"{p}.mlp.residual")


def _check_spec(bundle_dir: Path, manifest: bundle.Manifest) -> None:
    """Refuse, in one line naming the field, a model the graph would not compute as written: it is the
    Llama layer with Qwen3's per-head q/k norms, one rope and full attention (windows that bind need the
    attention plugin's window variant, Gemma 3's layer its norms and activation: not exported yet)."""
    where = f"{bundle_dir / bundle.MANIFEST}: model"
    spec = manifest.model.arch_spec
    for name, value in (LLAMA_LAYER.items() if spec is not None else ()):
        if getattr(spec, name) != value:
            raise ExportError(f"{where}.arch.{name}: {getattr(spec, name)!r} has no ONNX export yet; allowed: "
                              f"{value!r}, or tensorrt.enabled=false")
    windows = [a.window for a in spec.attention if a.window is not None] if spec is not None else []
    windows += [manifest.model.sliding_window] if manifest.model.sliding_window else []
    if windows and min(windows) < manifest.engine.max_seq_len:
        raise ExportError(f"{where}: a sliding window of {min(windows)} below engine.max_seq_len "
                          f"{manifest.engine.max_seq_len} has no ONNX export yet (the attention plugin is full "
                          f"attention); allowed: engine.max_seq_len <= {min(windows)}, or tensorrt.enabled=false")
    if spec is not None and len({a.rope for a in spec.attention}) > 1:
        raise ExportError(f"{where}.arch.attention: a rope per attention kind has no ONNX export yet; allowed: "
                          f"one rope, or tensorrt.enabled=false")


def decoder_model(bundle_dir: Path, manifest: bundle.Manifest, capture_layers: tuple[int, ...] = ()) -> onnx.ModelProto:
    """The graph of ``bundle_dir``'s decoder (external data relative to ``bundle_dir``)."""
    c, q, e = manifest.model, manifest.quantization, manifest.engine
    if q.format not in FORMATS:
        raise ExportError(f"{bundle_dir / bundle.MANIFEST}: quantization.format {q.format} has no ONNX export "
                          f"yet (its int8/W4A8 GEMM plugin is not in the graph); allowed: {', '.join(FORMATS)}")
    _check_spec(bundle_dir, manifest)
    if manifest.weights != (bundle.WEIGHTS,):
        raise ExportError(f"{bundle_dir}: engine.tp_size {e.tp_size}: the ONNX export is one graph for one device; "
                          f"allowed: engine.tp_size=1 with tensorrt.enabled")
    if e.kv_cache_dtype not in KV_TYPES:
        raise ExportError(f"engine.kv_cache_dtype {e.kv_cache_dtype!r}; allowed: {', '.join(KV_TYPES)}")
    cd, kv_type = DTYPES[c.dtype], KV_TYPES[e.kv_cache_dtype]
    kv_fp8 = kv_type == TensorProto.FLOAT8E4M3FN
    g = Graph(bundle.WEIGHTS, read_refs(bundle_dir / bundle.WEIGHTS))
    layer_constants(g, c, e.max_seq_len)

    h = g.cast(g.op("Gather", [g.weight("embed_tokens.weight"), "input_ids"], "embed", axis=0), cd, "embed.cast")
    outputs = []
    for i in range(c.num_layers):
        h = decoder_layer(g, c, i, h, cd, kv_fp8, q.format)
        if i in capture_layers:
            outputs.append(value_info(g.op("Identity", [h], graph_io.hidden_out(i)), cd, ("tokens", c.hidden_size)))
    x = rms_norm(g, h, "norm.weight", "norm", cd)
    rows = g.op("Gather", [x, "logits_indices"], "logits_rows", axis=0)
    head = "embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"
    logits = g.cast(_dense(g, rows, head, "lm_head", cd), TensorProto.FLOAT, graph_io.LOGITS)

    kv_shape = ("blocks", e.kv_block_size, c.num_kv_heads, c.head_dim)
    types = {"int64": TensorProto.INT64, "int32": TensorProto.INT32, "bool": TensorProto.BOOL}
    inputs = [value_info(n, types[t], dims) for n, t, dims in graph_io.STEP_INPUTS]
    for i in range(c.num_layers):
        inputs += [value_info(graph_io.k_cache(i), kv_type, kv_shape), value_info(graph_io.v_cache(i), kv_type, kv_shape)]
        outputs += [value_info(graph_io.k_cache_out(i), kv_type, kv_shape),
                    value_info(graph_io.v_cache_out(i), kv_type, kv_shape)]
    outputs.insert(0, value_info(logits, TensorProto.FLOAT, ("rows", c.vocab_size)))
    return finish_model(g, "kiln_decoder", inputs, outputs, manifest,
                        f"Kiln decoder of {manifest.config_file or bundle_dir}: inputs/outputs as "
                        f"backend/runtime/graph_io.py; external data relative to the bundle root")


def finish_model(g: Graph, name: str, inputs: list, outputs: list, manifest: bundle.Manifest,
                 doc: str) -> onnx.ModelProto:
    """The model of graph ``g``'s nodes and initializers: opset OPSET plus Kiln's plugin domain."""
    graph = helper.make_graph(g.nodes, name, inputs, outputs, initializer=list(g.initializers.values()))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(KILN_DOMAIN, 1)],
                              producer_name="kiln", producer_version=manifest.kiln_version or "")
    model.doc_string = doc
    return model


def used_plugins(model: onnx.ModelProto) -> tuple[str, ...]:
    """The plugins the graph's custom nodes name (what the bundle needs PTX for), in PLUGINS order."""
    ops = {n.op_type for n in model.graph.node if n.domain == KILN_DOMAIN}
    unknown = ops - set(PLUGINS)
    assert not unknown, f"the export wrote nodes no plugin list names: {sorted(unknown)}"
    return tuple(p for p in PLUGINS if p in ops)


def export_decoder(bundle_dir: Path, manifest: bundle.Manifest, capture_layers: tuple[int, ...] = ()) -> onnx.ModelProto:
    """Write ``bundle_dir/decoder.onnx``, checked; returns the graph (its weights still external)."""
    model = decoder_model(bundle_dir, manifest, capture_layers)
    onnx.save_model(model, bundle_dir / GRAPH)
    # the whole check, external data included, now that the graph sits beside the weights it names
    # (onnx resolves them against the graph's folder)
    onnx.checker.check_model(str(bundle_dir / GRAPH))
    return model
