"""Tiny engine bundles with the TensorRT target's files, for the plan builder and runner tests.

A 2-layer model (4 heads, 2 KV heads, head dim 32, bf16, fp8 weights and KV) with random weights,
the decoder graph and profiles.json as the build's ONNX export writes them (builder/tensorrt/), and
the plugin PTX that ``plugins.tensorrt.compile.compile_all`` writes, for the two plugins the graph
uses, on sm_90 only.
The PTX is compiled in a child process (the kernel tests' TRITON_INTERPRET=1 forbids compiling in
process) and cached under build/test-cache/ by a hash of the shapes, Triton's version and the kernel
sources: ~15 s the first time, nothing after.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from backend import bundle
from backend.runtime import graph_io
from plugins.common import EngineShapes

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("KILN_TEST_CACHE", ROOT / "build" / "test-cache"))
MODEL = {
    "architecture": "llama", "hidden_size": 128, "intermediate_size": 256, "num_layers": 2, "num_heads": 4,
    "num_kv_heads": 2, "head_dim": 32, "vocab_size": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "max_position_embeddings": 512, "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
    "sliding_window": None, "bos_token_id": 1, "eos_token_ids": [2], "pad_token_id": 2, "dtype": "bfloat16"}
ENGINE = {"max_batch_size": 4, "max_num_tokens": 64, "max_seq_len": 128, "max_input_len": 64, "kv_block_size": 16,
          "max_kv_tokens": 1024}
SHAPES = EngineShapes(act="bf16", kv="fp8e4nv", num_heads=4, num_kv_heads=2, head_dim=32, hidden_size=128,
                      intermediate_size=256, block_size=16, quant_format="none", group_size=None, speculative=True)
PLUGINS = ("kiln_rope_kv_write", "kiln_paged_prefill")
SM = 90
CAPTURED = (0,)      # hidden.0 is a graph output (an EAGLE-3 draft's auxiliary layer)
SOURCES = ("plugins/tensorrt/compile.py", "plugins/tensorrt/convention.py", "plugins/tensorrt/kernels.py",
           "plugins/tensorrt/ptx.py", "plugins/paged_prefill.py", "plugins/rope_kv.py", "plugins/common.py",
           "plugins/tuning.py")
_CHILD = """
import json, sys
from plugins.aot import shapes_from_dict
from plugins.tensorrt.compile import compile_all
from plugins.tensorrt.convention import TrtFloats
compile_all(shapes_from_dict(json.loads(sys.argv[1])), TrtFloats(1e-5), [int(sys.argv[4])], sys.argv[2],
            plugins=tuple(sys.argv[3].split(",")))
"""


def plugin_ptx() -> Path:
    """The plugins folder (sm90/<plugin>-<hash>.{ptx,json}) for SHAPES, compiled once and cached on disk."""
    import triton
    h = hashlib.sha256(json.dumps([dataclasses.asdict(SHAPES), PLUGINS, SM, triton.__version__]).encode())
    for src in SOURCES:
        h.update((ROOT / src).read_bytes())
    out = CACHE / f"trt-plugins-{h.hexdigest()[:12]}"
    if out.is_dir():
        return out
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=CACHE, prefix=".trt-plugins-"))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(dataclasses.asdict(SHAPES)), str(tmp),
                           ",".join(PLUGINS), str(SM)], env=env, cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    try:
        os.rename(tmp, out)
    except OSError:           # another process cached it first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def profiles_doc(draft: int) -> dict:
    """profiles.json with room for ``draft`` draft tokens per sequence (tree masks up to 1 + draft wide),
    laid out as builder/tensorrt/target.py writes it (which has no drafts yet: the export refuses
    speculation), for the runner's profile choice on verify steps."""
    e, m = ENGINE, MODEL
    ps = graph_io.profiles(e["max_batch_size"], e["max_num_tokens"], e["max_seq_len"], e["kv_block_size"], draft)
    inputs = {n: list(dims) for n, _, dims in graph_io.STEP_INPUTS}
    for i in range(m["num_layers"]):
        for name in (graph_io.k_cache(i), graph_io.v_cache(i)):
            inputs[name] = ["blocks", e["kv_block_size"], m["num_kv_heads"], m["head_dim"]]
    return {"profiles": [dataclasses.asdict(p) for p in ps], "inputs": inputs}


def make_bundle(root: Path, plugins: Path | None, draft: int = 0, trt_section: bool = True) -> Path:
    """A bundle folder at ``root``: random fp8 weights (harness.perf.lib.models), and with ``trt_section`` the
    real ONNX export's decoder.onnx (hidden.0 captured) and profiles.json (``draft`` > 0: profiles_doc's),
    the plugin PTX copied from ``plugins``; engine.json's files hashed, as the build writes them."""
    import onnx
    from safetensors.torch import save_file

    from builder.tensorrt.onnx_export import export_decoder
    from builder.tensorrt.target import profiles_doc as export_profiles
    from harness.perf.lib.models import synthetic_fp8_weights
    root.mkdir(parents=True)
    weights = synthetic_fp8_weights(MODEL, device="cpu", seed=1)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(root / bundle.WEIGHTS))
    doc = {"format": bundle.FORMAT, "format_version": 1, "model": MODEL, "engine": ENGINE,
           "quantization": {"format": "fp8", "kv_cache": "fp8"}}
    if trt_section:
        manifest = bundle.Manifest.from_dict(dict(doc, files={}))
        export_decoder(root, manifest, capture_layers=CAPTURED)
        graph = onnx.load(str(root / "decoder.onnx"), load_external_data=False)
        (root / "tensorrt").mkdir()
        profiles = profiles_doc(draft) if draft else export_profiles(manifest, graph)
        (root / "tensorrt" / "profiles.json").write_text(json.dumps(profiles, indent=1))
        if plugins is not None:
            shutil.copytree(plugins, root / "tensorrt" / "plugins")
        doc["tensorrt"] = {"graph": "decoder.onnx", "dir": "tensorrt", "opset": 21, "plugins": list(PLUGINS),
                           "sms": [SM]}
    bundle.write(root, bundle.Manifest.from_dict(dict(doc, files=bundle.file_hashes(root))))
    return root
