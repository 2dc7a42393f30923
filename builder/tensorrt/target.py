"""The compile stage's TensorRT part (``tensorrt.enabled``): graph, plugin PTX and profiles, into the bundle.

Written before engine.json, so every file is hashed in its ``files`` like the rest of the bundle:
- ``decoder.onnx`` at the bundle root (its weights are byte ranges of ``weights.safetensors``);
- ``draft.onnx`` beside it when the bundle has an EAGLE-3 draft (draft_export.py; the decoder graph
  then also outputs the draft's aux layers ``hidden.{i}``);
- ``tensorrt/plugins/sm<sm>/<plugin>-<hash>.{ptx,json}``: the PTX of the kernels behind the graph's
  custom nodes in TensorRT's calling convention, each assembled by ptxas for its SM at this build;
- ``tensorrt/profiles.json``: the context and generation optimization profiles from the engine limits
  and each graph input's dims (backend/runtime/graph_io.py), what ``builder.tensorrt_build`` gives TensorRT.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import onnx

from backend import bundle
from backend.runtime import graph_io
from plugins.tensorrt.compile import compile_all
from plugins.tensorrt.convention import TrtFloats

from . import draft_export
from .onnx_export import GRAPH, OPSET, export_decoder, used_plugins

TRT_DIR = "tensorrt"


def profiles_doc(manifest: bundle.Manifest, model: onnx.ModelProto) -> dict:
    e = manifest.engine
    profiles = graph_io.profiles(e.max_batch_size, e.max_num_tokens, e.max_seq_len, e.kv_block_size)
    inputs = {}
    for v in model.graph.input:
        inputs[v.name] = [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
    return {"profiles": [dataclasses.asdict(p) for p in profiles], "inputs": inputs}


def write_target(out: Path, manifest: bundle.Manifest, shapes, tcfg) -> bundle.TensorRT:
    """Everything of the TensorRT target into bundle folder ``out``; returns engine.json's section.
    ``shapes``: the bundle's EngineShapes (the AOT kernels' plan); ``tcfg``: the ``tensorrt`` config."""
    draft = manifest.speculative is not None and manifest.speculative.method == "eagle3"
    aux = draft_export.draft_config(out, manifest).aux_layers if draft else ()
    model = export_decoder(out, manifest, aux)
    trt = out / TRT_DIR
    sms = list(manifest.targets.sms)
    plugins = used_plugins(model)   # only those the graph names (kiln_w4a16_gemm: 4-bit bundles)
    compile_all(shapes, TrtFloats(manifest.model.rms_norm_eps), sms, trt / "plugins", plugins=plugins)
    if draft:
        draft_export.export_draft(out, manifest)
        extra = draft_export.plugin_shapes(out, manifest, shapes)
        if extra is not None:   # the draft's heads or pool dtype differ from the target's: their variants too
            compile_all(extra, TrtFloats(manifest.model.rms_norm_eps), sms, trt / "plugins",
                        plugins=draft_export.PLUGINS)
    (trt / "profiles.json").write_text(json.dumps(profiles_doc(manifest, model), indent=1) + "\n")
    return bundle.TensorRT(graph=GRAPH, dir=TRT_DIR, opset=OPSET, plugins=plugins, sms=tuple(sms),
                           workspace_gib=tcfg.workspace_gib, timing_cache=tcfg.timing_cache,
                           draft_graph=draft_export.GRAPH if draft else None)
