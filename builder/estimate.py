"""Per-stage memory and time of a build, before there is a checkpoint: ``python -m builder.estimate``.

    python -m builder.estimate configs/llama70b-fp8.yaml --device h200 [--shape llama-2-70b] [key=value ...]

Prints what the pipeline would print before each stage (the same functions: each stage's
``memory_estimate`` / ``quant.memory`` and ``builder.estimates``) as a table, for a machine you do
not have yet. When ``model.source`` is an HF folder here, its real headers are read; otherwise the
shape comes from ``SHAPES`` (the published config.json of the checkpoints the shipped configs name),
written as a header-only checkpoint: real safetensors headers over a sparse data section, so the
formulas read exactly what they would read from the real files and nothing takes disk space.

Devices (``DEVICES``): quantize is timed on the GPU (streamed, one layer resident); import, compile and
verify with this 2-core machine's constants (verify.device auto streams verify on a GPU host too, not
timed there yet, so its figure is an upper bound). The build's stages run on one GPU (quantization
is not split across GPUs): on 8x H100 its figures are one H100's. The serving note divides the
weights and KV by ``engine.tp_size`` (each rank holds 1/tp of them) and, when one GPU's share
is too little, names the smallest tp_size the model splits into that fits.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import struct
import sys
import tempfile
from pathlib import Path

from builder import estimates
from builder.memory import GiB

# config.json of the checkpoints the shipped configs name (Hugging Face, as published)
_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
          "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
          "bos_token_id": 1, "eos_token_id": 2}
SHAPES: dict[str, dict] = {
    "llama-2-70b": dict(_LLAMA, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                        num_attention_heads=64, num_key_value_heads=8, vocab_size=32000,
                        max_position_embeddings=4096, torch_dtype="float16"),
    "llama-3.1-8b": dict(_LLAMA, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                         max_position_embeddings=131072, torch_dtype="bfloat16", rope_theta=500000.0,
                         bos_token_id=128000, eos_token_id=128009),
}
_QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu", "head_dim": 128,
          "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False, "attention_dropout": 0.0,
          "bos_token_id": 151643, "eos_token_id": 151645, "vocab_size": 151936, "max_position_embeddings": 40960,
          "rope_theta": 1000000, "rope_scaling": None, "sliding_window": None, "use_sliding_window": False,
          "initializer_range": 0.02, "use_cache": True, "torch_dtype": "bfloat16"}
SHAPES.update({
    "qwen3-8b": dict(_QWEN3, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, max_window_layers=36),
    "qwen3-32b": dict(_QWEN3, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
                      num_key_value_heads=8, max_window_layers=64),
})
# Gemma 3 27B's language model (published as Gemma3ForConditionalGeneration: its text_config, which the
# import stage builds as Gemma3ForCausalLM, builder/text_part.py; the vision tower is left out)
SHAPES["gemma3-27b"] = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 5376, "intermediate_size": 21504,
    "num_hidden_layers": 62, "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 128,
    "query_pre_attn_scalar": 168, "sliding_window": 1024, "sliding_window_pattern": 6, "vocab_size": 262208,
    "max_position_embeddings": 131072, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
    "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "rms_norm_eps": 1e-6,
    "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True, "final_logit_softcapping": None,
    "attn_logit_softcapping": None, "bos_token_id": 2, "eos_token_id": [1, 106], "pad_token_id": 0,
    "torch_dtype": "bfloat16"}
# model.source folder name -> shape, for the configs that name these checkpoints
SOURCE_SHAPES = {"Llama-2-70b-chat-hf": "llama-2-70b", "Llama-3.1-8B-Instruct": "llama-3.1-8b",
                 "Qwen3-8B": "qwen3-8b", "Qwen3-32B": "qwen3-32b", "gemma-3-27b-it": "gemma3-27b"}
# peak RSS of an HF-folder import (files linked, sha256 streamed): 41 MiB measured at 1.5 and 2.6 GB
# (docs/perf/build-memory.json); rounded up, it does not grow with the checkpoint
IMPORT_HF_HOST_BYTES = 128 << 20
# bytes per weight of a quantized linear in the bundle (scales included), for the serving note
SHARD_BYTES = 5 * 10**9
WEIGHT_BYTES = {"none": 2.0, "fp8": 1.0, "nvfp4": 0.5 + 1 / 16}


@dataclasses.dataclass(frozen=True)
class Device:
    name: str
    gpu_bytes: int          # memory of the one GPU a build uses (0: CPU only)
    note: str


DEVICES = {
    "cpu": Device("CPU only", 0, "every stage on the CPU"),
    "h100": Device("one H100 80GB", 80 * 10**9, "quantize on the GPU"),
    "h200": Device("one H200", 141 * 10**9, "quantize on the GPU"),
    "8xh100": Device("8x H100 80GB", 80 * 10**9,
                     "quantize on ONE of the 8 GPUs: the build does not split quantization; engine.tp_size splits serving"),
}


def _role_dims(shape: dict) -> dict[str, list[int]]:
    """A layer tensor's [out, in] by its role in the family tables (builder/families)."""
    h, inter = shape["hidden_size"], shape["intermediate_size"]
    d = shape.get("head_dim") or h // shape["num_attention_heads"]
    q, kv = shape["num_attention_heads"] * d, shape["num_key_value_heads"] * d
    return {"q_proj": [q, h], "k_proj": [kv, h], "v_proj": [kv, h], "o_proj": [h, q],
            "qkv_proj": [q + 2 * kv, h], "gate_proj": [inter, h], "up_proj": [inter, h],
            "gate_up_proj": [2 * inter, h], "down_proj": [h, inter], "q_norm": [d], "k_norm": [d]}


def header_checkpoint(shape: dict, out: Path) -> Path:
    """config.json + safetensors shards with the shape's tensors, named as its family's checkpoints name
    them (``layer_tensors``; every norm [hidden] but the per-head q/k norms): real headers, sparse data."""
    from builder.families import BY_ARCHITECTURE  # noqa: PLC0415

    family = BY_ARCHITECTURE[shape["architectures"][0]]
    h, n, v = (shape[k] for k in ("hidden_size", "num_hidden_layers", "vocab_size"))
    dims = _role_dims(shape)
    tensors = [("model.embed_tokens.weight", [v, h])]
    for i in range(n):
        tensors += [(name + ".weight", dims.get(role, [h])) for role, name in family.layer_tensor_names(i).items()]
    tensors.append(("model.norm.weight", [h]))
    if not shape.get("tie_word_embeddings", False):
        tensors.append(("lm_head.weight", [v, h]))
    dtype = {"float16": "F16", "bfloat16": "BF16"}[shape["torch_dtype"]]
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(shape, indent=1))
    # shards of at most SHARD_BYTES, as HF writes them: safetensors maps a whole file, and one map of
    # 140 GB is refused where the address space is limited
    shards: list[list] = [[]]
    size_of = {name: 2 * math.prod(dims) for name, dims in tensors}
    for name, dims in tensors:
        if shards[-1] and sum(size_of[n] for n, _ in shards[-1]) + size_of[name] > SHARD_BYTES:
            shards.append([])
        shards[-1].append((name, dims))
    for i, part in enumerate(shards):
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name, dims in part:
            header[name] = {"dtype": dtype, "shape": dims, "data_offsets": [offset, offset + size_of[name]]}
            offset += size_of[name]
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with open(out / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors", "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            f.truncate(8 + len(raw) + offset)   # a hole: no blocks written
    return out


def rows(cfg, hf_dir: Path, device: Device, source_bytes: int) -> list[tuple[str, int, int, estimates.TimeEstimate | None, str]]:
    """(stage, host bytes, GPU bytes, time, what dominates) for every stage the config runs."""
    from builder.stages import compile as compile_stage, draft, verify  # noqa: PLC0415
    from builder.stages.base import StageContext, StageResult  # noqa: PLC0415
    from quant.memory import quantize_memory  # noqa: PLC0415

    cuda = device.gpu_bytes > 0
    imp = estimates.import_seconds(source_bytes, "hf")
    out = [("import", IMPORT_HF_HOST_BYTES, 0, imp, "files linked, sha256 streamed")]
    q = cfg.quantization
    if q.format != "none" or q.kv_cache != "none":
        m = quantize_memory(hf_dir, q, cuda=cuda)
        out.append(("quantize", m.host_bytes, m.gpu_bytes, estimates.quantize_time(hf_dir, q, cuda), m.detail))
    ctx = StageContext(cfg, "estimate", hf_dir, hf_dir, {"import": StageResult("import", "built", hf_dir, "", {})},
                       log=lambda _m: None)
    if cfg.speculative.method != "none":
        d = draft.memory_estimate(ctx)
        out.append(("draft", d.host_bytes, d.gpu_bytes, None, d.detail))
    c = compile_stage.memory_estimate(ctx)
    out.append(("compile", c.host_bytes, c.gpu_bytes, estimates.compile_time(hf_dir), c.detail))
    if cfg.verify.enabled:
        v = verify.memory_estimate(ctx)
        t = estimates.verify_time(hf_dir, verify.choose_path(ctx), cfg.verify.num_prompts)
        out.append(("verify", v.host_bytes, v.gpu_bytes, t, v.detail))
    out.append(("package", IMPORT_HF_HOST_BYTES, 0, estimates.TimeEstimate(estimates.PACKAGE_S, "cpu", ""),
                "templates"))
    return out


def serving_note(cfg, hf_dir: Path, device: Device) -> str:
    """The bundle's weights on the device's one GPU and the KV-cache room they leave (before
    activations and the CUDA context, a few GB). Under a quarter of the GPU left is called too
    little: that is the design's line for the 70B on an H100 (configs/llama70b-fp8.yaml)."""
    from backend.runtime.tp_rules import allowed_tp_sizes, kv_heads_per_rank  # noqa: PLC0415
    from quant.stream import LAYER_PREFIX, Shards  # noqa: PLC0415

    per = WEIGHT_BYTES.get(cfg.quantization.format)
    if per is None or not device.gpu_bytes:
        return ""
    shape = json.loads((hf_dir / "config.json").read_text())
    shards = Shards(hf_dir)
    layers = shards.numel(LAYER_PREFIX)
    tp = cfg.engine.tp_size
    # per GPU: every sharded tensor (all but the norms, a rounding error; k/v rows replicated over more
    # GPUs than KV heads add a few percent) and the KV heads split tp ways, or one per GPU where fewer
    weights = (layers * per + (shards.numel() - layers) * 2) / tp
    left = device.gpu_bytes - weights
    head_dim = shape.get("head_dim") or shape["hidden_size"] // shape["num_attention_heads"]
    kv_token = (shape["num_hidden_layers"] * 2 * kv_heads_per_rank(shape["num_key_value_heads"], tp) * head_dim
                * (1 if cfg.quantization.kv_cache == "fp8" else 2))
    tokens = max(0, left) / kv_token

    def fits(t: int) -> bool:
        return device.gpu_bytes - weights * tp / t > 0.25 * device.gpu_bytes
    if fits(tp):
        verdict = "fits one GPU" if tp == 1 else f"fits {tp} GPUs (engine.tp_size {tp})"
    else:
        dims = {"num_heads": shape["num_attention_heads"], "num_kv_heads": shape["num_key_value_heads"],
                "intermediate_size": shape["intermediate_size"], "vocab_size": shape["vocab_size"]}
        need = next((t for t in allowed_tp_sizes(dims) if t > tp and fits(t)), None)
        verdict = f"too little: build with engine.tp_size {need}" if need else "too little: no tp_size fits"
    per_gpu = "" if tp == 1 else " per GPU"
    return (f"serving: ~{weights / 1e9:.0f} GB of {cfg.quantization.format} weights{per_gpu}; {left / 1e9:.0f} of "
            f"{device.gpu_bytes / 1e9:.0f} GB left, KV room ~{tokens / 1000:.0f}k tokens "
            f"(~{tokens / cfg.engine.max_seq_len:.0f} x {cfg.engine.max_seq_len}): {verdict}")


def table(cfg, hf_dir: Path, device: Device, source_bytes: int, prefix: str = "") -> list[str]:
    """The estimate as text lines (``prefix`` '# ' renders them as a YAML comment)."""
    lines = [f"{device.name} ({device.note}):",
             f"  {'stage':<9} {'host RAM':>9} {'GPU':>9}  time"]
    total = 0.0
    for stage, host, gpu, t, _detail in rows(cfg, hf_dir, device, source_bytes):
        total += t.seconds if t else 0.0
        where = "" if t is None else (" GPU" if t.device == "cuda" else " CPU")
        lines.append(f"  {stage:<9} {host / GiB:>5.1f} GiB {gpu / GiB:>5.1f} GiB  "
                     f"{estimates.duration(t.seconds) + where if t else 'not estimated'}")
    lines.append(f"  {'total':<9} {'':>9} {'':>9}  {estimates.duration(total)}")
    note = serving_note(cfg, hf_dir, device)
    if note:
        lines.append(f"  {note}")
    return [(prefix + line).rstrip() for line in lines]


def _source_bytes(hf_dir: Path) -> int:
    return sum(f.stat().st_size for f in hf_dir.iterdir() if f.is_file())


def estimate(config: str, devices: list[str], shape: str | None = None, overrides=(), prefix: str = "") -> list[str]:
    from builder.config import BuildConfig  # noqa: PLC0415

    cfg = BuildConfig.from_yaml(config, list(overrides))
    source = Path(cfg.model.source).expanduser()
    name = shape or SOURCE_SHAPES.get(source.name)
    with tempfile.TemporaryDirectory(prefix="kiln-estimate-") as tmp:
        if shape is None and (source / "config.json").is_file():
            hf_dir = source
        elif name in SHAPES:
            hf_dir = header_checkpoint(SHAPES[name], Path(tmp))
        else:
            raise SystemExit(f"error: {config}: model.source {source} is not here and names no known shape; "
                             f"allowed: --shape {' | '.join(SHAPES)}")
        lines = []
        for d in devices:
            lines += table(cfg, hf_dir, DEVICES[d], _source_bytes(hf_dir), prefix)
        return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m builder.estimate", description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*", help="key=value config overrides")
    ap.add_argument("--device", choices=list(DEVICES), action="append",
                    help="repeatable (default: h200 and 8xh100)")
    ap.add_argument("--shape", choices=list(SHAPES), help="model shape when model.source is not here")
    ap.add_argument("--comment", action="store_true", help="print as a YAML comment block")
    a = ap.parse_args(argv)
    lines = estimate(a.config, a.device or ["h200", "8xh100"], a.shape, a.overrides, "# " if a.comment else "")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
