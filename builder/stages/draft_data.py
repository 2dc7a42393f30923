"""Training data for the EAGLE-3 draft: the TARGET's own greedy answers, and what the target saw
while writing them.

The target is the engine itself: the draft stage packs the (quantized) checkpoint into a bundle and
Kiln's executor answers every prompt greedily, on the GPU when there is one, with
``backend/speculative/record.py`` recording the aux layers' outputs and the final (normed) hidden
state of every position as the steps compute them (the same seam the EAGLE speculator reads at
serving time). So the draft learns the continuations the ENGINE produces (its weights, compute
dtype and kernels), and the build never holds the target in transformers: host memory is the
bundle's weights on a CPU, on a GPU only the recorded rows. From the final hidden states the
distillation targets (the target's logits over the draft vocabulary) are one small matmul per sample.

Prompts are rendered with the tokenizer's chat template, exactly as served requests with
``apply_chat_template`` are (SmolLM2's template adds its default system prompt).
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from builder.stages.base import StageContext, StageError

if TYPE_CHECKING:   # torch is imported where it is used: importing the stage modules stays cheap
    import torch

GEN_BATCH = 64              # sequences the engine runs at once (CPU: 64 ran 1.3x faster than 32)
BUILTIN_PROMPTS = Path(__file__).resolve().parents[2] / "backend" / "speculative" / "data" / "prompts.jsonl"


@dataclass
class Sample:
    """One training sequence: ``ids [T]`` (prompt + greedy answer), the target's aux-layer states
    ``aux [T, A*H]`` and its final (normed) hidden states ``final [T, H]``, both bf16 to halve the
    memory; ``prompt_len`` tokens of it are prompt. ``last`` is the answer's final token (the EOS
    when it stopped), which has no states: the engine never runs a token after the last."""
    ids: list[int]
    aux: torch.Tensor
    final: torch.Tensor
    prompt_len: int
    last: int


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


def target_data(bundle_dir: Path, tok, prompts: list[str], seq_len: int, aux: tuple[int, ...], advance,
                device: str = "cpu", log=None) -> list[Sample]:
    """Each prompt (chat-formatted; at most ``seq_len // 2`` tokens, the end kept) + the engine's
    greedy continuation, up to ``seq_len`` tokens in all and through the EOS, with the target's
    hidden states at every position that ran (all but the last token).

    Every prompt is submitted at once; the scheduler runs GEN_BATCH of them at a time and starts
    the next as one ends (the target's cost per token falls steeply with the batch on a CPU).
    Prefix caching is off: a prompt prefix served from the cache (every chat prompt shares the
    system prompt) would skip the very forward passes whose states are recorded."""
    import torch

    from backend.engine.executor import Executor
    from backend.engine.sampling_params import SamplingParams
    from backend.model.layers import rms_norm
    from backend.bundle import load_bundle
    from backend.speculative.record import HiddenRecorder

    bundle = load_bundle(bundle_dir)
    c, eng = bundle.manifest.model, bundle.manifest.engine
    last_layer = c.num_layers - 1
    layers = tuple(dict.fromkeys((*aux, last_layer)))
    col = layers.index(last_layer) * c.hidden_size
    encoded = [chat_ids(tok, t)[-(seq_len // 2):] for t in prompts]
    # The engine's length limits are the served ones; this engine only has to fit the training
    # sequences, so the data does not depend on them (they are not part of the draft's stage key).
    longest = max(len(e) for e in encoded)
    max_seq = max(eng.max_seq_len, seq_len + 1)
    blocks = -(-(seq_len + 1) // eng.kv_block_size)
    recorder = HiddenRecorder(layers, c.hidden_size, torch.bfloat16)
    ex = Executor(bundle, device=device, speculator=recorder, start=False, verify_hashes=False,
                  max_batch_size=GEN_BATCH, enable_prefix_caching=False, max_seq_len=max_seq,
                  max_input_len=max(eng.max_input_len, longest), max_kv_tokens=GEN_BATCH * blocks * eng.kv_block_size)
    weight = ex.runner.model.norm.float()
    if log is not None:   # engine.cpu_dtype auto decides by timing: the answers depend on it
        choice = ex.runner.dtype_choice
        log(f"draft: the engine answers on {device} in {str(choice.dtype).removeprefix('torch.')} ({choice.reason})")

    def final_norm(rows):
        # the final hidden state: what the runtime's last norm makes of the last layer's output
        out = rows.clone()
        last = rows[:, col:col + c.hidden_size].float()
        out[:, col:col + c.hidden_size] = rms_norm(last, weight, c.rms_norm_eps).to(rows.dtype)
        return out

    recorder.transform = final_norm
    try:
        handles = []
        for j, ids in enumerate(encoded):
            rid = f"draft-{j}"
            recorder.expect(rid, seq_len)
            params = SamplingParams(temperature=0.0, max_tokens=seq_len - len(ids))
            handles.append(ex.submit(ids, params, request_id=rid))
        done = 0
        while done < len(handles):
            ex.step()
            now = sum(h.finished for h in handles)
            advance(now - done)
            done = now
        samples = []
        for j, (ids, h) in enumerate(zip(encoded, handles)):
            res = h.result()
            if res.error:
                raise StageError(f"draft: the engine failed on training prompt {j}: {res.error}")
            seq = ids + res.token_ids
            rows = recorder.take(f"draft-{j}")
            assert rows.shape[0] == len(seq) - 1, (j, rows.shape, len(seq))
            samples.append(Sample(
                ids=seq[:-1], prompt_len=len(ids), last=seq[-1],
                aux=torch.cat([rows[:, k * c.hidden_size:(k + 1) * c.hidden_size] for k in
                               (layers.index(i) for i in aux)], -1),
                final=rows[:, col:col + c.hidden_size].clone()))
    finally:
        ex.shutdown()
    return samples


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
