"""The CPU kernels (plugins/cpu) on and off, in one process: the engine alone on the serving
benchmark's work (MT-bench first turns as chat prompts, 16 at a time, 64 forced tokens, prefix cache
off so every round computes the same), rounds alternating ABBA so that the machine's drift (10-20% within
minutes) falls on both. ``python -m harness.perf.kernels.cpu_kernels``; writes build/perf/cpu-kernels-ab.json.

Off is what a machine without a C compiler runs: the PyTorch ops (the same numbers as the elementwise
kernels; attention in SDPA tiles, float32 rounding apart: tests/kernels/test_cpu_kernels.py), except
the linears: on an AVX-512 CPU the weights were packed for Kiln's GEMM (plugins/cpu/gemm.c) at load
and it runs both ways (``harness.perf.kernels.cpu_linear`` compares it with FBGEMM's).
``--long-prompt N`` also times the prefill of one N-token prompt with the attention kernel and with
the tiles (the elementwise kernels on both): the kernel's cost on long prompts, where SDPA multiplies
whole tiles as matrices."""
from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Iterator

import torch

from backend.engine.executor import Executor
from backend.engine.sampling_params import SamplingParams
from harness.perf.lib.results import header, write_result
from harness.perf.lib.prompts import load_prompts
from plugins.cpu import ops


def _prompts(engine: Path, n: int) -> list[list[int]]:
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(engine / "tokenizer" / "tokenizer.json"))
    return [tok.encode(f"<|im_start|>user\n{t}<|im_end|>\n<|im_start|>assistant\n").ids
            for t in load_prompts("mtbench")[:n]]


def _abba(rounds: int, a: str, b: str) -> Iterator[tuple[int, str]]:
    """(round, way) in the order the rounds run the two ways: a b, b a, a b, ... so that the machine's
    drift falls on both alike."""
    for r in range(rounds):
        for way in ((a, b) if r % 2 == 0 else (b, a)):
            yield r, way


def run(engine: Path, batch: int, rounds: int, max_tokens: int) -> dict:
    lib = ops.library()
    if lib is None:
        raise SystemExit("the CPU kernels did not load (see the warning above): nothing to compare")
    prompts = _prompts(engine, batch)
    ex = Executor(engine, start=False, max_batch_size=batch, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ex.generate([prompts[0][:8]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))   # warm-up
    tok_s: dict[str, list[float]] = {"kernels": [], "pytorch_ops": []}
    for r, way in _abba(rounds, "kernels", "pytorch_ops"):
        with ops.using(lib if way == "kernels" else None):
            t = time.perf_counter()
            ex.generate(prompts, params)
            tok_s[way].append(round(batch * max_tokens / (time.perf_counter() - t), 2))
        print(f"round {r} {way:12s} {tok_s[way][-1]:7.1f} tok/s", flush=True)
    mean = {k: round(sum(v) / len(v), 2) for k, v in tok_s.items()}
    return {"output_tok_s": tok_s, "mean_tok_s": mean,
            "speedup_of_means": round(mean["kernels"] / mean["pytorch_ops"], 3)}


def long_prefill(engine: Path, tokens: int, rounds: int) -> dict:
    """Seconds to prefill one ``tokens``-long prompt (first token out), attention kernel vs tiles, ABBA."""
    lib = ops.library()
    ex = Executor(engine, start=False, enable_prefix_caching=False)
    prompt = [100 + (13 * i) % 5000 for i in range(tokens)]   # ids only: no text needed to time it
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    ex.generate([prompt[:64]], params)   # warm-up
    secs: dict[str, list[float]] = {"attention_kernel": [], "sdpa_tiles": []}
    for r, way in _abba(rounds, "attention_kernel", "sdpa_tiles"):
        with ops.using(lib, attention=lib if way == "attention_kernel" else None):
            t = time.perf_counter()
            ex.generate([prompt], params)
            secs[way].append(round(time.perf_counter() - t, 3))
        print(f"round {r} {way:16s} {secs[way][-1]:6.2f} s to prefill {tokens} tokens", flush=True)
    return {"prompt_tokens": tokens, "prefill_s": secs,
            "mean_s": {k: round(sum(v) / len(v), 3) for k, v in secs.items()}}


def row_threads(engine: Path, batch: int, rounds: int) -> dict:
    """Seconds to prefill the ``batch`` prompts at once (first tokens out), the elementwise kernels
    on one thread vs PyTorch's team (kernels.c shares a prefill-sized call's rows out), ABBA."""
    threads = torch.get_num_threads()
    prompts = _prompts(engine, batch)
    ex = Executor(engine, start=False, max_batch_size=batch, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    ex.generate([prompts[0][:8]], params)   # warm-up
    ways = {"one_thread": 1, f"{threads}_threads": threads}
    secs: dict[str, list[float]] = {k: [] for k in ways}
    for r, way in _abba(rounds, *ways):
        with ops.row_threads(ways[way]):
            t = time.perf_counter()
            ex.generate(prompts, params)
            secs[way].append(round(time.perf_counter() - t, 4))
        print(f"round {r} {way:12s} {secs[way][-1]:6.3f} s to prefill {len(prompts)} prompts", flush=True)
    med = {k: round(sorted(v)[len(v) // 2], 4) for k, v in secs.items()}
    return {"prompt_tokens": sum(len(p) for p in prompts), "prefill_s": secs, "median_s": med,
            "speedup_of_medians": round(med["one_thread"] / med[f"{threads}_threads"], 3)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", default="build/smollm2-135m-fp8/engine", help="engine bundle (make build)")
    ap.add_argument("--batch", type=int, default=16, help="prompts per round, all at once")
    ap.add_argument("--rounds", type=int, default=4, help="rounds (each runs both ways)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", "--output", dest="out", default=None,
                    help="result JSON (default build/perf/cpu-kernels-ab.json)")
    ap.add_argument("--long-prompt", type=int, default=0, metavar="N",
                    help="also time one N-token prompt's prefill, attention kernel vs SDPA tiles (0: skip)")
    ap.add_argument("--row-threads", type=int, default=0, metavar="ROUNDS",
                    help="also time the batch's prefill with the elementwise kernels on one thread vs "
                         "PyTorch's team, ROUNDS rounds ABBA (0: skip)")
    a = ap.parse_args(argv)
    res = {**header("cpu_kernels", "harness.perf.kernels.cpu_kernels", argv, torch=torch),
           "what": "engine alone (no Triton), greedy, prefix cache off; rounds alternate ABBA",
           **run(Path(a.engine), a.batch, a.rounds, a.max_tokens)}
    if a.long_prompt:
        res["long_prompt"] = long_prefill(Path(a.engine), a.long_prompt, a.rounds)
    if a.row_threads:
        res["row_threads"] = row_threads(Path(a.engine), a.batch, a.row_threads)
    write_result(res, a.out, "cpu-kernels-ab.json")
    print(f"kernels {res['mean_tok_s']['kernels']} vs PyTorch ops {res['mean_tok_s']['pytorch_ops']} tok/s: "
          f"{res['speedup_of_means']}x")


if __name__ == "__main__":
    main()
