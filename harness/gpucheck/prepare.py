"""Prepare the GPU check on this CPU machine: `python -m harness.gpucheck prepare`.

The GPU machine has no network and takes at most 64 MiB of files, so the real SmolLM2 (270 MB) cannot
go there. Instead this builds a TINY random-weight Llama (4 layers, GQA 4, head dim 64) with its own
small BPE tokenizer trained on quant/data, and runs the REAL builder on it (import -> ModelOpt
quantize -> compile with AOT cubins for sm_90 -> package) for every format the GPU path treats
differently: bf16, FP8 + FP8 KV (torch._scaled_mm, fp8 KV kernels), NVFP4 and INT4-AWQ (W4A16 GEMM
kernels). It then records this CPU's own greedy outputs (fp32) for the same prompts, so the GPU run
can compare against them. The newer families (Qwen3, Mistral with a window, Gemma 3) get one bf16 bundle
each, with transformers' logits computed here (harness/gpucheck/families.py). Everything lands in
build/gpu-check/: carry hf/, */engine/ and ref/ (60 MiB; the hf-<family>/ folders stay here).
Random weights make accuracy meaningless, so the build's verify stage is off for these bundles.
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "build" / "gpu-check"
TINY = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=1, head_dim=64, vocab_size=4096, max_position_embeddings=4096,
            rope_theta=10000.0, tie_word_embeddings=True, rms_norm_eps=1e-5, bos_token_id=1,
            eos_token_id=2, pad_token_id=2)
# bundle name -> quantization section
FORMATS = {
    "bf16": {"format": "none", "kv_cache": "none"},
    "fp8": {"format": "fp8", "kv_cache": "fp8"},
    "nvfp4": {"format": "nvfp4", "kv_cache": "none"},
    "int4_awq": {"format": "int4_awq", "kv_cache": "fp8", "group_size": 64},
}
NUM_PROMPTS, PROMPT_MAX, MAX_TOKENS = 8, 96, 32


def _texts() -> list[str]:
    out = []
    for name in ("calibration.jsonl", "heldout.jsonl"):
        f = REPO / "quant" / "data" / name
        out += [json.loads(line)["text"] for line in f.read_text().splitlines() if line.strip()]
    return out


def make_tokenizer(dest: Path) -> None:
    """A 4096-token byte-level BPE trained on the repo's calibration text (seconds)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY["vocab_size"], special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_texts(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="</s>")
    fast.save_pretrained(dest)


def make_model(dest: Path, seed: int = 0) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    # A larger init than HF's 0.02 gives peaked next-token distributions, so greedy decoding is not
    # decided by rounding-level ties and CPU/GPU outputs can be compared token for token.
    cfg = LlamaConfig(**TINY, initializer_range=0.08, dtype="bfloat16")
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(dest)


def build_config(name: str, hf_dir: Path) -> dict:
    return {
        "model": {"source": str(hf_dir), "dtype": "bfloat16"},
        "quantization": {**FORMATS[name], "exclude": ["lm_head"],
                         "calibration": {"num_samples": 8, "max_seq_len": 128}},
        "engine": {"max_batch_size": 64, "max_num_tokens": 2048, "max_seq_len": 1024, "max_input_len": 512,
                   "max_kv_tokens": 65536, "target_sms": [90]},
        "verify": {"enabled": False},
        "output": {"dir": str(OUT / name)},
    }


def prompts(tokenizer_dir: Path) -> list[list[int]]:
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    texts = _texts()[-NUM_PROMPTS:]
    lens = [8 + (PROMPT_MAX - 8) * i // (NUM_PROMPTS - 1) for i in range(NUM_PROMPTS)]
    return [tok.encode(t).ids[:n] for t, n in zip(texts, lens)]


def cpu_reference(bundle: Path, ids: list[list[int]], save_logits: bool = True) -> list[list[int]]:
    """This CPU's fp32 greedy outputs, and (in cpu_logits.safetensors beside the bundle) its
    teacher-forced next-token logits at every generated position, for the GPU's KL comparison
    (build/gpu-check/ref/<name>-cpu-logits.safetensors)."""
    import torch
    from safetensors.torch import save_file

    from backend.engine.executor import Executor
    from backend.runtime.native import prefill_logits
    from backend.engine.sampling_params import SamplingParams
    ex = Executor(bundle, device="cpu", dtype=torch.float32, start=False, attention_backend="torch")
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outs = [r.token_ids for r in ex.generate(ids, params)]
    (OUT / "ref").mkdir(exist_ok=True)
    if not save_logits:
        return outs
    # every request has finished: the pool's blocks are free for prefill_logits to write into
    logits = [prefill_logits(ex.runner, p + o[:-1])[len(p) - 1:] for p, o in zip(ids, outs)]
    save_file({"logits": torch.cat(logits).half()}, str(OUT / "ref" / f"{bundle.parent.name}-cpu-logits.safetensors"))
    return outs


def main() -> int:
    from builder.config import BuildConfig
    from builder.pipeline import run_pipeline
    t0 = time.time()
    OUT.mkdir(parents=True, exist_ok=True)
    hf = OUT / "hf"
    if not (hf / "model.safetensors").is_file():
        tmp = OUT / "hf.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        make_tokenizer(tmp)
        make_model(tmp)
        tmp.rename(hf)
    ids = prompts(hf)
    ref = {"prompts": ids, "max_tokens": MAX_TOKENS, "bundles": {}}
    for name in FORMATS:
        cfg = BuildConfig.from_dict(build_config(name, hf), file=f"<gpu-check {name}>")
        res = run_pipeline(cfg, log=lambda m, n=name: print(f"[{n}] {m}"))
        bundle = res.results["compile"].path if "compile" in res.results else OUT / name / "engine"
        bundle = OUT / name / "engine" if (OUT / name / "engine" / "engine.json").is_file() else bundle
        ref["bundles"][name] = {"path": str(bundle.relative_to(REPO)), "cpu_fp32_greedy": cpu_reference(bundle, ids)}
        print(f"[{name}] bundle {bundle} ({time.time() - t0:.0f} s)")
    from harness.gpucheck import families
    ref["bundles"].update(families.prepare(OUT, hf, TINY, build_config("bf16", hf), ids, cpu_reference, REPO))
    (OUT / "ref").mkdir(exist_ok=True)
    (OUT / "ref" / "reference.json").write_text(json.dumps(ref) + "\n")
    size = sum(p.stat().st_size for p in OUT.rglob("*") if p.is_file())
    print(f"gpu-check prepared in {time.time() - t0:.0f} s: {OUT} ({size / 2**20:.1f} MiB); "
          f"on the GPU machine run: python -m harness.gpucheck run")
    return 0
