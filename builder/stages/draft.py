"""Draft stage: an EAGLE-3 head for speculative decoding (``speculative.method: eagle3``).

``speculative.draft: train`` trains one with NVIDIA ModelOpt (``mtsp.convert`` with the EAGLE-3
config sized to the target, ModelOpt's own loss and train-time-test steps, then
``export_speculative_decoding``). The training text is the TARGET's own greedy continuation of each
prompt, so the draft learns what this target says, not what a dataset says. What makes it fit in
minutes on a 2-core CPU:

* offline features: the target runs ONCE per sample (generation, then one pass for the hidden
  states and the distillation targets); training steps then only run the draft (``eagle_offline``);
* the distillation targets are the target's logits over the DRAFT vocabulary, computed in that one
  pass: left to itself ModelOpt multiplies every training token by the full 49k-row lm_head at
  every step, which was most of a step's time;
* a draft vocabulary of the most frequent tokens (``DRAFT_VOCAB``, with ``d2t``), its lm_head rows
  initialised from the target's, so the head is useful after a few dozen steps;
* fp32 everywhere on the CPU: generation (batched, ``GEN_BATCH``) is ~3x faster than bf16 on AVX2,
  and AdamW on bf16 draft weights stalls; the draft is exported in the target's dtype.

``speculative.draft: <path>`` imports an EAGLE-3 checkpoint in the public HF layout and refuses one
whose hidden size, vocabulary or aux layers do not fit the target.

Output (top of ``ctx.out_dir``, copied to ``engine/draft/`` by compile): ``weights.safetensors`` and
``config.json`` (``backend/spec/checkpoint.py``); ``info["speculative"]`` goes into engine.json.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import tempfile
import time
from collections import Counter
from pathlib import Path

from builder.stages.base import StageContext, StageError

DRAFT_VOCAB = 8192          # rows of the draft lm_head (SmolLM2: 49152 -> 6x cheaper drafting)
BATCH = 4                   # training sequences per step
NUM_PROMPTS = 256           # prompts whose continuations make the training set (the first N)
GEN_BATCH = 32              # prompts the target continues at once
FEAT_BATCH = 8              # sequences per hidden-state pass
TTT_STEPS = 3               # ModelOpt's train-time-test depth (draft fed its own outputs)
BUILTIN_PROMPTS = Path(__file__).resolve().parents[2] / "backend" / "spec" / "data" / "prompts.jsonl"


def skip_reason(ctx: StageContext) -> str | None:
    if ctx.config.speculative.method == "none":
        return "speculative.method is none"
    return None


def fingerprint(ctx: StageContext) -> str:
    s = ctx.config.speculative
    src = BUILTIN_PROMPTS if s.train.dataset == "builtin" else Path(s.train.dataset)
    parts = ["draft-v2", f"vocab={DRAFT_VOCAB}", f"batch={BATCH}", f"ttt={TTT_STEPS}",
             f"prompts={NUM_PROMPTS}"]
    for p in ([src] if s.draft == "train" else [Path(s.draft)]):
        p = _resolve(ctx, p)
        if p.is_file():
            st = p.stat()
            parts.append(f"{p}:{st.st_size}:{int(st.st_mtime)}")
        elif p.is_dir():
            parts += [f"{f}:{f.stat().st_size}:{int(f.stat().st_mtime)}" for f in sorted(p.iterdir()) if f.is_file()]
    return ";".join(parts)


def run(ctx: StageContext) -> dict:
    from backend.spec.checkpoint import DraftCheckpointError, read_hf_draft, write_bundle_draft

    s = ctx.config.speculative
    target_dir = ctx.results["import"].path
    target = json.loads((target_dir / "config.json").read_text())
    t0 = time.time()
    train_info: dict = {}
    if s.draft == "train":
        with tempfile.TemporaryDirectory(prefix="kiln-draft-") as tmp:
            train_info = train_draft(ctx, target_dir, Path(tmp))
            cfg, tensors = read_hf_draft(tmp, target)
    else:
        path = _resolve(ctx, Path(s.draft))
        if not path.is_dir():
            raise StageError(f"{ctx.config.file}: speculative.draft: {path} is not a folder; allowed: "
                             f"train | path to an EAGLE-3 HF checkpoint folder")
        try:
            cfg, tensors = read_hf_draft(path, target)
        except DraftCheckpointError as exc:
            raise StageError(str(exc)) from exc
    if s.aux_layers is not None and tuple(s.aux_layers) != cfg.aux_layers:
        raise StageError(f"{ctx.config.file}: speculative.aux_layers: {list(s.aux_layers)} but the draft "
                         f"was trained on layers {list(cfg.aux_layers)}; allowed: null | {list(cfg.aux_layers)}")
    dtype = target.get("torch_dtype") or target.get("dtype") or ctx.config.model.dtype
    tensors = {k: (v if k == "d2t" else v.to(_torch_dtype(dtype))) for k, v in tensors.items()}
    cfg = dataclasses.replace(cfg, dtype=str(dtype))
    write_bundle_draft(ctx.out_dir, cfg, tensors)
    ctx.log(f"draft: {'trained' if s.draft == 'train' else 'imported'} EAGLE-3 head, aux layers "
            f"{list(cfg.aux_layers)}, draft vocab {cfg.draft_vocab_size}, {time.time() - t0:.0f} s")
    section = speculative_section(ctx, cfg)
    section["draft_source"] = s.draft
    if train_info:
        section["train"] = train_info
    return {"speculative": section}


def speculative_section(ctx: StageContext, cfg) -> dict:
    """What the runtime needs from engine.json (the draft's own shape is in draft/config.json)."""
    s = ctx.config.speculative
    return {"method": s.method, "draft_dir": "draft", "max_draft_len": s.max_draft_len, "tree": s.tree,
            "tree_choices": [list(p) for p in s.tree_choices] if s.tree_choices else None,
            "top_k": s.top_k, "depth": s.depth, "aux_layers": list(cfg.aux_layers),
            "draft_vocab_size": cfg.draft_vocab_size}


def _resolve(ctx: StageContext, p: Path) -> Path:
    if p.is_absolute() or p.exists():
        return p
    base = Path(ctx.config.file).parent if ctx.config.file else Path.cwd()
    return base / p


def _torch_dtype(name: str):
    import torch
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[str(name)]


# ---- training ------------------------------------------------------------------------------------

def load_prompts(ctx: StageContext, limit: int) -> list[str]:
    ds = ctx.config.speculative.train.dataset
    path = BUILTIN_PROMPTS if ds == "builtin" else _resolve(ctx, Path(ds))
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


def target_sequences(model, tok, prompts: list[str], seq_len: int, advance) -> list[list[int]]:
    """Each prompt (chat-formatted when the tokenizer has a template) + the target's greedy
    continuation up to ``seq_len`` tokens in all.

    Prompts run GEN_BATCH at a time, grouped by length so left padding stays small: generation is
    most of the stage's time and its cost per token falls steeply with the batch on a CPU."""
    import torch

    encoded = [chat_ids(tok, t)[-(seq_len // 2):] for t in prompts]
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    eos = tok.eos_token_id
    seqs: list[list[int] | None] = [None] * len(encoded)
    for i in range(0, len(order), GEN_BATCH):
        idx = order[i:i + GEN_BATCH]
        batch = [encoded[j] for j in idx]
        width = max(len(b) for b in batch)
        # Left padding so every row's continuation starts at the same column.
        ids = torch.tensor([[pad] * (width - len(b)) + b for b in batch])
        mask = torch.tensor([[0] * (width - len(b)) + [1] * len(b) for b in batch])
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                 max_new_tokens=seq_len - min(len(b) for b in batch), pad_token_id=pad)
        for j, row, b in zip(idx, out.tolist(), batch):
            gen = row[width:]
            if eos in gen:  # keep the EOS itself: predicting the end is part of the job
                gen = gen[:gen.index(eos) + 1]
            seqs[j] = (b + gen)[:seq_len]
        advance(len(batch))
    return seqs  # type: ignore[return-value]


def target_features(model, seqs: list[list[int]], aux: tuple[int, ...], vocab_ids, advance) -> list[tuple]:
    """The target's view of every training token, computed once: (aux-layer states [T, A*H],
    logits over the draft vocabulary [T, Vd] in bf16). The logits are the distillation targets;
    computing only the draft vocabulary's rows of lm_head (and only once, not every training step)
    is what keeps training cheap: over the full 49k vocabulary this product dominated each step."""
    import torch

    head = model.get_output_embeddings().weight[vocab_ids].float()
    feats = []
    with torch.inference_mode():
        for i in range(0, len(seqs), FEAT_BATCH):
            chunk = seqs[i:i + FEAT_BATCH]
            width = max(len(q) for q in chunk)
            ids = torch.tensor([q + [0] * (width - len(q)) for q in chunk])
            mask = torch.tensor([[1] * len(q) + [0] * (width - len(q)) for q in chunk])
            hs = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
            a = torch.cat([hs[layer + 1] for layer in aux], -1).float()
            logits = (hs[-1].float() @ head.T).to(torch.bfloat16)
            for r, q in enumerate(chunk):
                feats.append((a[r, :len(q)].clone(), logits[r, :len(q)].clone()))
            advance(len(chunk))
    return feats


def draft_vocab(seqs: list[list[int]], vocab_size: int, size: int) -> list[int]:
    """The ``size`` most frequent token ids in the training text; ties (and the unseen remainder)
    by id, which for BPE vocabularies roughly follows merge order, i.e. frequency in pre-training."""
    size = min(size, vocab_size)
    counts = Counter(t for s in seqs for t in s)
    seen = sorted(counts, key=lambda t: (-counts[t], t))[:size]
    rest = (t for t in range(vocab_size) if t not in counts)
    ids = seen + [t for _, t in zip(range(size - len(seen)), rest)]
    return sorted(ids)


def train_draft(ctx: StageContext, target_dir: Path, export_dir: Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    import modelopt.torch.speculative as mtsp
    from modelopt.torch.export import export_speculative_decoding

    from backend.spec.checkpoint import default_aux_layers

    s = ctx.config.speculative
    tr = s.train
    torch.manual_seed(0)
    times = {}
    tok = AutoTokenizer.from_pretrained(target_dir)
    # fp32: on CPUs without native bf16 math (AVX2) it is several times faster than bf16, and it is
    # what the runtime computes in there, so the continuations are the ones the engine will produce.
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    model.config.architectures = model.config.architectures or ["LlamaForCausalLM"]
    c = model.config
    aux = tuple(s.aux_layers) if s.aux_layers is not None else default_aux_layers(c.num_hidden_layers)
    prompts = load_prompts(ctx, NUM_PROMPTS)
    t0 = time.perf_counter()
    with ctx.progress("draft: target continuations", len(prompts)) as advance:
        seqs = target_sequences(model, tok, prompts, tr.seq_len, advance)
    times["generate_s"] = round(time.perf_counter() - t0, 1)
    ctx.log(f"draft: {len(seqs)} target continuations, {sum(map(len, seqs))} tokens, {times['generate_s']} s")
    vocab_ids = draft_vocab(seqs, c.vocab_size, DRAFT_VOCAB)
    t0 = time.perf_counter()
    with ctx.progress("draft: target hidden states", len(seqs)) as advance:
        feats = target_features(model, seqs, aux, vocab_ids, advance)
    times["features_s"] = round(time.perf_counter() - t0, 1)
    ctx.log(f"draft: target features and draft-vocabulary logits, {times['features_s']} s")

    cfg = copy.deepcopy(mtsp.EAGLE3_DEFAULT_CFG["config"])
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    theta = float(getattr(c, "rope_theta", None) or (getattr(c, "rope_parameters", None) or {}).get("rope_theta", 10000.0))
    cfg["eagle_architecture_config"].update(
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
        head_dim=head_dim, intermediate_size=c.intermediate_size, rms_norm_eps=c.rms_norm_eps,
        rope_theta=theta, rope_scaling={"rope_type": "default", "rope_theta": theta},
        eagle_aux_hidden_state_layer_ids=list(aux), draft_vocab_size=len(vocab_ids))
    # No torch.compile on CPU; no yarn rope injected at export (the draft runs at the target's rope).
    cfg.update(eagle_use_torch_compile=False, eagle_export_rope_scaling={}, eagle_offline=True,
               eagle_ttt_steps=TTT_STEPS)
    mtsp.convert(model, [("eagle", cfg)])
    em = model.eagle_module
    ids_t = torch.tensor(vocab_ids)
    nd = len(vocab_ids)
    if nd < c.vocab_size:
        em.d2t.copy_(ids_t - torch.arange(nd))
    with torch.no_grad():  # start from the target's own output embedding rows
        em.lm_head.weight.copy_(model.lm_head.weight[ids_t].float())
    # The precomputed logits already cover just the draft vocabulary; ModelOpt would otherwise
    # gather those columns out of full-vocabulary logits.
    full_to_draft = model._map_logits_to_draft_vocab
    model._map_logits_to_draft_vocab = lambda x: x if x.shape[-1] == nd else full_to_draft(x)

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=tr.learning_rate, weight_decay=0.0)
    warm = max(1, tr.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min(1.0, (i + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(i, tr.steps) / tr.steps)))
    model.train()
    gen = torch.Generator().manual_seed(0)
    losses, accs = [], []
    t0 = time.perf_counter()
    with ctx.progress("draft: training", tr.steps) as advance:
        for step in range(tr.steps):
            pick = torch.randint(len(seqs), (BATCH,), generator=gen).tolist()
            width = max(len(seqs[i]) for i in pick)
            input_ids, mask, aux_h, logits = _pad_batch([seqs[i] for i in pick], [feats[i] for i in pick], width)
            out = model(input_ids=input_ids, attention_mask=mask, loss_mask=mask,
                        base_model_outputs={"aux_hidden_states": aux_h, "base_model_logits": logits,
                                            "base_model_hidden_states": aux_h.new_empty(len(pick), width, 0)})
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step(), sched.step(), opt.zero_grad(set_to_none=True)
            losses.append(float(out.loss.detach()))
            accs.append(out.train_acc[0])
            if (step + 1) % max(1, tr.steps // 10) == 0 or step + 1 == tr.steps:
                k = max(1, tr.steps // 10)
                top1 = [sum(a[d] for a in accs[-k:]) / len(accs[-k:]) for d in range(TTT_STEPS)]
                ctx.log(f"draft: step {step + 1}/{tr.steps} loss {sum(losses[-k:]) / len(losses[-k:]):.3f} "
                        f"top-1 by depth {' '.join(f'{a:.2f}' for a in top1)}")
            advance(1)
    times["train_s"] = round(time.perf_counter() - t0, 1)
    model.eval()
    export_speculative_decoding(model, export_dir=export_dir)
    k = max(1, min(10, len(losses)))
    return {"steps": tr.steps, "samples": len(seqs), "tokens": sum(len(q) for q in seqs),
            "final_loss": round(sum(losses[-k:]) / k, 4),
            "final_top1": round(sum(a[0] for a in accs[-k:]) / k, 4),
            "final_top1_by_depth": [round(sum(a[d] for a in accs[-k:]) / k, 4) for d in range(TTT_STEPS)],
            "draft_vocab": nd, **times}


def _pad_batch(seqs, feats, width):
    """Right-pad a batch; padded positions are masked out of the loss and attention."""
    import torch

    b = len(seqs)
    a_dim, v_dim = feats[0][0].shape[1], feats[0][1].shape[1]
    input_ids = torch.zeros(b, width, dtype=torch.long)
    mask = torch.zeros(b, width, dtype=torch.long)
    aux_h = torch.zeros(b, width, a_dim)
    logits = torch.zeros(b, width, v_dim)
    for i, (sq, (a, lg)) in enumerate(zip(seqs, feats)):
        n = len(sq)
        input_ids[i, :n] = torch.tensor(sq)
        mask[i, :n] = 1
        aux_h[i, :n], logits[i, :n] = a, lg.float()
    return input_ids, mask, aux_h, logits


__all__ = ["chat_ids", "draft_vocab", "fingerprint", "load_prompts", "run", "skip_reason",
           "speculative_section", "target_features", "target_sequences", "train_draft"]
