"""transformers' own greedy decoding, the reference the family, window and real-model tests hold Kiln to."""
from __future__ import annotations

import torch


def hf_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    """``generate(do_sample=False)`` for exactly ``new_tokens`` tokens (EOS disabled, as Kiln's
    ``ignore_eos`` runs the whole length)."""
    gen = model.generation_config
    gen.eos_token_id, gen.pad_token_id = None, 0
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, generation_config=gen)
    return out[0, len(prompt):].tolist()
