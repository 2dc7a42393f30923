"""Training data for the EAGLE-3 draft: the TARGET's own greedy answers, and what the target saw
while writing them.

One generation pass produces everything training needs. Forward hooks on the target's aux layers
and on its final norm record each position's hidden states as ``generate`` computes them (the
prompt in the prefill call, then one row per new token), so there is no second forward pass over
the finished sequences: on a 2-core CPU that pass cost a third of the stage, and the target's
forward is the only expensive part of making data. From the final hidden states the distillation
targets (the target's logits over the draft vocabulary) are one small matmul per sample.

Prompts are rendered with the tokenizer's chat template, exactly as served requests with
``apply_chat_template`` are (SmolLM2's template adds its default system prompt).
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from builder.stages.base import StageContext, StageError

GEN_BATCH = 64              # prompts the target continues at once (CPU: 64 ran 1.3x faster than 32)
BUILTIN_PROMPTS = Path(__file__).resolve().parents[2] / "backend" / "speculative" / "data" / "prompts.jsonl"


@dataclass
class Sample:
    """One training sequence: ``ids [T]`` (prompt + greedy answer), the target's aux-layer states
    ``aux [T, A*H]`` and its final (normed) hidden states ``final [T, H]``, both bf16 to halve the
    memory; ``prompt_len`` tokens of it are prompt."""
    ids: list[int]
    aux: "torch.Tensor"  # noqa: F821 - torch is imported lazily
    final: "torch.Tensor"  # noqa: F821
    prompt_len: int


def resolve(ctx: StageContext, p: Path) -> Path:
    """A path from the config: as given if it exists (or is absolute), else beside the config file."""
    if p.is_absolute() or p.exists():
        return p
    base = Path(ctx.config.file).parent if ctx.config.file else Path.cwd()
    return base / p


def prompts_path(ctx: StageContext) -> Path:
    ds = ctx.config.speculative.train.dataset
    return BUILTIN_PROMPTS if ds == "builtin" else resolve(ctx, Path(ds))


def load_prompts(ctx: StageContext, limit: int) -> list[str]:
    path = prompts_path(ctx)
    if not path.is_file():
        raise StageError(f"{ctx.config.file}: speculative.train.dataset: {path} not found; allowed: "
                         f"builtin | path to a JSONL file with a 'text' field")
    texts = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise StageError(f"{path}:{n}: not valid JSON ({exc.msg})") from exc
        text = rec.get("text") if isinstance(rec, dict) else None
        if not isinstance(text, str) or not text.strip():
            raise StageError(f"{path}:{n}: each line needs a non-empty string field 'text'")
        texts.append(text)
        if len(texts) >= limit:
            break
    if not texts:
        raise StageError(f"{path}: no prompts (expected JSONL lines with a 'text' field)")
    return texts


def chat_ids(tok, text: str) -> list[int]:
    """A prompt as the runtime sees a chat request (template applied when the tokenizer has one)."""
    if getattr(tok, "chat_template", None):
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                      tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    return list(tok(text)["input_ids"])


class _Recorder:
    """Forward hooks that keep the outputs of the aux layers and of the final norm, one tensor
    per forward call (``[B, t, H]``)."""

    def __init__(self, model, aux: tuple[int, ...]):
        inner = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        self.keys = list(aux) + ["final"]
        self.out: dict = {k: [] for k in self.keys}
        mods = [inner.layers[i] for i in aux] + [inner.norm]
        self.handles = [m.register_forward_hook(self._hook(k)) for k, m in zip(self.keys, mods)]

    def _hook(self, key):
        def keep(_module, _inputs, output):
            self.out[key].append((output[0] if isinstance(output, tuple) else output).detach())
        return keep

    def take(self) -> dict:
        """Per key, the calls so far concatenated along time; clears the record."""
        import torch

        got = {k: torch.cat(v, 1) for k, v in self.out.items()}
        self.out = {k: [] for k in self.keys}
        return got

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def target_data(model, tok, prompts: list[str], seq_len: int, aux: tuple[int, ...], advance) -> list[Sample]:
    """Each prompt (chat-formatted; at most ``seq_len // 2`` tokens, the end kept) + the target's
    greedy continuation, up to ``seq_len`` tokens in all and through the EOS, with the target's
    hidden states at every position recorded during generation.

    Prompts run GEN_BATCH at a time, grouped by length so left padding stays small: the target's
    cost per token falls steeply with the batch on a CPU. The last token of a sequence has no
    hidden state (``generate`` never runs on it); nothing predicts past it, so it is dropped."""
    import torch

    encoded = [chat_ids(tok, t)[-(seq_len // 2):] for t in prompts]
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    # Where an answer ends: the ids generate stops on (generation_config, as the engine's
    # eos_token_ids) and the tokenizer's own eos. After its end a row only gets padding.
    ends = set(_ids(model.generation_config.eos_token_id)) | set(_ids(tok.eos_token_id))
    samples: list[Sample | None] = [None] * len(encoded)
    rec = _Recorder(model, aux)
    try:
        for i in range(0, len(order), GEN_BATCH):
            idx = order[i:i + GEN_BATCH]
            batch = [encoded[j] for j in idx]
            width = max(len(b) for b in batch)
            # Left padding: every row's continuation starts at the same column.
            ids = torch.tensor([[pad] * (width - len(b)) + b for b in batch])
            mask = torch.tensor([[0] * (width - len(b)) + [1] * len(b) for b in batch])
            with torch.inference_mode():
                out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                     max_new_tokens=seq_len - min(len(b) for b in batch), pad_token_id=pad)
            got = rec.take()
            for r, (j, b) in enumerate(zip(idx, batch)):
                gen = out[r, width:].tolist()
                stop = next((k for k, t in enumerate(gen) if t in ends), None)
                if stop is not None:  # keep the EOS itself: predicting the end is part of the job
                    gen = gen[:stop + 1]
                seq = (b + gen)[:seq_len]
                start = width - len(b)
                n = min(len(seq), got["final"].shape[1] - start)
                samples[j] = Sample(
                    ids=seq[:n], prompt_len=len(b),
                    aux=torch.cat([got[k][r, start:start + n] for k in aux], -1).to(torch.bfloat16),
                    final=got["final"][r, start:start + n].to(torch.bfloat16))
            advance(len(batch))
    finally:
        rec.close()
    return samples  # type: ignore[return-value]


def _ids(v) -> list[int]:
    return [] if v is None else [v] if isinstance(v, int) else list(v)


def draft_logits(samples: list[Sample], head) -> list:
    """The distillation targets: the target's logits over the draft vocabulary (``head`` = those
    rows of its lm_head), bf16 ``[T, Vd]`` per sample. Only these columns, and only once: ModelOpt
    would otherwise multiply every training token by the full lm_head at every step."""
    import torch

    head = head.float()
    with torch.inference_mode():
        return [(s.final.float() @ head.T).to(torch.bfloat16) for s in samples]


def draft_vocab(seqs: list[list[int]], vocab_size: int, size: int) -> list[int]:
    """The ``size`` most frequent token ids in the training text; ties (and the unseen remainder)
    by id, which for BPE vocabularies roughly follows merge order, i.e. frequency in pre-training."""
    size = min(size, vocab_size)
    counts = Counter(t for s in seqs for t in s)
    seen = sorted(counts, key=lambda t: (-counts[t], t))[:size]
    rest = (t for t in range(vocab_size) if t not in counts)
    ids = seen + [t for _, t in zip(range(size - len(seen)), rest)]
    return sorted(ids)


__all__ = ["BUILTIN_PROMPTS", "GEN_BATCH", "Sample", "chat_ids", "draft_logits", "draft_vocab",
           "load_prompts", "prompts_path", "resolve", "target_data"]
