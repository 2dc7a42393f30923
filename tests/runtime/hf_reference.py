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


def assert_teacher_forced_greedy(model, prompt: list[int], ours: list[int]) -> None:
    """``ours`` is the model's greedy continuation: one forward over prompt + ``ours`` (no cache) has
    its argmax at every step equal to the next token of ``ours``. transformers' incremental ``generate``
    and its own full forward do not always agree: on random models two logits come within rounding
    (a Mistral window: 4e-4 apart), and on a tiny Gemma 3 with a 16-token window past a 120-token
    prompt its sliding-window cache gave another token at a margin of 6e-3. The full forward, with
    the model's own masks, is the definition Kiln is held to."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ours])).logits[0, len(prompt) - 1:-1]
    best = logits.argmax(-1).tolist()
    assert best == ours, f"transformers' argmax parts from Kiln at step {next(i for i, t in enumerate(ours) if best[i] != t)}"
