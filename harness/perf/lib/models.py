"""Synthetic (random-weight) models for benchmarks and tests, and the named shapes they take.

Speed does not depend on weight values, and no large checkpoint reaches a GPU host, so benchmarks
time random weights of a real model's shape. Three makers, one shape table:

    SHAPES["llama-3.1-8b"]                      # the runtime's model dict (engine.json "model")
    synthetic_fp8_weights(shape, device)        # FP8 bundle layout, in memory (+ manifest_bundle)
    random_draft(shape, draft_vocab, device)    # an EAGLE-3 head for that target
    write_random_llama(out, tokenizer_dir, ...) # an HF checkpoint on disk, shard by shard

Mixture-of-experts shapes will add ``num_experts`` / ``experts_per_token`` to an entry; the makers
refuse such a shape until the runtime has expert layers (``_dense_only``).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

_LLAMA3 = {"architecture": "llama", "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 8192,
           "tie_word_embeddings": False,
           "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192},
           "attention_bias": False, "mlp_bias": False, "sliding_window": None, "bos_token_id": 128000,
           "eos_token_ids": [128001, 128009], "pad_token_id": 128001, "dtype": "bfloat16"}

LLAMA31_8B = dict(_LLAMA3, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
                  head_dim=128, vocab_size=128256)
LLAMA31_70B = dict(_LLAMA3, hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64, num_kv_heads=8,
                   head_dim=128, vocab_size=128256)
# SmolLM2-135M(-Instruct): the CPU path's model; its token ids are the instruct tokenizer's
SMOLLM2_135M = {"architecture": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_layers": 30,
                "num_heads": 9, "num_kv_heads": 3, "head_dim": 64, "vocab_size": 49152, "rms_norm_eps": 1e-5,
                "rope_theta": 100000.0, "max_position_embeddings": 8192, "tie_word_embeddings": True,
                "rope_scaling": None, "attention_bias": False, "mlp_bias": False, "sliding_window": None,
                "bos_token_id": 1, "eos_token_ids": [2], "pad_token_id": 2, "dtype": "bfloat16"}
# Llama-shaped and tiny: every benchmark's --dry-run and the tests that exercise its plumbing
TINY = dict(LLAMA31_8B, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
            head_dim=32, vocab_size=512, max_position_embeddings=512)

SHAPES = {"smollm2-135m": SMOLLM2_135M, "llama-3.1-8b": LLAMA31_8B, "llama-3.1-70b": LLAMA31_70B, "tiny": TINY}


def shape(name: str) -> dict:
    """A copy of the named shape; an unknown name lists the known ones."""
    if name not in SHAPES:
        raise KeyError(f"unknown model shape {name!r}; known: {', '.join(SHAPES)}")
    return dict(SHAPES[name])


def attention_dims(m: dict) -> dict:
    """The attention and MLP sizes kernel benchmarks take from a shape."""
    return {k: m[k] for k in ("num_heads", "num_kv_heads", "head_dim", "hidden_size", "intermediate_size")}


def hf_dims(m: dict) -> dict:
    """A shape as ``write_random_llama``'s keyword arguments."""
    return {"hidden": m["hidden_size"], "heads": m["num_heads"], "kv_heads": m["num_kv_heads"],
            "intermediate": m["intermediate_size"], "layers": m["num_layers"], "tie": m["tie_word_embeddings"]}


def _dense_only(m: dict) -> None:
    if m.get("num_experts"):
        raise NotImplementedError(f"model shape with {m['num_experts']} experts: the runtime has no expert layers "
                                  "yet, so no synthetic weights are made for it")


def synthetic_fp8_weights(m: dict, device: str = "cuda", seed: int = 0, std: float = 0.02) -> dict:
    """Random weights in the FP8 bundle layout (docs/contracts.md section 3), made layer by layer on
    the GPU so the bf16 originals never all exist at once. Tests use a larger ``std`` so that outputs
    depend strongly on the context (a check of attention and KV handling can then fail)."""
    import torch
    _dense_only(m)

    _dense_only(m)
    from quant.formats import quantize_fp8_per_row
    g = torch.Generator(device=device).manual_seed(seed)
    h, inter = m["hidden_size"], m["intermediate_size"]
    q, kv = m["num_heads"] * m["head_dim"], m["num_kv_heads"] * m["head_dim"]
    shapes = {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * inter, h), "down": (h, inter)}

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=torch.bfloat16) * std

    w = {"embed_tokens.weight": randn(m["vocab_size"], h), "norm.weight": torch.ones(h, device=device,
                                                                                     dtype=torch.bfloat16),
         "lm_head.weight": randn(m["vocab_size"], h)}
    one = torch.tensor(1.0, device=device)
    for i in range(m["num_layers"]):
        p = f"layers.{i}"
        w[f"{p}.input_norm.weight"] = torch.ones(h, device=device, dtype=torch.bfloat16)
        w[f"{p}.post_attn_norm.weight"] = torch.ones(h, device=device, dtype=torch.bfloat16)
        w[f"{p}.attn.k_scale"], w[f"{p}.attn.v_scale"] = one * 0.05, one * 0.05
        for name, shape in shapes.items():
            for k, v in quantize_fp8_per_row(randn(*shape)).items():
                w[f"{p}.{name}.{k}"] = v
            w[f"{p}.{name}.input_scale"] = one * 0.02
    return w


def weight_bytes_per_token(w: dict) -> int:
    """Bytes decode reads per step: every weight except the embedding table (one row is gathered)."""
    return sum(t.numel() * t.element_size() for k, t in w.items() if k != "embed_tokens.weight")


def manifest_bundle(m: dict, engine: dict, root: Path) -> Path:
    """A bundle with engine.json only (weights are passed in memory; hashes are not checked)."""
    from safetensors.torch import save_file

    from backend import bundle
    root.mkdir(parents=True, exist_ok=True)
    save_file({}, str(root / bundle.WEIGHTS))
    bundle.write(root, bundle.Manifest.from_dict({
        "format": bundle.FORMAT, "format_version": bundle.FORMAT_VERSION, "model": m, "engine": engine,
        "quantization": {"format": "fp8", "kv_cache": "fp8"}, "files": {bundle.WEIGHTS: ""}}))
    return root


# A model that costs nothing, for timing the host's share of an engine step (step/host_overhead.py,
# its executor scenarios): fixed logits over a vocabulary this small
STUB_VOCAB = 32    # tiny on purpose: the greedy pick must not stand in for a real sampler


class StubModel:
    """Returns the same precomputed logits every step: no compute, so only host work is timed."""

    def __init__(self, max_rows: int, vocab: int = STUB_VOCAB) -> None:
        import torch
        g = torch.Generator().manual_seed(0)
        self.logits = torch.randn(max_rows, vocab, generator=g)

    def __call__(self, input_ids, meta, logits_indices):
        return self.logits[: logits_indices.shape[0]]


def random_draft(m: dict, draft_vocab_size: int, device: str = "cpu", seed: int = 0, std: float = 0.02):
    """An EAGLE-3 head for the target shape ``m`` (a ``SHAPES`` entry) with random weights, in
    the layout ``Eagle3Draft`` reads: ``(DraftConfig, tensors)``; bf16 as real drafts ship."""
    import torch
    _dense_only(m)

    from backend.speculative.checkpoint import DraftConfig, default_aux_layers
    h, inter, hd = m["hidden_size"], m["intermediate_size"], m["head_dim"]
    q, kv = m["num_heads"] * hd, m["num_kv_heads"] * hd
    aux = default_aux_layers(m["num_layers"])
    cfg = DraftConfig(hidden_size=h, num_heads=m["num_heads"], num_kv_heads=m["num_kv_heads"], head_dim=hd,
                      intermediate_size=inter, vocab_size=m["vocab_size"], draft_vocab_size=draft_vocab_size,
                      rms_norm_eps=m["rms_norm_eps"], rope_theta=m["rope_theta"], aux_layers=aux,
                      has_lm_head=True, rope_scaling=m.get("rope_scaling"))
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=torch.bfloat16) * std

    ones = torch.ones(h, device=device, dtype=torch.bfloat16)
    L = "layers.0."
    t = {"fc.weight": randn(h, len(aux) * h), "norm.weight": ones, "lm_head.weight": randn(draft_vocab_size, h),
         L + "input_layernorm.weight": ones, L + "hidden_norm.weight": ones, L + "post_attention_layernorm.weight": ones,
         L + "self_attn.q_proj.weight": randn(q, 2 * h), L + "self_attn.k_proj.weight": randn(kv, 2 * h),
         L + "self_attn.v_proj.weight": randn(kv, 2 * h), L + "self_attn.o_proj.weight": randn(h, q),
         L + "mlp.gate_proj.weight": randn(inter, h), L + "mlp.up_proj.weight": randn(inter, h),
         L + "mlp.down_proj.weight": randn(h, inter)}
    if draft_vocab_size < m["vocab_size"]:
        # d2t: draft id i -> target id i + d2t[i]; any injective map times the same.
        t["d2t"] = torch.zeros(draft_vocab_size, dtype=torch.long, device=device)
    return cfg, t


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
