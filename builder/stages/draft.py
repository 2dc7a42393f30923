"""Draft stage: an EAGLE-3 head for speculative decoding (``speculative.method: eagle3``).

``speculative.draft: train`` trains one with NVIDIA ModelOpt (``mtsp.convert`` with the EAGLE-3
config sized to the target, ModelOpt's own loss and train-time-test steps, then
``export_speculative_decoding``). The training text is the ENGINE's own greedy continuation of each
prompt, so the draft learns what this bundle says (its quantized weights, compute dtype and kernels),
not what a dataset says. How it stays small and fast:

* the target is Kiln's runtime, not transformers: the stage packs the checkpoint with compile's code
  into a short-lived bundle inside its own temporary output and the executor answers the prompts
  (on the GPU when there is one), recording the aux layers' and the final hidden states as it goes
  (``draft_data.py``). A separate stage or a compile-first order would let the served bundle exist
  before its draft, i.e. a bundle that looks complete without one; packing twice costs seconds;
* offline features: training steps only run the draft (``eagle_offline``) on a base model that is
  just the embedding and the lm_head (ModelOpt's ``FakeBaseModel``): no decoder layer of the target
  is ever loaded for training;
* the distillation targets are the target's logits over the DRAFT vocabulary, computed once from
  those hidden states: left to itself ModelOpt multiplies every training token by the full 49k-row
  lm_head at every step, which was most of a step's time;
* a draft vocabulary of the most frequent tokens (``DRAFT_VOCAB``, with ``d2t``), its lm_head rows
  initialised from the target's, so the head is useful after a few dozen steps;
* the draft trains in fp32 (AdamW on bf16 draft weights stalls) and is exported in the target's dtype.

``speculative.draft: <path>`` imports an EAGLE-3 checkpoint in the public HF layout and refuses one
whose hidden size, vocabulary or aux layers do not fit the target.

Output (top of ``ctx.out_dir``, copied to ``engine/draft/`` by compile): ``weights.safetensors`` and
``config.json`` (``backend/speculative/checkpoint.py``); ``info["speculative"]`` goes into engine.json.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import shutil
import tempfile
import time
from pathlib import Path

from builder.memory import RUNTIME_BASE, MemoryEstimate, checkpoint_params
from builder.stages.base import StageContext, StageError
from builder.stages.draft_data import GEN_BATCH, draft_logits, draft_vocab, load_prompts, prompts_path, resolve, target_data
from builder.stages.draft_settings import runtime_settings

DRAFT_VOCAB = 8192          # rows of the draft lm_head (SmolLM2: 49152 -> 6x cheaper drafting)
BATCH = 4                   # training sequences per step
TTT_STEPS = 3               # ModelOpt's train-time-test depth (draft fed its own outputs)


def memory_estimate(ctx: StageContext) -> MemoryEstimate:
    """Two phases, the recorded rows held through both (bf16, per training token: the aux layers'
    and the final hidden state, then the aux layers' and the draft-vocabulary logits):

    * answers: the engine. On a GPU its weights and KV cache live there (the host only streams
      them through); on a CPU the bundle's tensors as read plus the compute dtype's copies (4 bytes
      per parameter unless engine.cpu_dtype is bfloat16) and the KV pool, in RAM;
    * training: ModelOpt's base model, which is only the embedding (fp32) and the lm_head, plus the
      draft with its gradients and AdamW state (fp32).
    Neither grows with the target's depth on a GPU: the data scale with the prompts and seq_len."""
    import torch  # noqa: PLC0415

    s = ctx.config.speculative
    if s.draft != "train":
        return MemoryEstimate(RUNTIME_BASE, 0, "an imported draft head")
    c = json.loads((ctx.results["import"].path / "config.json").read_text())
    h, v, layers = c["hidden_size"], c["vocab_size"], c["num_hidden_layers"]
    kv_dim = c.get("num_key_value_heads", c["num_attention_heads"]) * (
        c.get("head_dim") or h // c["num_attention_heads"])
    ckpt = ctx.checkpoint_dir()
    weights = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    params = checkpoint_params(ckpt)
    tokens = s.train.num_prompts * s.train.seq_len
    aux = len(s.aux_layers) if s.aux_layers is not None else 3
    cuda = torch.cuda.is_available()
    fp32 = not cuda and ctx.config.engine.cpu_dtype != "bfloat16"
    kv = GEN_BATCH * (s.train.seq_len + 16) * layers * 2 * kv_dim * (4 if fp32 else 2)
    engine = 0 if cuda else weights + (4 * params if fp32 else 0) + kv
    answers = tokens * (aux + 1) * h * 2 + engine
    draft = 3 * h * h + 2 * h * (h + 2 * kv_dim) + h * h + 3 * h * c["intermediate_size"] + DRAFT_VOCAB * h
    training = tokens * (aux * h + DRAFT_VOCAB) * 2 + v * h * (4 + 2) + 16 * draft
    where = "GPU" if cuda else "CPU"
    return MemoryEstimate(RUNTIME_BASE + max(answers, training), weights + kv if cuda else 0,
                          f"{tokens} training tokens' states and logits; the engine on the {where}"
                          + ("" if cuda else f" ({params / 1e9:.2f} B parameters in RAM)"),
                          "fewer speculative.train.num_prompts or seq_len; a GPU (the engine's weights then "
                          "stay off the host); speculative.draft=<path to a trained EAGLE-3 checkpoint>")


def skip_reason(ctx: StageContext) -> str | None:
    if ctx.config.speculative.method == "none":
        return "speculative.method is none"
    return None


def fingerprint(ctx: StageContext) -> str:
    s = ctx.config.speculative
    # The training answers come from the engine: the keys that change its numbers count (here, not
    # as config sections: engine.cpu_dtype at its default is left out of the config's hashes).
    e = ctx.config.engine
    parts = ["draft-v5", f"vocab={DRAFT_VOCAB}", f"batch={BATCH}", f"ttt={TTT_STEPS}",
             f"cpu_dtype={e.cpu_dtype}", f"attention={e.attention_backend}"]
    for p in ([prompts_path(ctx)] if s.draft == "train" else [resolve(ctx, Path(s.draft))]):
        if p.is_file():
            st = p.stat()
            parts.append(f"{p}:{st.st_size}:{int(st.st_mtime)}")
        elif p.is_dir():
            parts += [f"{f}:{f.stat().st_size}:{int(f.stat().st_mtime)}" for f in sorted(p.iterdir()) if f.is_file()]
    return ";".join(parts)


def run(ctx: StageContext) -> dict:
    from backend.speculative.checkpoint import DraftCheckpointError, read_hf_draft, write_bundle_draft

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
        path = resolve(ctx, Path(s.draft))
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
    return {"method": ctx.config.speculative.method, "draft_dir": "draft", **runtime_settings(ctx.config),
            "aux_layers": list(cfg.aux_layers), "draft_vocab_size": cfg.draft_vocab_size}


def _torch_dtype(name: str):
    import torch
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[str(name)]


# ---- training ------------------------------------------------------------------------------------

def train_draft(ctx: StageContext, target_dir: Path, export_dir: Path) -> dict:
    import torch
    from transformers import AutoConfig, AutoTokenizer
    import modelopt.torch.speculative as mtsp
    from modelopt.torch.export import export_speculative_decoding
    from modelopt.torch.speculative.plugins.modeling_fakebase import FakeBaseModel

    from backend.speculative.checkpoint import default_aux_layers
    from builder.stages.compile import write_bundle

    s = ctx.config.speculative
    tr = s.train
    torch.manual_seed(0)
    times = {}
    tok = AutoTokenizer.from_pretrained(target_dir)
    c = AutoConfig.from_pretrained(target_dir)
    aux = tuple(s.aux_layers) if s.aux_layers is not None else default_aux_layers(c.num_hidden_layers)
    prompts = load_prompts(ctx, tr.num_prompts)
    # The target is the engine: the checkpoint packed by compile's own code into a bundle without
    # draft (and without AOT cubins: the runtime JIT-compiles the same kernels), run by Kiln's executor
    # on the GPU when there is one. The folder is inside this stage's temporary output, so an
    # interrupted build leaves nothing that looks finished, and it is removed before the stage ends
    # (compile writes the served bundle; packing twice costs seconds against the draft's minutes).
    bundle_dir = ctx.out_dir / "target-bundle"
    bundle_dir.mkdir()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.perf_counter()
    try:
        write_bundle(ctx, bundle_dir, with_draft=False, aot=False)
        with ctx.progress("draft: target answers", len(prompts)) as advance:
            samples = target_data(bundle_dir, tok, prompts, tr.seq_len, aux, advance, device, ctx.log)
    finally:
        shutil.rmtree(bundle_dir, ignore_errors=True)
    times["generate_s"] = round(time.perf_counter() - t0, 1)
    seqs = [x.ids for x in samples]
    ctx.log(f"draft: the engine ({device}) answered {len(seqs)} prompts, {sum(map(len, seqs))} tokens with "
            f"their hidden states, {times['generate_s']} s")
    # the answers' last tokens (EOS among them) have no states but are words the draft must predict
    vocab_ids = draft_vocab([x.ids + [x.last] for x in samples], c.vocab_size, DRAFT_VOCAB)

    # ModelOpt's EAGLE wrapper needs a base model object; offline it only reads the embedding (the
    # draft embeds its input tokens with it), the lm_head (the draft's device, and its vocabulary
    # rows below) and the config. ModelOpt's own FakeBaseModel is exactly that, read tensor by tensor
    # from the checkpoint: no decoder layer is ever loaded. The embedding runs in fp32 (AdamW on bf16
    # draft weights stalls, and the draft takes the base model's dtype).
    model = FakeBaseModel.from_source(str(target_dir))
    model.embed_tokens.float()
    model.model.dtype = model.config.dtype = torch.float32
    head = model.lm_head.weight
    feats = [(x.aux, lg) for x, lg in zip(samples, draft_logits(samples, head[vocab_ids]))]
    del samples

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
    # FakeBaseModel's post_init draws random numbers for the tensors it then overwrites: seed again,
    # so the draft's initial weights depend on the seed only (as when the target came from transformers)
    torch.manual_seed(0)
    mtsp.convert(model, [("eagle", cfg)])
    em = model.eagle_module
    ids_t = torch.tensor(vocab_ids)
    nd = len(vocab_ids)
    if nd < c.vocab_size:
        em.d2t.copy_(ids_t - torch.arange(nd))
    with torch.no_grad():  # start from the target's own output embedding rows
        em.lm_head.weight.copy_(head[ids_t].float())
    # Offline, the base lm_head is never multiplied (the logits are given) and the export takes the
    # draft's own head: drop the full vocabulary x hidden matrix (2.1 GB at 70B) before training.
    model.lm_head.weight = torch.nn.Parameter(head.new_empty(0, head.shape[1]), requires_grad=False)
    del head
    # The precomputed logits already cover just the draft vocabulary; ModelOpt would otherwise
    # gather those columns out of full-vocabulary logits.
    full_to_draft = model._map_logits_to_draft_vocab
    model._map_logits_to_draft_vocab = lambda x: x if x.shape[-1] == nd else full_to_draft(x)

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=tr.learning_rate, weight_decay=0.0)
    warm = max(1, tr.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min(1.0, (i + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(i, tr.steps) / tr.steps)))
    # Batches of neighbours in length order (a random window each step): little padding, and
    # the answers' lengths vary a lot. ModelOpt caches its train-time-test attention masks per TTT
    # step only, so they are dropped whenever the width changes, or a batch of another width
    # would meet a mask of the wrong size.
    by_len = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    batch = min(BATCH, len(seqs))
    last_width = None
    model.train()
    gen = torch.Generator().manual_seed(0)
    losses, accs = [], []
    t0 = time.perf_counter()
    with ctx.progress("draft: training", tr.steps) as advance:
        for step in range(tr.steps):
            first = int(torch.randint(len(seqs) - batch + 1, (1,), generator=gen))
            pick = by_len[first:first + batch]
            width = len(seqs[pick[-1]])
            if width != last_width:
                model._cached_attn_blk_masks.clear()
                last_width = width
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


__all__ = ["draft_vocab", "fingerprint", "load_prompts", "run", "runtime_settings", "skip_reason",
           "speculative_section", "train_draft"]
