"""The EAGLE-3 draft head of an engine bundle as its own ONNX graph, ``draft.onnx`` (opset 21).

The graph computes one step of backend/speculative/draft_model.py's ``Eagle3Draft`` (``fuse`` then
``step_many`` then ``logits``), op for op: ``fc`` over the target's aux layers side by side (only for
the rows fed by the target; rows fed by the draft's previous step take its pre-norm output as they
are), the token embedding and the feature each RMS-normed (the feature twice for ModelOpt drafts,
``double_hidden_norm``), concatenated, the one decoder layer with its own paged KV pool through the
decoder graph's two Kiln nodes (``kiln_rope_kv_write``, ``kiln_paged_prefill``: so its tree mask too),
the residual MLP, the final norm of the logits rows and the head over the DRAFT vocabulary. The
draft -> target id map (``d2t``) is not in the graph: the native draft applies it on the host to the
ids it picks (``to_target_ids`` after its argmax / top-k), and so does a graph runner.

Where it lives: at the bundle root beside ``decoder.onnx``, not in ``draft/``. Its weights stay where
they are (ONNX external data, byte ranges): the draft's in ``draft/weights.safetensors``, the token
embedding (and the head of a draft without its own) in the target's ``weights.safetensors``. onnx
resolves external data against the graph's folder and refuses ``..``, so only the root reaches both.
Inputs, outputs and dims: backend/runtime/graph_io.py (``DRAFT_*``).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import onnx
from onnx import TensorProto

from backend import bundle
from backend.runtime import graph_io
from backend.speculative.checkpoint import DraftConfig

from .onnx_export import (DTYPES, ExportError, finish_model, layer_constants, linear, paged_attention, rms_norm,
                          silu_mul)
from .onnx_graph import Graph, value_info
from .safetensors_refs import external_initializer, read_refs

GRAPH = graph_io.DRAFT_GRAPH
PLUGINS = ("kiln_rope_kv_write", "kiln_paged_prefill")
DRAFT = "draft."            # the draft's tensors in the graph: ``draft.<name in draft/weights.safetensors>``
_L = DRAFT + "layers.0."
# draft positions run up to the committed length plus the tree's depth: past engine.max_seq_len by
# at most the draft length (the executor's block-table margin, backend/runtime/graph_io.py ``profiles``)
POSITION_MARGIN = 64


class BundleGraph(Graph):
    """A Graph whose weights come from several safetensors files of one bundle: each file's tensors
    under a name prefix, each initializer pointing into its own file (paths relative to the root)."""

    def __init__(self, sources: dict[str, str], root: Path) -> None:
        refs, self._file = {}, {}
        for prefix, location in sources.items():
            for name, ref in read_refs(root / location).items():
                refs[prefix + name] = ref
                self._file[prefix + name] = location
        super().__init__(GRAPH, refs)

    def weight(self, name: str) -> str:
        if name not in self.initializers:
            if name not in self.refs:
                raise KeyError(f"{GRAPH}: missing tensor {name!r}")
            self.initializers[name] = external_initializer(self.refs[name], self._file[name], name)
        return name


def draft_config(bundle_dir: Path, manifest: bundle.Manifest) -> DraftConfig:
    spec = manifest.speculative
    if spec is None or spec.method != "eagle3":
        raise ExportError(f"{bundle_dir / bundle.MANIFEST}: no EAGLE-3 draft (speculative.method "
                          f"{spec and spec.method!r}); allowed: speculative.method=eagle3")
    where = bundle_dir / spec.draft_dir / "config.json"
    return DraftConfig.from_json(json.loads(where.read_text()), str(where))


def draft_model(bundle_dir: Path, manifest: bundle.Manifest) -> onnx.ModelProto:
    """The graph of ``bundle_dir``'s draft (external data relative to ``bundle_dir``)."""
    c, e, m = draft_config(bundle_dir, manifest), manifest.engine, manifest.model
    cd = DTYPES[m.dtype]   # the draft runs in the target's compute dtype, its pool too (draft_model.py)
    g = BundleGraph({"": bundle.WEIGHTS, DRAFT: f"{manifest.speculative.draft_dir}/{bundle.WEIGHTS}"}, bundle_dir)
    layer_constants(g, c, e.max_seq_len + POSITION_MARGIN)   # the draft's pool is never fp8

    emb = g.cast(g.op("Gather", [g.weight("embed_tokens.weight"), "input_ids"], "embed", axis=0), cd, "embed.cast")
    fused = linear(g, "aux_hidden", DRAFT + "fc", cd)
    feat = g.op("Concat", [fused, "draft_hidden"], "feature", axis=0)
    hin = rms_norm(g, feat, _L + "input_layernorm.weight", "feature.input_norm", cd) if c.double_hidden_norm else feat
    x = g.op("Concat", [rms_norm(g, emb, _L + "input_layernorm.weight", "embed.input_norm", cd),
                        rms_norm(g, hin, _L + "hidden_norm.weight", "feature.hidden_norm", cd)], "layer_input", axis=-1)
    qkv = g.op("Concat", [linear(g, x, f"{_L}self_attn.{n}_proj", cd) for n in "qkv"], "qkv", axis=-1)
    attn = paged_attention(g, c, qkv, (graph_io.DRAFT_K_CACHE, graph_io.DRAFT_V_CACHE),
                           (graph_io.DRAFT_K_CACHE_OUT, graph_io.DRAFT_V_CACHE_OUT),
                           ("kv_scale_unused", "kv_scale_unused"), "layer")
    h = g.op("Add", [feat, linear(g, attn, f"{_L}self_attn.o_proj", cd)], "attn.residual")
    y = rms_norm(g, h, _L + "post_attention_layernorm.weight", "post_attn_norm", cd)
    gate, up = (linear(g, y, f"{_L}mlp.{n}_proj", cd) for n in ("gate", "up"))
    h = g.op("Add", [h, linear(g, silu_mul(g, gate, up, "mlp"), f"{_L}mlp.down_proj", cd)], graph_io.DRAFT_HIDDEN_OUT)
    rows = g.op("Gather", [rms_norm(g, h, DRAFT + "norm.weight", "norm", cd), "logits_indices"], "logits_rows", axis=0)
    if c.has_lm_head:   # the draft's own head: dense, like every draft linear
        logits = linear(g, rows, DRAFT + "lm_head", cd)
    else:               # the target's, stored as the target stores it
        logits = linear(g, rows, "embed_tokens" if m.tie_word_embeddings else "lm_head", cd,
                        manifest.quantization.format)
    logits = g.cast(logits, TensorProto.FLOAT, graph_io.DRAFT_LOGITS)

    types = {"int64": TensorProto.INT64, "int32": TensorProto.INT32, "bool": TensorProto.BOOL, "model": cd}
    fixed = {"aux_width": len(c.aux_layers) * c.hidden_size, "hidden": c.hidden_size}
    inputs = [value_info(n, types[t], tuple(fixed.get(d, d) for d in dims)) for n, t, dims in graph_io.DRAFT_INPUTS]
    kv_shape = ("draft_blocks", e.kv_block_size, c.num_kv_heads, c.head_dim)
    inputs += [value_info(graph_io.DRAFT_K_CACHE, cd, kv_shape), value_info(graph_io.DRAFT_V_CACHE, cd, kv_shape)]
    outputs = [value_info(logits, TensorProto.FLOAT, ("rows", c.draft_vocab_size)),
               value_info(h, cd, ("tokens", c.hidden_size)),
               value_info(graph_io.DRAFT_K_CACHE_OUT, cd, kv_shape), value_info(graph_io.DRAFT_V_CACHE_OUT, cd, kv_shape)]
    return finish_model(g, "kiln_eagle3_draft", inputs, outputs, manifest,
                        f"Kiln EAGLE-3 draft of {manifest.config_file or bundle_dir}: inputs/outputs as "
                        f"backend/runtime/graph_io.py DRAFT_*; external data relative to the bundle root")


def export_draft(bundle_dir: Path, manifest: bundle.Manifest) -> onnx.ModelProto:
    """Write ``bundle_dir/draft.onnx``, checked with its weights; returns the graph (weights external)."""
    model = draft_model(bundle_dir, manifest)
    onnx.save_model(model, bundle_dir / GRAPH)
    onnx.checker.check_model(str(bundle_dir / GRAPH))
    return model


def plugin_shapes(bundle_dir: Path, manifest: bundle.Manifest, shapes):
    """The EngineShapes whose plugin PTX the draft's nodes need, or None when the target's (``shapes``)
    already cover them: the draft's heads and its pool in the compute dtype (never fp8)."""
    c = draft_config(bundle_dir, manifest)
    mine = dataclasses.replace(shapes, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                               kv=shapes.act)
    return None if mine == shapes else mine
