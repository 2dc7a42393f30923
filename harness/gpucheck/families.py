"""The newer model families in the GPU check: tiny random checkpoints of transformers' Qwen3, Mistral (sliding
window) and Gemma 3 (sliding and full layers, the sliding layers' own KV pool) classes, built bf16 by the real
builder beside the Llama format bundles (harness/gpucheck/prepare.py), with this CPU's references.

What each family adds is in its attention and norms (q/k norms, windows, ``(1 + w)`` norms, two ropes), not
in its linears, so one unquantized bundle per family. The GPU run (``run --group families``) compares the
GPU's greedy tokens and teacher-forced logits with this CPU's, and the logits with transformers' own
(computed here, fp32: ``ref/<family>-hf-logits.safetensors``, so the GPU host needs no checkpoint), on every
attention backend the family runs on. Everything travels to the GPU host beside the formats' bundles
within its 64 MiB, so the families are small: one layer (Gemma 3 two: a sliding and a full one), the
four longest prompts, and transformers' logits as the one teacher-forced reference (this CPU's Kiln
logits agree with them to 1e-4: tests/runtime/test_family_parity.py).
"""
from __future__ import annotations

import shutil
from pathlib import Path

WINDOW = 48   # shorter than the prompts + output (58..96 + 32): windows bind on every backend
NUM_PROMPTS = 4   # the longest of the format bundles' prompts
# family -> (config class, model class, changes to the Llama shape, attention backends on the GPU)
FAMILIES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 64, "num_hidden_layers": 1}, ("triton", "torch")),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": WINDOW, "num_hidden_layers": 1},
                ("triton", "torch")),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               {"sliding_window": WINDOW, "query_pre_attn_scalar": 48, "num_hidden_layers": 2,
                "layer_types": ["sliding_attention", "full_attention"], "hidden_activation": "gelu_pytorch_tanh"},
               ("triton", "torch")),
}


def make_checkpoint(name: str, shape: dict, dest: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    import torch
    import transformers

    cfg_cls, model_cls, change, _ = FAMILIES[name]
    torch.manual_seed(seed)
    cfg = getattr(transformers, cfg_cls)(**{**shape, **change}, initializer_range=0.08,
                                         dtype="bfloat16")
    model = getattr(transformers, model_cls)(cfg).to(torch.bfloat16)
    with torch.no_grad():   # norms at their init (1 or 0) would hide a missing one
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(dest)
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy2(f, dest / f.name)
    return dest


def build_config(name: str, hf_dir: Path, out: Path, base: dict) -> dict:
    """The format bundles' build settings, unquantized, on the family's attention backend."""
    return {**base, "model": {"source": str(hf_dir), "dtype": "bfloat16"},
            "quantization": {"format": "none", "kv_cache": "none"},
            # auto: the fused triton layer on the GPU, torch here (the CPU references)
            "engine": {**base["engine"], "attention_backend": "auto" if "triton" in FAMILIES[name][3] else "torch"},
            "output": {"dir": str(out / name)}}


def hf_logits(hf_dir: Path, prompts: list[list[int]], outs: list[list[int]]):
    """transformers' fp32 next-token logits at every generated position of the CPU's greedy outputs."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.cat([model(torch.tensor([p + o[:-1]])).logits[0, len(p) - 1:] for p, o in zip(prompts, outs)])


def prepare(out: Path, tokenizer_dir: Path, shape: dict, base_config, ids, cpu_reference, repo: Path,
            log=print) -> dict:
    """Build every family's bundle and its references; -> reference.json entries by family name."""
    from safetensors.torch import save_file

    from builder.config import BuildConfig
    from builder.pipeline import run_pipeline

    entries = {}
    ids = ids[-NUM_PROMPTS:]
    for name in FAMILIES:
        hf = out / f"hf-{name}"
        if not (hf / "config.json").is_file():
            tmp = out / f"hf-{name}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            make_checkpoint(name, shape, tmp, tokenizer_dir)
            tmp.rename(hf)
        cfg = BuildConfig.from_dict(build_config(name, hf, out, base_config), file=f"<gpu-check {name}>")
        run_pipeline(cfg, log=lambda m, n=name: log(f"[{n}] {m}"))
        bundle = out / name / "engine"
        outs = cpu_reference(bundle, ids, save_logits=False)
        save_file({"logits": hf_logits(hf, ids, outs).half()}, str(out / "ref" / f"{name}-hf-logits.safetensors"))
        entries[name] = {"path": str(bundle.relative_to(repo)), "cpu_fp32_greedy": outs, "group": "families",
                         "backends": list(FAMILIES[name][3]), "prompts": ids}
    return entries


__all__ = ["FAMILIES", "build_config", "make_checkpoint", "prepare"]
