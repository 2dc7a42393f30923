"""Verify stage: the accuracy gate between the compiled bundle and the unquantized model.

Both models read the same held-out prompts (``quant/data/heldout.jsonl``, never used for
calibration). The reference is the import stage's checkpoint run by Hugging Face transformers in
fp32; the candidate is the bundle run by OUR runtime (``backend.runtime.native.ModelRunner``: the same
linear formats, KV-cache dtype and attention code that serve it). For every prompt position we
compare next-token distributions: top-1 agreement and mean KL(reference || bundle).

Two paths, the same figures (``verify.path``): ``whole`` loads both models whole (the fastest on a
small model; about 10 bytes per parameter), ``streamed`` runs each one decoder layer at a time over
all prompts (``verify_stream.py``: one layer resident, memory flat in depth); ``auto`` streams above
``STREAM_ABOVE_BYTES`` of fp32 weights, quantize's threshold, so a build streams both or neither.

The build fails (``passed: False``; the pipeline records it in engine.json and stops) when the
agreement is below ``verify.min_top1_agreement`` or the KL above ``verify.max_mean_kl``; ``null``
takes the per-format default below, chosen from measurements on SmolLM2-135M (see the table's
comments) with headroom so that run-to-run noise of calibration does not fail a healthy build.

When the bundle carries an EAGLE-3 draft, the stage also measures what the draft is worth: the
same held-out prompts, chat-formatted, are decoded greedily (``ACCEPT_TOKENS`` each, all in one
batch) by the real executor with the bundle's tree settings, and the mean acceptance length
(tokens emitted per target pass, bonus included), acceptance rate and draft counts go into
``engine.json["verify"]["speculative"]``. It is a measurement, not a gate: a weak draft costs speed,
never correctness (greedy output is identical either way).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from backend.runtime.native import prefill_logits  # the one teacher-forced pass (verify and gpucheck)
from builder.memory import RUNTIME_BASE, MemoryEstimate, checkpoint_params
from builder.stages.base import StageContext, StageError
from builder.stages.verify_stream import compare  # one metric for both paths

HELDOUT = Path(__file__).resolve().parents[2] / "quant" / "data" / "heldout.jsonl"
MAX_PROMPT_TOKENS = 256
ACCEPT_TOKENS = 48          # tokens generated per held-out prompt for the draft's acceptance figures
STAGE_VERSION = 1           # 1: acceptance figures of an EAGLE-3 draft
# Above this many bytes of fp32 weights verify streams (quant.quantize.STREAM_ABOVE_BYTES's value:
# measured there, and below it the whole path's ~10 bytes per parameter fit any build machine)
STREAM_ABOVE_BYTES = 2 << 30

# format -> (min top-1 agreement, max mean KL in nats), for SmolLM2-135M-sized models on the 8
# default held-out prompts (138 positions, so one position is 0.7 points). Measured 2026-11-25:
#   none (bf16 weights, bf16 KV): top-1 0.986, KL 0.0022
#   fp8 + fp8 KV, three calibrations: top-1 0.906 / 0.899 / 0.841, KL 0.064 / 0.062 / 0.073
#   nvfp4 + fp8 KV (W4A4 emulated): top-1 0.630, KL 0.598 (weights alone, W4A16: 0.688, 0.347):
#   4-bit floats cost a 135M model far more than an 8B one; the gate only catches broken builds.
# int8_sq, int4_awq and w4a8_awq are provisional (not measured here yet).
DEFAULT_THRESHOLDS: dict[str, tuple[float, float]] = {
    "none": (0.95, 0.02),
    "fp8": (0.80, 0.12),
    "int8_sq": (0.75, 0.25),    # provisional
    "int4_awq": (0.60, 0.60),   # provisional, set near nvfp4's W4A16 measurement (0.688, 0.347)
    "w4a8_awq": (0.55, 0.80),   # provisional
    "nvfp4": (0.55, 0.80),
}


def choose_path(ctx: StageContext) -> str:
    """``verify.path``, with ``auto`` resolved by the imported checkpoint's size (headers only)."""
    asked = ctx.config.verify.path
    if asked != "auto":
        return asked
    return "streamed" if 4 * checkpoint_params(ctx.results["import"].path) > STREAM_ABOVE_BYTES else "whole"


def memory_estimate(ctx: StageContext) -> MemoryEstimate:
    """whole: the unquantized reference in fp32 (4 bytes/parameter) beside the bundle run in fp32
    (4 more), plus load-time copies: measured 8.9-9.0 bytes/parameter above the runtime at 12 and 24
    layers (docs/perf/build-memory-verify.json before streaming), so 10.
    streamed: see ``streamed_bytes``."""
    hf_dir = ctx.results["import"].path
    path = choose_path(ctx)
    if path == "whole":
        params = checkpoint_params(hf_dir)
        return MemoryEstimate(RUNTIME_BASE + 10 * params, 0,
                              f"whole: reference and bundle, {params / 1e9:.2f} B parameters, both in fp32",
                              "verify.path=streamed (one decoder layer at a time) or verify.enabled=false")
    host, detail = streamed_bytes(hf_dir, ctx.config.verify.num_prompts)
    return MemoryEstimate(host, 0, detail, "verify.num_prompts smaller, or verify.enabled=false")


def streamed_bytes(hf_dir, num_prompts: int) -> tuple[int, str]:
    """(peak host bytes, what dominates) of the streamed comparison: the runtime, one model's hidden
    states and the reference logits (tokens x (hidden + vocabulary) x 4, tokens bounded by
    num_prompts x MAX_PROMPT_TOKENS: the prompts are not tokenized here), the rope tables, and the
    larger of
    * one decoder layer: the reference's fp32 copy (4 bytes/parameter) with the bf16 tensor being
      read (2), or the bundle's packed layer (fp32 compute storage, 4) with its read tensors (<= 2)
      and the fp16-exactness checks on its largest matrix (~7 per parameter of that matrix): 9;
      plus the layer's own activations for one prompt (the MLP's, and attention scores);
    * one head (vocabulary x hidden): the bundle's fp32 copy (4), cpu_matmul's fp16-exactness check
      (an fp16 and an fp32 round trip and a mask: 7) then its packed copy: 11.
    Measured (docs/perf/build-memory-verify.json, hidden 2048, vocabulary 49152, 8 prompts): 1.74 GiB
    at 12 layers and at 24 against this 2.33 GiB (the head phase; the token bound counts
    2048 tokens of logits where the held-out prompts have 138)."""
    import json

    from quant.stream import LAYER_PREFIX, Shards

    cfg = json.loads((Path(hf_dir) / "config.json").read_text())
    hidden, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    layer = Shards(Path(hf_dir)).numel(f"{LAYER_PREFIX}0.")
    tokens = num_prompts * MAX_PROMPT_TOKENS
    t = MAX_PROMPT_TOKENS
    per_prompt = (4 * t * inter + heads * t * t + 6 * t * hidden) * 4
    layer_phase = 9 * layer + per_prompt
    head_phase = 11 * vocab * hidden
    rope = 4 * cfg.get("max_position_embeddings", 4096) * head_dim * 4
    host = RUNTIME_BASE + tokens * (hidden + vocab) * 4 + rope + max(layer_phase, head_phase)
    return host, (f"streamed: one layer of {layer / 1e6:.0f} M parameters in fp32, a head of "
                  f"{vocab * hidden / 1e6:.0f} M, {num_prompts} prompts' logits")


def skip_reason(ctx: StageContext) -> str | None:
    return None if ctx.config.verify.enabled else "verify.enabled is false"


def fingerprint(ctx: StageContext) -> str:
    st = HELDOUT.stat() if HELDOUT.exists() else None
    return f"heldout:{st.st_size}:{st.st_mtime_ns}" if st else "heldout:missing"


def thresholds(ctx: StageContext, fmt: str) -> tuple[float, float]:
    v = ctx.config.verify
    if fmt not in DEFAULT_THRESHOLDS:
        raise StageError(f"verify: no default thresholds for quantization.format {fmt!r}; "
                         f"allowed: {', '.join(DEFAULT_THRESHOLDS)} (or set verify.min_top1_agreement "
                         "and verify.max_mean_kl)")
    top1, kl = DEFAULT_THRESHOLDS[fmt]
    return (top1 if v.min_top1_agreement is None else v.min_top1_agreement,
            kl if v.max_mean_kl is None else v.max_mean_kl)


def load_prompts(n: int, path: Path = HELDOUT) -> list[str]:
    if not path.is_file():
        raise StageError(f"{path}: held-out prompts not found; allowed: the file shipped in quant/data")
    texts = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                texts.append(json.loads(line)["text"])
            except (ValueError, KeyError, TypeError):
                raise StageError(f"{path}:{i}: expected a JSON object with a \"text\" string") from None
        if len(texts) == n:
            break
    if not texts:
        raise StageError(f"{path}: no prompts")
    return texts


def verify_device(asked: str) -> str:
    """verify.device -> where the streamed comparison runs; cuda asked on a machine without one is refused."""
    cuda = torch.cuda.is_available()
    if asked == "cuda" and not cuda:
        raise StageError("verify.device: cuda, but no NVIDIA GPU is visible (torch.cuda.is_available() is "
                         "false); allowed here: auto, cpu")
    return "cuda" if asked == "cuda" or (asked == "auto" and cuda) else "cpu"


def whole_compare(ref_dir: Path, spec, prompts: list[list[int]], progress) -> tuple[int, float, int]:
    """(agreeing positions, summed KL, positions): both models loaded whole, one prompt at a time."""
    from transformers import AutoModelForCausalLM

    from backend.runtime.native import ModelRunner

    # fp32 like the reference: this measures what quantization costs, and the thresholds were set on
    # fp32 compute; engine.cpu_dtype auto could pick bf16 on another CPU and add its rounding
    runner = ModelRunner(spec, device="cpu", dtype=torch.float32, window_pool=False)   # whole prompts at once
    ref = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    agree = positions = 0
    kl_sum = 0.0
    with progress("verify: bundle vs unquantized model", len(prompts)) as advance, torch.inference_mode():
        for ids in prompts:
            ref_logits = ref(torch.tensor([ids])).logits[0]
            a, k, n = compare(ref_logits, prefill_logits(runner, ids))
            agree, kl_sum, positions = agree + a, kl_sum + k, positions + n
            advance(1)
    return agree, kl_sum, positions


def run(ctx: StageContext) -> dict:
    from backend.runtime.spec import load_engine_spec
    from backend.serving.conversion.tokenizer import load_tokenizer

    bundle_dir = ctx.results["compile"].path
    ref_dir = ctx.results["import"].path
    spec = load_engine_spec(bundle_dir, {"max_kv_tokens": MAX_PROMPT_TOKENS + 16}, verify_hashes=False)
    fmt = spec.quant_format
    min_top1, max_kl = thresholds(ctx, fmt)
    texts = load_prompts(ctx.config.verify.num_prompts)
    tok = load_tokenizer(bundle_dir)
    prompts = [tok.encode(t)[:MAX_PROMPT_TOKENS] for t in texts]
    path = choose_path(ctx)
    if path == "streamed":
        from backend.runtime.spec import EngineError
        from builder.stages.verify_stream import streamed_compare
        device = verify_device(ctx.config.verify.device)
        try:
            agree, kl_sum, positions = streamed_compare(ref_dir, spec, prompts, ctx.progress, device)
        except EngineError as e:
            raise StageError(f"verify: {e} (verify.path streamed)") from None
    else:
        device = "cpu"
        agree, kl_sum, positions = whole_compare(ref_dir, spec, prompts, ctx.progress)
    top1, mean_kl = agree / positions, kl_sum / positions
    passed = top1 >= min_top1 and mean_kl <= max_kl
    ctx.log(f"verify: {fmt} top-1 agreement {top1:.4f} (min {min_top1}), mean KL {mean_kl:.5f} "
            f"(max {max_kl}) over {positions} positions of {len(prompts)} prompts ({path}, {device}): "
            f"{'passed' if passed else 'FAILED'}")
    result = {"top1_agreement": round(top1, 5), "mean_kl": round(mean_kl, 6), "num_prompts": len(prompts),
              "num_positions": positions, "format": fmt, "kv_cache_dtype": spec.kv_cache_dtype,
              "min_top1_agreement": min_top1, "max_mean_kl": max_kl, "passed": passed}
    accept = draft_acceptance(ctx, bundle_dir, texts, spec.manifest.speculative)
    if accept is not None:
        result["speculative"] = accept
    # which path ran goes to verify.json only: engine.json's verify section is the bundle format's
    (ctx.out_dir / "verify.json").write_text(json.dumps(dict(result, path=path, device=device), indent=1))
    return result


def draft_acceptance(ctx: StageContext, bundle_dir: Path, texts: list[str], spec) -> dict | None:
    """Acceptance figures of the bundle's EAGLE-3 draft (``spec``: its manifest's ``speculative``
    section, a backend.bundle.Speculative or None) on the held-out prompts (None without one)."""
    if spec is None or spec.method != "eagle3":
        return None
    from backend.engine.executor import Executor
    from backend.speculative.measure import acceptance
    from backend.serving.conversion.tokenizer import load_tokenizer

    tok = load_tokenizer(bundle_dir)
    prompts = [tok.encode(t, chat=True)[-MAX_PROMPT_TOKENS:] for t in texts]
    kv = len(prompts) * (MAX_PROMPT_TOKENS + ACCEPT_TOKENS + 64)
    # The runner's own compute dtype (fp32 on CPUs without native bf16), as serving on this host.
    ex = Executor(bundle_dir, start=False, verify_hashes=False, max_kv_tokens=kv,
                  max_batch_size=max(1, len(prompts)))
    with ctx.progress("verify: draft acceptance on held-out prompts", None):
        r = acceptance(ex, prompts, ACCEPT_TOKENS, batch=len(prompts))
    r.update(tree=spec.tree, max_draft_len=spec.max_draft_len, dtype=str(ex.runner.dtype).removeprefix("torch."),
             prompts=f"{HELDOUT.parent.parent.name}/{HELDOUT.parent.name}/{HELDOUT.name} (chat template)")
    ctx.log(f"verify: EAGLE-3 draft ({r['tree']}) {r['tokens_per_target_pass']:.2f} tokens per target pass "
            f"(acceptance length {r['mean_acceptance_length']:.2f} per verifying step, "
            f"{r['spec_undrafted_steps']} steps without drafts), acceptance rate {r['acceptance_rate']:.2f} "
            f"({r['draft_tokens_accepted']}/{r['draft_tokens_proposed']} drafts) over {len(prompts)} held-out prompts "
            f"x {ACCEPT_TOKENS} tokens")
    return r
