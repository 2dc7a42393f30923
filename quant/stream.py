"""Streamed quantization: one decoder layer resident at a time, exported shard by shard.

    streamed_export(hf_dir, out_dir, cfg, batches, progress, fp32_suffixes, device="cpu", dtype=None)
        -> (hf_quant, passes)

Why it gives the whole-model path's tensors: ModelOpt's `max` calibration (FP8, NVFP4, KV-only)
runs the forward loop with every quantizer collecting ranges and NOT quantizing, so the input of
layer i during a whole-model calibration is exactly the unquantized output of layer i-1. Here layer
i's inputs are those captured from layer i-1 (same fp32 arithmetic, same batches), its weights are
read tensor by tensor from the safetensors shards, it is quantized by the real `mtq.quantize` and
exported by the real `export_hf_checkpoint` inside a *shell* model: the real model class built on
the meta device, layers before i replaced by pass-throughs (so module and quantizer names, hence
`exclude` patterns and ModelOpt's q/k/v and gate/up scale fusion, are those of the whole model),
vocabulary cut to 2 (the shell's embedding and head are throw-aways). Algorithms that change the
weights or search over quantized forwards (AWQ, SmoothQuant) see different activations per layer
than a whole-model pass: `quant.recipes.Recipe.streamable` keeps them on the whole-model path.

On a GPU (`device="cuda"`, `dtype=torch.bfloat16`: what the whole-model GPU path calibrates in)
one layer's weights are copied to the device as it is reached, the captured activations stay there
when two copies fit beside a layer (else in host memory, each batch copied over for its forward),
and each layer's export comes back to the host through the files ModelOpt writes. The same code
runs with `device="cpu"`; in fp32 it is today's CPU path, bit for bit.

Host memory (CPU): one layer in fp32 plus its export, the embedding in the checkpoint dtype while the
calibration inputs are embedded, and two copies of the calibration activations (tokens x hidden x
4 bytes each): see `quant.memory`.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import io
import json
import math
import shutil
from pathlib import Path
from typing import Any, Callable

Progress = Callable[[str, int, int], None]
LAYER_PREFIX = "model.layers."
INDEX_FILE = "model.safetensors.index.json"


class StreamUnsupported(ValueError):
    """The checkpoint's architecture has no `model.layers` decoder stack the stream can walk."""


class Shards:
    """Lazy tensor access across an HF checkpoint's safetensors shards (nothing read up front)."""

    def __init__(self, hf_dir: Path):
        from safetensors import safe_open  # noqa: PLC0415

        self._where: dict[str, Path] = {}
        self._open = safe_open
        for shard in sorted(hf_dir.glob("*.safetensors")):
            with safe_open(str(shard), "pt") as f:
                for name in f.keys():
                    self._where[name] = shard
        if not self._where:
            raise FileNotFoundError(f"{hf_dir}: no *.safetensors shards")

    def names(self) -> list[str]:
        return list(self._where)

    def _sizes(self):
        """(name, elements) of every tensor, from the shard headers only."""
        for shard in sorted(set(self._where.values())):
            with self._open(str(shard), "pt") as f:
                for name in f.keys():
                    yield name, math.prod(f.get_slice(name).get_shape())

    def numel(self, prefix: str = "") -> int:
        """Elements of the tensors whose names start with `prefix`."""
        return sum(n for name, n in self._sizes() if name.startswith(prefix))

    def largest(self) -> int:
        """Elements of the largest tensor (the embedding, in a language model)."""
        return max(n for _, n in self._sizes())

    def get(self, name: str):
        with self._open(str(self._where[name]), "pt") as f:
            return f.get_tensor(name)


class _Captured(Exception):
    def __init__(self, kwargs: dict):
        super().__init__("captured")
        self.kwargs = kwargs


def _capture():
    import torch  # noqa: PLC0415

    class Capture(torch.nn.Module):
        """Stands in for layer 0: records what the model passes a decoder layer, then stops the pass."""

        def forward(self, hidden_states, *args, **kwargs):
            assert not args, "decoder layers take everything but the hidden states by keyword"
            raise _Captured(kwargs)

    return Capture()


def _pass_through():
    import torch  # noqa: PLC0415

    class PassThrough(torch.nn.Module):
        """A layer before the one being quantized: keeps its index in module names, does nothing."""

        def forward(self, hidden_states, *args, **kwargs):
            return hidden_states

    return PassThrough()


def hf_config(hf_dir: Path):
    from transformers import AutoConfig  # noqa: PLC0415

    config = AutoConfig.from_pretrained(str(hf_dir))
    # what from_pretrained picks on this torch: the whole-model path's attention arithmetic
    config._attn_implementation = "sdpa"
    return config


def meta_model(config, device: str = "cpu"):
    import torch  # noqa: PLC0415
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "rotary_emb"):
        raise StreamUnsupported(f"{type(model).__name__}: no model.layers / model.rotary_emb to stream")
    # rotary tables are computed, not stored: rebuild them where the layers run
    inner.rotary_emb = type(inner.rotary_emb)(config=config, device=device)
    return model


def activation_device(device: str, activation_bytes: int, layer_bytes: int, free_bytes: int | None = None) -> str:
    """Where the calibration activations live: on `device` when two copies of them (a layer's
    inputs and outputs) fit with room for a layer being quantized (its weights, ModelOpt's
    quantized copy and the export's: 4x) in 90% of the device's free memory; else on the host."""
    import torch  # noqa: PLC0415

    if torch.device(device).type == "cpu":
        return "cpu"
    if free_bytes is None:
        free_bytes = torch.cuda.mem_get_info(torch.device(device))[0]
    return device if 2 * activation_bytes + 4 * layer_bytes <= 0.9 * free_bytes else "cpu"


def layer_inputs(shards: Shards, config, batches: list, device: str, dtype) -> tuple[list, list[dict]]:
    """(hidden states per batch in `dtype`, on `device` or the host per `activation_device`; per
    batch the keyword arguments the model gives a layer (mask, position ids and rotary tables,
    computed by the model's own forward, on `device`)."""
    import torch  # noqa: PLC0415

    embed = shards.get("model.embed_tokens.weight")
    # Llama, Mistral and Qwen2 (Kiln's architectures) embed by a plain lookup, no scale; an fp32
    # lookup of bf16 rows = the whole-model path's lookup in its upcast fp32 table (in bf16: its
    # lookup in the bf16 table)
    hidden = [embed[ids].to(dtype) for ids in batches]
    del embed
    layer_bytes = shards.numel(f"{LAYER_PREFIX}0.") * dtype.itemsize
    store = activation_device(device, sum(h.numel() * h.element_size() for h in hidden), layer_bytes)
    hidden = [h.to(store) for h in hidden]
    model = meta_model(config, device)
    model.model.layers = torch.nn.ModuleList([_capture()])
    kwargs = []
    for h in hidden:
        try:
            with torch.no_grad():
                model.model(inputs_embeds=h.to(device), use_cache=False)
        except _Captured as c:
            kwargs.append(c.kwargs)
        else:
            raise StreamUnsupported(f"{type(model).__name__}: the decoder stack was never entered")
    return hidden, kwargs


def _shell(config, index: int, layer_tensors: dict, device: str, dtype):
    """The model class with layer `index` real (its weights as given), the layers before it
    pass-throughs, the throw-away embedding, norm and head on `device` in `dtype`."""
    import torch  # noqa: PLC0415

    shell_cfg = copy.deepcopy(config)
    shell_cfg.vocab_size = 2
    # special token ids must index the 2-row embedding
    shell_cfg.pad_token_id = shell_cfg.bos_token_id = shell_cfg.eos_token_id = None
    model = meta_model(shell_cfg, device)
    inner = model.model
    layer = inner.layers[index]
    missing, unexpected = layer.load_state_dict(layer_tensors, strict=False, assign=True)
    if missing or unexpected:
        raise StreamUnsupported(f"layer {index}: missing {missing[:4]}, unexpected {unexpected[:4]} tensors")
    inner.layers = torch.nn.ModuleList([_pass_through() for _ in range(index)] + [layer])
    hidden = config.hidden_size
    inner.embed_tokens = torch.nn.Embedding(2, hidden, device=device, dtype=dtype)
    inner.norm = type(inner.norm)(hidden, eps=getattr(config, "rms_norm_eps", 1e-6)).to(device=device, dtype=dtype)
    model.lm_head = torch.nn.Linear(hidden, 2, bias=False, device=device, dtype=dtype)
    if getattr(config, "tie_word_embeddings", False):
        model.lm_head.weight = inner.embed_tokens.weight  # the export checks declared ties
    model.config.architectures = list(config.architectures or [type(model).__name__])
    leftover = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    assert not leftover, f"shell tensors still on meta: {leftover[:4]}"
    return model.eval(), layer


def _quantize_layer(config, index: int, tensors: dict, cfg: dict, inputs: list, kwargs: list,
                    out_dir: Path, keep_outputs: bool, device: str, dtype) -> tuple[list, dict, int]:
    """Calibrate and export layer `index` (its `tensors` already on `device` in `dtype`); returns
    (its outputs per batch, each where its input was kept, hf_quant, passes)."""
    import modelopt.torch.quantization as mtq  # noqa: PLC0415
    import torch  # noqa: PLC0415
    from modelopt.torch.export import export_hf_checkpoint  # noqa: PLC0415

    model, layer = _shell(config, index, tensors, device, dtype)
    outputs: list = []
    passes = [0]

    def forward_loop(_m) -> None:
        passes[0] += 1
        with torch.no_grad():
            for h, kw in zip(inputs, kwargs):
                out = layer(h.to(device), **kw)
                out = out[0] if isinstance(out, tuple) else out
                # `max` calibration runs once with quantizers only observing: these are the
                # unquantized outputs the whole-model pass would feed to the next layer
                if keep_outputs and passes[0] == 1:
                    outputs.append(out.to(h.device))

    # ModelOpt prints its config and quantizer count per call: once (layer 0) says it all
    quiet = contextlib.redirect_stdout(io.StringIO()) if index else contextlib.nullcontext()
    with quiet:
        model = mtq.quantize(model, cfg, forward_loop)
        export_hf_checkpoint(model, dtype=torch.bfloat16, export_dir=str(out_dir))
    hf_quant = json.loads((out_dir / "hf_quant_config.json").read_text())["quantization"]
    return outputs, hf_quant, passes[0]


def _bf16(t):
    import torch  # noqa: PLC0415

    # what the whole-model path stores: loaded in fp32 (an exact upcast), exported in bf16
    if not t.is_floating_point() or t.dtype == torch.bfloat16:
        return t
    return t.to(torch.float32).to(torch.bfloat16)


def streamed_export(hf_dir: Path, out_dir: Path, cfg: dict, batches: list, progress: Progress,
                    fp32_suffixes: tuple[str, ...], device: str = "cpu", dtype=None) -> tuple[dict, int]:
    """Write the unified HF checkpoint of `hf_dir` quantized per `cfg` into `out_dir` (which
    exists and is empty): one safetensors shard per decoder layer and one per other tensor, an index,
    config.json and hf_quant_config.json. Layers are calibrated on `device` in `dtype` (fp32 when
    None). Returns (hf_quant_config's "quantization", passes)."""
    import torch  # noqa: PLC0415
    from safetensors.torch import load_file, save_file  # noqa: PLC0415

    shards = Shards(hf_dir)
    config = hf_config(hf_dir)
    n_layers = config.num_hidden_layers
    names = shards.names()
    dtype = dtype or torch.float32
    hidden, kwargs = layer_inputs(shards, config, batches, device, dtype)
    weight_map: dict[str, str] = {}
    exclude_modules: set[str] = set()
    hf_quant: dict = {}
    passes = 0
    work = out_dir / ".layer-export"
    for i in range(n_layers):
        prefix = f"{LAYER_PREFIX}{i}."
        tensors = {n[len(prefix):]: shards.get(n).to(device=device, dtype=dtype) for n in names
                   if n.startswith(prefix)}
        shutil.rmtree(work, ignore_errors=True)
        hidden_next, hf_quant, passes = _quantize_layer(config, i, tensors, cfg, hidden, kwargs, work,
                                                        i + 1 < n_layers, device, dtype)
        del tensors
        hidden = hidden_next
        # The shell, its ModelOpt quantizers and the layer's fp32 weights form reference cycles:
        # collect them now, or a layer or two of weights may linger until the cyclic collector runs
        gc.collect()
        exported = {}
        for shard in sorted(work.glob("*.safetensors")):
            for n, t in load_file(str(shard)).items():
                if n.startswith(prefix):
                    keep_fp32 = t.dtype == torch.float32 and n.endswith(fp32_suffixes)
                    exported[n] = t if keep_fp32 or t.dtype != torch.float32 else t.to(torch.bfloat16)
        exclude_modules.update(m for m in hf_quant.get("exclude_modules", []) if m.startswith(prefix))
        if i == 0:
            side_config = json.loads((work / "config.json").read_text())
            side_hf_quant = json.loads((work / "hf_quant_config.json").read_text())
        fname = f"model-layer-{i:05d}.safetensors"
        save_file(exported, str(out_dir / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(exported, fname))
        progress("quantize layers", i + 1, n_layers)
    shutil.rmtree(work, ignore_errors=True)
    del hidden

    # One file per non-layer tensor (embedding, final norm, untied head): only the largest of them
    # is ever resident, where one file for all would hold them together (GBs for a 128k vocabulary)
    rest = [n for n in names if not n.startswith(LAYER_PREFIX)]
    if getattr(config, "tie_word_embeddings", False) and "lm_head.weight" in rest:
        rest.remove("lm_head.weight")  # the export drops tied duplicates
    for j, n in enumerate(rest):
        fname = f"model-rest-{j:05d}.safetensors"
        save_file({n: _bf16(shards.get(n))}, str(out_dir / fname), metadata={"format": "pt"})
        weight_map[n] = fname
    (out_dir / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2) + "\n")

    # Non-layer modules ModelOpt lists as excluded in a whole-model export (lm_head and the like)
    exclude_modules.update(m for m in hf_quant.get("exclude_modules", []) if not m.startswith(LAYER_PREFIX))
    hf_quant = dict(hf_quant, exclude_modules=sorted(exclude_modules))
    _write_configs(config, out_dir, side_config, side_hf_quant, hf_quant)
    return hf_quant, passes


def _write_configs(config, out_dir: Path, layer_config: dict, layer_hf_quant: dict, hf_quant: dict) -> None:
    """config.json: the source config serialized as the whole-model export serializes it, plus
    the quantization_config ModelOpt wrote for a layer (its `ignore` list rebuilt from the merged
    exclusions); hf_quant_config.json: ModelOpt's, with the merged exclusions."""
    config.save_pretrained(str(out_dir))
    cfg: dict[str, Any] = json.loads((out_dir / "config.json").read_text())
    qc = dict(layer_config.get("quantization_config", {}))
    if "ignore" in qc:
        qc["ignore"] = list(hf_quant["exclude_modules"])
    if qc:
        cfg["quantization_config"] = qc
    for key in ("dtype", "torch_dtype"):
        if key in cfg:
            cfg[key] = "bfloat16"
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    full = dict(layer_hf_quant, quantization=hf_quant)
    (out_dir / "hf_quant_config.json").write_text(json.dumps(full, indent=4))
