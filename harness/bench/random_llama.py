"""Write a random-weight Llama HF checkpoint without ever holding the whole model.

    write_random_llama(out, tokenizer_dir, hidden=2048, layers=12, ...) -> out

For memory benchmarks and tests of the streamed build: the shapes come from the real
`LlamaForCausalLM` built on the meta device, each tensor is drawn (bf16, std 0.02; norms 1) and
written into shards of about `shard_bytes`, with the index file HF writes for sharded checkpoints,
so the writer's own peak is one shard. `device="cuda"` draws the numbers on the GPU (an 8B
checkpoint in seconds instead of minutes of CPU sampling; other values than the CPU's, same
shapes and statistics). The tokenizer files are copied from `tokenizer_dir`
(SmolLM2's import, whose vocabulary sets the embedding size).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")


def llama_config(vocab_size: int, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int,
                 tie: bool) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": hidden // heads,
            "vocab_size": vocab_size, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
            "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}, "tie_word_embeddings": tie,
            "attention_bias": False, "mlp_bias": False, "bos_token_id": 1, "eos_token_id": 2,
            "dtype": "bfloat16"}


def write_random_llama(out: str | Path, tokenizer_dir: str | Path, *, hidden: int = 2048, layers: int = 12,
                       heads: int = 16, kv_heads: int = 4, intermediate: int = 5632, tie: bool = False,
                       seed: int = 0, shard_bytes: int = 1 << 30, device: str = "cpu") -> Path:
    import torch  # noqa: PLC0415
    from safetensors.torch import save_file  # noqa: PLC0415
    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: PLC0415

    out, tokenizer_dir = Path(out), Path(tokenizer_dir)
    vocab = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
    cfg = llama_config(vocab, hidden, layers, heads, kv_heads, intermediate, tie)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(out)))
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=True)}
    if tie:
        shapes.pop("lm_head.weight", None)
    gen = torch.Generator(device).manual_seed(seed)
    shards: list[list[str]] = []  # tensor names per written shard: the writer holds one shard
    current: dict = {}
    size = 0
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            t = torch.ones(shape, dtype=torch.bfloat16)
        else:
            t = (torch.randn(shape, generator=gen, device=device) * 0.02).to(torch.bfloat16).cpu()
        if current and size + t.numel() * 2 > shard_bytes:
            shards.append(_save(out, len(shards), current, save_file))
            current, size = {}, 0
        current[name] = t
        size += t.numel() * 2
    shards.append(_save(out, len(shards), current, save_file))
    weight_map = {}
    for i, names in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        (out / f"part-{i:05d}.safetensors").rename(out / fname)
        weight_map.update(dict.fromkeys(names, fname))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map},
                                                                 indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy2(tokenizer_dir / name, out / name)
    return out


def _save(out: Path, index: int, tensors: dict, save_file) -> list[str]:
    save_file(tensors, str(out / f"part-{index:05d}.safetensors"), metadata={"format": "pt"})
    return list(tensors)
