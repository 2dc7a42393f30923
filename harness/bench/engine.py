"""Executor throughput vs Hugging Face transformers ``generate`` on this machine (``make bench-engine``).

    python -m harness.bench.engine --engine build/smollm2-135m-fp8/engine [--hf-model DIR] [--num-requests 64]
        [--output-len 128] [--min-prompt 32] [--max-prompt 512] [--hf-batch 8] [--dtype auto|float32|bfloat16]
        [--hf-dtypes bfloat16,float32] [--output docs/perf/bench-engine.json] [--dry-run]

Both sides get the same prompts (real text from quant/data, cut to lengths spread evenly over
[min, max] in a seeded random order), greedy decoding and exactly ``output-len`` new tokens
(``ignore_eos`` / ``min_new_tokens``). The executor gets all requests at once (in-flight batching)
and computes in what ``engine.cpu_dtype`` chooses (``--dtype`` overrides the bundle's); HF gets
static batches of ``hf-batch`` prompts sorted by length (its best case: least padding), in bf16 AND
fp32 in the same run, and the executor is compared with the faster (``hf_baseline.in_each_dtype``).
Reported: output tokens/s of each, the ratios, the executor's compute dtype with its reason and
timings, TTFT/TPOT percentiles of the executor, and peak RSS of the process after the executor run
(before HF is loaded) and at the end. ``--dry-run``: 2 requests, 4 tokens, HF batch 2, written to
build/bench/ unless ``--output`` says otherwise (checks the whole path in seconds; measures nothing).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch
from harness.bench.perfinfo import cpu_model

REPO = Path(__file__).resolve().parents[2]


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB




def _commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "backend"], cwd=REPO,
                               capture_output=True, text=True).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


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
    p = argparse.ArgumentParser(prog="python -m harness.bench.engine", description=__doc__.split("\n\n")[0])
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
                   help="2 requests x 4 tokens, HF batch 2, output under build/bench/: checks the path, measures nothing")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--hf-max-seconds", type=float, default=None,
                   help="stop HF after the batch crossing this budget; rate over the batches done")
    p.add_argument("--output", default=None, help="default docs/perf/bench-engine.json "
                                                  "(build/bench/bench-engine-dry-run.json with --dry-run)")
    args = p.parse_args(argv)
    hf_dtypes = tuple(d for d in args.hf_dtypes.split(",") if d)
    if not hf_dtypes or any(d not in ("bfloat16", "float32") for d in hf_dtypes):
        p.error(f"--hf-dtypes: {args.hf_dtypes!r}; allowed: a comma-separated subset of bfloat16,float32")
    if args.dry_run:
        args.num_requests, args.output_len, args.min_prompt, args.max_prompt = 2, 4, 8, 16
        args.hf_batch, args.max_batch, args.hf_max_seconds = 2, 2, None
    if args.output is None:
        args.output = str(REPO / "build" / "bench" / "bench-engine-dry-run.json" if args.dry_run
                          else REPO / "docs" / "perf" / "bench-engine.json")
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
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")

    ours = run_executor(str(engine), prompts, args.output_len, args.dtype, args.max_batch)
    ours["peak_rss_mib"] = round(_rss_mib(), 1)
    print(f"executor ({ours['compute_dtype']['dtype']}: {ours['compute_dtype']['reason']}): "
          f"{ours['output_tok_per_s']} tok/s ({ours['seconds']} s), peak RSS {ours['peak_rss_mib']} MiB", flush=True)
    result = {"benchmark": "bench-engine", "date": started, "command": " ".join(["python -m harness.bench.engine"]
                                                                                 + (argv or sys.argv[1:])),
              "commit": _commit(), "machine": {"cpu": cpu_model(), "cores": os.cpu_count(),
                                               "torch_threads": torch.get_num_threads(),
                                               "torch": torch.__version__,
                                               "cpu_capability": torch.backends.cpu.get_cpu_capability()},
              "workload": {"num_requests": args.num_requests, "prompt_len": [args.min_prompt, args.max_prompt],
                           "prompt_tokens": sum(len(p) for p in prompts), "output_len": args.output_len,
                           "greedy": True, "ignore_eos": True, "dry_run": args.dry_run},
              "executor": ours}
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")  # the executor result survives an HF abort
    if not args.skip_hf:
        from harness.bench.hf_baseline import in_each_dtype
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
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}" + (f": {result['speedup_vs_hf']}x HF {result['hf_best_dtype']} (the faster)"
                            if "speedup_vs_hf" in result else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
