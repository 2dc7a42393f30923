"""GGUF (llama / mistral / qwen2) -> HF checkpoint in ONE pass over the file.

transformers' GGUF path parses the file four to five times (config, tensors, tokenizer twice) and
rebuilds gguf's TensorNameMap per tensor: ~100 s for a 100 MB file on a busy 2-core machine, and
``from_pretrained(gguf_file=...)`` additionally requires accelerate. Here the header is read once
with ``struct``, tensors are dequantized with ``gguf.quants.dequantize`` (the reference numpy
implementation) and transformers is used only for its key tables and tokenizer converter, so the
result is the same checkpoint transformers produces (the import tests compare it).
"""
from __future__ import annotations

import json
import math
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
LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
IGNORED = {"rope_freqs"}  # llama3 rope table: HF recomputes it from the config


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


def _hf_name(name: str) -> str | None:
    parts = name.split(".")
    if parts[0] in IGNORED:
        return None
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in LAYER_NAMES:
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[parts[0]]}.{parts[1]}"
    raise StageError(f"unexpected GGUF tensor {name!r} for a llama/mistral/qwen2 model")


def convert(path: Path, arch: str, out: Path, dtype: torch.dtype, progress=lambda n=1: None) -> dict:
    """Write model.safetensors, config.json, generation_config.json and tokenizer files into out."""
    import gguf

    try:
        meta, infos, data_start = read_header(path)
    except (ValueError, struct.error, OSError, RecursionError) as e:  # RecursionError: nested arrays
        raise StageError(f"{path}: unreadable GGUF ({e}); the file may be truncated or corrupted") from None
    size = path.stat().st_size
    for name, shape, qtype, offset in infos:  # fail before importing transformers and dequantizing
        try:
            block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
        except (ValueError, KeyError):
            raise StageError(f"{path}: tensor {name} has unknown GGML type {qtype}; the file may be "
                             f"corrupted") from None
        if not shape or shape[-1] % block:
            raise StageError(f"{path}: tensor {name} has shape {shape}, whose rows are not whole "
                             f"{block}-value blocks; the file may be corrupted")
        end = data_start + offset + math.prod(shape) // block * type_size  # Python ints: no wraparound
        if end > size:
            raise StageError(f"{path}: tensor {name} ends at byte {end} but the file has {size}; "
                             f"the file is truncated")

    from safetensors.torch import save_file
    from transformers import AutoConfig, PreTrainedTokenizerFast
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING, GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

    gguf_arch = meta.get("general.architecture")
    if gguf_arch not in GGUF_CONFIG_MAPPING or gguf_arch not in ("llama", "mistral", "qwen2"):
        raise StageError(f"{path}: GGUF architecture '{gguf_arch}' is not supported; allowed: llama, mistral, qwen2")
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
    names = {n for n, *_ in infos}
    hf["tie_word_embeddings"] = "output.weight" not in names

    state: dict[str, torch.Tensor] = {}
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    for name, shape, qtype, offset in infos:
        hf_name = _hf_name(name)
        if hf_name is None:
            continue
        block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
        n = math.prod(shape)
        nbytes = n // block * type_size
        start = data_start + offset
        if start + nbytes > size:
            raise StageError(f"{path}: tensor {name} ends at byte {start + nbytes} but the file has {size}; "
                             f"the file is truncated")
        raw = np.asarray(mm[start:start + nbytes]).reshape(-1, shape[-1] // block * type_size)
        values = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(qtype)).reshape(shape)
        t = torch.from_numpy(np.array(values, dtype=np.float32)).to(dtype)  # copy: memmap views are read-only
        if gguf_arch == "llama" and hf_name.endswith("q_proj.weight"):
            t = _reverse_rope_permute(t, hf["num_attention_heads"])
        elif gguf_arch == "llama" and hf_name.endswith("k_proj.weight"):
            t = _reverse_rope_permute(t, hf.get("num_key_value_heads", hf["num_attention_heads"]))
        state[hf_name] = t.contiguous()
        progress(1)
    del mm
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})

    config = AutoConfig.for_model(arch, **hf)
    config.architectures = [{"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                             "qwen2": "Qwen2ForCausalLM"}[arch]]
    config.dtype = str(dtype).removeprefix("torch.")
    config.to_json_file(str(out / "config.json"))
    gen = {k: hf[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in hf}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")

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
    return {"tensors": len(state), "gguf_architecture": gguf_arch}
