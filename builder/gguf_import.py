"""GGUF (llama / mistral / qwen2 / qwen3 / gemma3) -> HF checkpoint in ONE pass over the file.

transformers' GGUF path parses the file four to five times (config, tensors, tokenizer twice) and
rebuilds gguf's TensorNameMap per tensor: ~100 s for a 100 MB file on a busy 2-core machine, and
``from_pretrained(gguf_file=...)`` additionally requires accelerate. Here the header is read once
with ``struct``, tensors are dequantized with ``gguf.quants.dequantize`` (builder/gguf_dequant.py)
and transformers is used only for its key tables and, for the llama family, its tokenizer converter,
so the result is the same checkpoint transformers produces (the import tests compare it). Gemma 3's
tokenizer is Kiln's own (builder/gguf_tokenizer.py): transformers' conversion of it is wrong.

Qwen3's per-head q/k norms are llama.cpp's ``attn_q_norm`` / ``attn_k_norm``; its head size is not
hidden / heads, so it is read from ``qwen3.attention.key_length`` (transformers' GGUF key table leaves it
out and relies on Qwen3Config's default of 128).
"""
from __future__ import annotations

import dataclasses
import json
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np
import torch

from builder.stages.base import StageError

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NP = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
       7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_PROJECTIONS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", **_PROJECTIONS}
# Gemma 3 has four norms a layer: llama.cpp's ffn_norm is the norm BEFORE the MLP here (gguf's own
# TensorNameMap for MODEL_ARCH.GEMMA3 gives the same pairs; a test checks it)
GEMMA3_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm", **_PROJECTIONS,
}
QWEN3_LAYER_NAMES = {**LAYER_NAMES, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
IGNORED = {"rope_freqs"}  # llama3 rope table: HF recomputes it from the config


@dataclasses.dataclass(frozen=True)
class Family:
    hf_class: str                # config.json's architectures
    model_type: str              # transformers' config class
    layer_names: dict[str, str]  # blk.N.<gguf name> -> model.layers.N.<HF name>
    permute_qk: bool             # llama.cpp interleaved each head's rotary halves of q/k (llama only)
    norm_offset: float           # subtracted from every norm weight: llama.cpp stores Gemma's (1 + w)


FAMILIES = {
    "llama": Family("LlamaForCausalLM", "llama", LAYER_NAMES, True, 0.0),
    "mistral": Family("MistralForCausalLM", "mistral", LAYER_NAMES, False, 0.0),
    "qwen2": Family("Qwen2ForCausalLM", "qwen2", LAYER_NAMES, False, 0.0),
    "qwen3": Family("Qwen3ForCausalLM", "qwen3", QWEN3_LAYER_NAMES, False, 0.0),
    # Gemma's RMSNorm multiplies by (1 + w) and llama.cpp's converter adds the 1 in; HF's Gemma3RMSNorm
    # holds w. Its rope is NEOX-style (halves, as HF's): q/k were written unpermuted.
    "gemma3": Family("Gemma3ForCausalLM", "gemma3_text", GEMMA3_LAYER_NAMES, False, 1.0),
}


class _Reader:
    def __init__(self, path: Path):
        self.fh = open(path, "rb")
        self.size = os.fstat(self.fh.fileno()).st_size

    def bound(self, n: int, what: str) -> int:
        """Refuse a length larger than the bytes left: a corrupt 2^40 would raise MemoryError in read(),
        2^63 OverflowError, instead of the one-line "unreadable GGUF" error."""
        left = self.size - self.fh.tell()
        if n > left:
            raise ValueError(f"{what} {n} exceeds the {left} bytes left in the file")
        return n

    def read(self, fmt: str):
        size = struct.calcsize(fmt)
        raw = self.fh.read(size)
        if len(raw) < size:
            raise ValueError("file ends inside the header")
        return struct.unpack(fmt, raw)[0]

    def string(self) -> str:
        n = self.bound(self.read("<Q"), "string length")
        raw = self.fh.read(n)
        if len(raw) < n:
            raise ValueError("file ends inside the header")
        return raw.decode("utf-8", "replace")

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.read(_SCALARS[vtype])
        if vtype == 8:
            return self.string()
        if vtype == 9:
            item, count = self.read("<I"), self.bound(self.read("<Q"), "array length")  # items take >= 1 byte
            if item in _NP:  # numeric arrays in one read
                dt = np.dtype(_NP[item])
                raw = self.fh.read(self.bound(dt.itemsize * count, "array size"))
                if len(raw) < dt.itemsize * count:
                    raise ValueError("file ends inside the header")
                return np.frombuffer(raw, dtype=dt).tolist()
            return [self.value(item) for _ in range(count)]
        raise ValueError(f"unknown GGUF value type {vtype}")


def read_header(path: Path) -> tuple[dict[str, Any], list[tuple[str, list[int], int, int]], int]:
    """(metadata, [(name, torch shape, ggml type, offset)], absolute data start)."""
    r = _Reader(path)
    try:
        if r.fh.read(4) != b"GGUF":
            raise ValueError("bad magic (not a GGUF file)")
        version = r.read("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (supported: 2, 3)")
        n_tensors, n_kv = r.bound(r.read("<Q"), "tensor count"), r.bound(r.read("<Q"), "metadata count")
        meta = {}
        for _ in range(n_kv):
            key = r.string()
            meta[key] = r.value(r.read("<I"))
        tensors = []
        for _ in range(n_tensors):
            name = r.string()
            n_dims = r.read("<I")
            if n_dims > 4:  # GGML_MAX_DIMS
                raise ValueError(f"tensor {name[:60]!r} has {n_dims} dimensions (at most 4)")
            dims = [r.read("<Q") for _ in range(n_dims)]
            tensors.append((name, dims[::-1], r.read("<I"), r.read("<Q")))  # GGUF lists dims innermost first
        align = meta.get("general.alignment", 32)
        if not isinstance(align, int) or isinstance(align, bool) or not 0 < align <= 1 << 20:
            raise ValueError(f"general.alignment {align!r} is not a positive integer up to 2^20")
        pos = r.fh.tell()
        return meta, tensors, pos + (-pos % align)
    finally:
        r.fh.close()


def _reverse_rope_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    # llama.cpp's converter interleaves each head's rotary halves for its rope kernel; undo it
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_name(name: str, arch: str) -> str | None:
    parts = name.split(".")
    if parts[0] in IGNORED:
        return None
    layer_names = FAMILIES[arch].layer_names
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[parts[0]]}.{parts[1]}"
    raise StageError(f"unexpected GGUF tensor {name!r} for a {arch} model")


# gemma3.<key> -> Gemma3TextConfig field
_GEMMA3_CONFIG = {
    "context_length": "max_position_embeddings", "embedding_length": "hidden_size",
    "block_count": "num_hidden_layers", "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads", "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim", "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.sliding_window": "sliding_window", "final_logit_softcapping": "final_logit_softcapping",
    "attn_logit_softcapping": "attn_logit_softcapping",
}
# read below, not copied one to one
_GEMMA3_OTHER = {"attention.value_length", "rope.dimension_count", "rope.freq_base", "rope.freq_base_swa",
                 "rope.scaling.type", "rope.scaling.factor"}
_GEMMA3_REQUIRED = ("embedding_length", "block_count", "feed_forward_length", "attention.head_count",
                    "attention.head_count_kv", "attention.key_length", "attention.sliding_window")


def gemma3_config(path: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """Gemma3TextConfig keyword arguments from a gemma3 GGUF's metadata; a key that would change the
    model's math and is not understood here is refused, naming it."""
    hf: dict[str, Any] = {}
    for key, value in meta.items():
        suffix = key.removeprefix("gemma3.")
        if suffix == key:
            continue
        if suffix in _GEMMA3_CONFIG:
            hf[_GEMMA3_CONFIG[suffix]] = value
        elif suffix not in _GEMMA3_OTHER:
            raise StageError(f"{path}: GGUF field {key} = {value!r} is not understood for gemma3; allowed: "
                             f"{', '.join(sorted(f'gemma3.{k}' for k in (*_GEMMA3_CONFIG, *_GEMMA3_OTHER)))}")
    missing = [f"gemma3.{k}" for k in _GEMMA3_REQUIRED if f"gemma3.{k}" not in meta]
    if missing:
        raise StageError(f"{path}: GGUF metadata lacks {', '.join(missing)}; the file is not a complete "
                         f"gemma3 model")
    head_dim = hf["head_dim"]
    for key in ("attention.value_length", "rope.dimension_count"):
        if meta.get(f"gemma3.{key}", head_dim) != head_dim:
            raise StageError(f"{path}: GGUF field gemma3.{key} = {meta[f'gemma3.{key}']!r} differs from "
                             f"gemma3.attention.key_length {head_dim}; allowed: equal (Gemma 3's heads)")
    layers, heads = hf["num_hidden_layers"], hf["num_attention_heads"]
    full = {"rope_type": "default", "rope_theta": float(meta.get("gemma3.rope.freq_base", 1_000_000.0))}
    scaling = meta.get("gemma3.rope.scaling.type", "none")
    if scaling == "linear":   # Gemma 3 4B and larger: global layers' positions divided by the factor
        full.update(rope_type="linear", factor=float(meta.get("gemma3.rope.scaling.factor", 1.0)))
    elif scaling != "none":
        raise StageError(f"{path}: GGUF field gemma3.rope.scaling.type = {scaling!r}; allowed: none, linear")
    # What a gemma3 GGUF does not carry, llama.cpp's runtime fixes as Google's configs have it: five
    # sliding layers, then one global; sliding layers' rope base 10k; queries scaled by head_dim^-0.5,
    # except the 27B (62 layers), scaled by (hidden / heads)^-0.5.
    hf["layer_types"] = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)]
    hf["rope_parameters"] = {"full_attention": full, "sliding_attention": {
        "rope_type": "default", "rope_theta": float(meta.get("gemma3.rope.freq_base_swa", 10_000.0))}}
    hf["query_pre_attn_scalar"] = hf["hidden_size"] // heads if layers == 62 else head_dim
    hf["hidden_activation"] = "gelu_pytorch_tanh"
    tokens = meta.get("tokenizer.ggml.tokens") or []
    hf["vocab_size"] = len(tokens)
    for gguf_key, key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                          ("padding_token_id", "pad_token_id")):
        if isinstance(meta.get(f"tokenizer.ggml.{gguf_key}"), int):
            hf[key] = meta[f"tokenizer.ggml.{gguf_key}"]
    return hf


def convert(path: Path, arch: str, out: Path, dtype: torch.dtype, progress=lambda n=1: None) -> dict:
    """Write model.safetensors, config.json, generation_config.json and tokenizer files into out."""
    from builder.gguf_dequant import check_tensors, dequantize

    try:
        meta, infos, data_start = read_header(path)
    except (ValueError, struct.error, OSError, RecursionError) as e:  # RecursionError: nested arrays
        raise StageError(f"{path}: unreadable GGUF ({e}); the file may be truncated or corrupted") from None
    check_tensors(path, infos, data_start)   # fail before importing transformers and dequantizing

    from safetensors.torch import save_file
    from transformers import AutoConfig

    gguf_arch = meta.get("general.architecture")
    if gguf_arch not in FAMILIES:
        raise StageError(f"{path}: GGUF architecture '{gguf_arch}' is not supported; allowed: "
                         f"{', '.join(FAMILIES)}")
    family = FAMILIES[gguf_arch]
    names = {n for n, *_ in infos}
    if gguf_arch == "gemma3":
        hf = gemma3_config(path, meta)
    else:
        hf, tok, tok_cfg = _llama_family_config(meta, gguf_arch)
        if gguf_arch == "qwen3":
            hf["head_dim"] = _head_dim(path, meta, gguf_arch)
    hf["tie_word_embeddings"] = "output.weight" not in names

    state: dict[str, torch.Tensor] = {}
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    for info in infos:
        name = info[0]
        hf_name = _hf_name(name, gguf_arch)
        if hf_name is None:
            continue
        values = dequantize(mm, info, data_start, path)
        if family.norm_offset and name.split(".")[-2].endswith("norm"):
            values -= family.norm_offset   # in float32, before the cast, as transformers' loader does
        t = torch.from_numpy(values).to(dtype)
        if family.permute_qk and hf_name.endswith("q_proj.weight"):
            t = _reverse_rope_permute(t, hf["num_attention_heads"])
        elif family.permute_qk and hf_name.endswith("k_proj.weight"):
            t = _reverse_rope_permute(t, hf.get("num_key_value_heads", hf["num_attention_heads"]))
        state[hf_name] = t.contiguous()
        progress(1)
    del mm
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})

    config = AutoConfig.for_model(family.model_type if gguf_arch == "gemma3" else arch, **hf)
    config.architectures = [family.hf_class]
    config.dtype = str(dtype).removeprefix("torch.")
    config.to_json_file(str(out / "config.json"))
    gen = {k: hf[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in hf}
    tokens = meta.get("tokenizer.ggml.tokens") or []
    if gguf_arch == "gemma3" and "<end_of_turn>" in tokens and isinstance(gen.get("eos_token_id"), int):
        # a Gemma chat turn ends with <end_of_turn>, which the GGUF's metadata does not name: Google's own
        # generation_config stops on it beside <eos>, so the bundle's stop tokens are both
        gen["eos_token_id"] = [gen["eos_token_id"], tokens.index("<end_of_turn>")]
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")

    if gguf_arch == "gemma3":
        from builder.gguf_tokenizer import TokenizerMetadataError, save_tokenizer

        try:
            save_tokenizer(meta, out)
        except TokenizerMetadataError as e:
            raise StageError(f"{path}: {e}") from None
    else:
        _save_llama_family_tokenizer(gguf_arch, tok, tok_cfg, out)
    return {"tensors": len(state), "gguf_architecture": gguf_arch}


def _head_dim(path: Path, meta: dict, arch: str) -> int:
    """The attention head size a GGUF states (``<arch>.attention.key_length``, equal to value_length)."""
    key, value = meta.get(f"{arch}.attention.key_length"), meta.get(f"{arch}.attention.value_length")
    if not isinstance(key, int) or key <= 0:
        raise StageError(f"{path}: GGUF field {arch}.attention.key_length = {key!r}; allowed: the head size "
                         f"(a positive integer), which a {arch} model must state")
    if value is not None and value != key:
        raise StageError(f"{path}: GGUF field {arch}.attention.value_length = {value!r} differs from "
                         f"{arch}.attention.key_length {key}; allowed: equal")
    return key


def _llama_family_config(meta: dict, gguf_arch: str) -> tuple[dict, dict, dict]:
    """(config kwargs, tokenizer fields, tokenizer_config fields) through transformers' key tables."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING, GGUF_TOKENIZER_MAPPING

    hf: dict[str, Any] = {}
    for suffix, key in GGUF_CONFIG_MAPPING[gguf_arch].items():
        if key and f"{gguf_arch}.{suffix}" in meta:
            hf[key] = meta[f"{gguf_arch}.{suffix}"]
    tok_map, tok_cfg_map = GGUF_TOKENIZER_MAPPING["tokenizer"], GGUF_TOKENIZER_MAPPING["tokenizer_config"]
    tok = {v: meta[f"tokenizer.{k}"] for k, v in tok_map.items() if f"tokenizer.{k}" in meta}
    tok_cfg = {v: meta[f"tokenizer.{k}"] for k, v in tok_cfg_map.items() if f"tokenizer.{k}" in meta}
    hf.setdefault("vocab_size", len(tok.get("tokens", [])))
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if k in tok:
            hf[k] = tok[k]
    return hf, tok, tok_cfg


def _save_llama_family_tokenizer(gguf_arch: str, tok: dict, tok_cfg: dict, out: Path) -> None:
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.ggml import convert_gguf_tokenizer

    backend, extra = convert_gguf_tokenizer(gguf_arch, tok)
    kw = {**tok_cfg, **extra}
    # The special tokens by the ids the GGUF names: transformers' GGUF conversion can label the
    # wrong token (SmolLM2: eos_token "<|im_start|>" where the file says id 2, "<|im_end|>"), and a
    # wrong eos_token makes every HF tool that stops on it run past the end of an answer.
    tokens = tok.get("tokens") or []
    for name in ("bos", "eos", "pad"):
        tid = tok.get(f"{name}_token_id")
        if isinstance(tid, int) and 0 <= tid < len(tokens):
            kw[f"{name}_token"] = tokens[tid]
    PreTrainedTokenizerFast(tokenizer_object=backend, **kw).save_pretrained(str(out))
