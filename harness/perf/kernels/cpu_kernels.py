"""The CPU kernels (plugins/cpu) on and off, in one process: the engine alone on the serving
benchmark's work (MT-bench first turns as chat prompts, 16 at a time, 64 forced tokens, prefix cache
off so every round computes the same), rounds alternating ABBA so that the machine's drift (10-20% within
minutes) falls on both. ``python -m harness.perf.kernels.cpu_kernels``; writes build/perf/cpu-kernels-ab.json.

Off is what a machine without a C compiler runs: the PyTorch ops (the same numbers as the elementwise
kernels; attention in SDPA tiles, float32 rounding apart: tests/kernels/test_cpu_kernels.py), except
the linears: on an AVX-512 CPU the weights were packed for Kiln's GEMM (plugins/cpu/gemm.c) at load
and it runs both ways (``linear`` below compares it with FBGEMM's).
``--long-prompt N`` also times the prefill of one N-token prompt with the attention kernel and with
the tiles (the elementwise kernels on both): the kernel's cost on long prompts, where SDPA multiplies
whole tiles as matrices.

``python -m harness.perf.kernels.cpu_kernels linear``: Kiln's CPU linear path
(``backend/ops/cpu_matmul.py``) against ``F.linear`` over row-major weights, SmolLM2-135M shapes, 30
layers; writes build/perf/cpu_linear.json. The storages compared: MKL over the row-major float32
weight, oneDNN over a column-major one, FBGEMM's fp16 GEMM, and on AVX-512 CPUs Kiln's own GEMM
(plugins/cpu/gemm.c) over fp16 panels and over the e4m3 codes themselves."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Iterator

import torch
import torch.nn.functional as F

from backend.engine.executor import Executor
from backend.engine.sampling_params import SamplingParams
from backend.ops.cpu_matmul import _DNN, _FP16, HalfWeight, PanelWeight, linear
from harness.perf.lib.prompts import load_prompts
from harness.perf.lib.results import header, write_result
from plugins.cpu import gemm as cpu_gemm
from plugins.cpu import ops

MODULE = "harness.perf.kernels.cpu_kernels"


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


def _measure(rows: tuple[int, ...] = (1, 2, 3, 4, 5, 8, 16, 32, 64, 128, 512), reps: int = 5) -> list[dict]:
    """Time SmolLM2-135M's linears over 30 layers of distinct weights (480 MB in fp32: streamed from
    memory as in a real decode step; one layer repeated would sit in cache and flatter every kernel),
    the storages interleaved (a shared machine's noise moves whole runs), best of ``reps``. The weights are
    fp8 e4m3 codes, as an fp8 bundle's are (every storage but the e4m3 one holds their values, exact
    in fp16 as a bf16 checkpoint's weights are); the per-row scale is left out of every way."""
    torch.manual_seed(0)
    shapes = [(1728, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down
    codes = [(torch.randn(s) * 3).to(torch.float8_e4m3fn) for _ in range(30) for s in shapes]
    rowmajor = [c.float() for c in codes]
    ways = {"mkl_row_major_ms": (F.linear, rowmajor)}
    if _DNN is not None:
        ways["onednn_column_major_ms"] = (linear, [w.t().contiguous().t() for w in rowmajor])
    if _FP16 is not None:
        ways["fbgemm_fp16_ms"] = (linear, [HalfWeight(w) for w in rowmajor])
    if cpu_gemm.available():
        ways["kiln_fp16_ms"] = (linear, [PanelWeight(w) for w in rowmajor])
        ways["kiln_e4m3_ms"] = (linear, [PanelWeight(c) for c in codes])
    out = []
    for m in rows:
        xs = [torch.randn(m, s[1]) for s in shapes]
        best = dict.fromkeys(ways, float("inf"))
        for _ in range(reps):
            for key, (fn, ws) in ways.items():
                t = time.perf_counter()
                for i, w in enumerate(ws):
                    fn(xs[i % 4], w)
                best[key] = min(best[key], (time.perf_counter() - t) * 1e3)
        out.append({"rows": m, **{k: round(v, 2) for k, v in best.items()}})
        print(f"rows={m:4d}  " + "   ".join(f"{k[:-3]} {v:7.1f} ms" for k, v in best.items()), flush=True)
    return out


def linear_main(argv: list[str] | None, full_argv: list[str] | None) -> int:
    """``linear [--out F]``: the CPU linear benchmark (``_measure``)."""
    ap = argparse.ArgumentParser(prog=f"python -m {MODULE} linear",
                                 description="Benchmark Kiln's CPU linear path against F.linear over "
                                             "row-major weights (SmolLM2-135M shapes, 30 layers).")
    ap.add_argument("--out", "--output", dest="out", default=None,
                    help="result JSON (default build/perf/cpu_linear.json)")
    args = ap.parse_args(argv)
    res = {**header("cpu_linear", MODULE, full_argv, torch=torch),
           "what": "SmolLM2-135M linears (qkv, o, gate_up, down), 30 layers of distinct fp8 e4m3 code weights "
                   "(exact in fp16), float32 compute, best of 5; onednn_column_major is oneDNN at every row "
                   "count; kiln_* (AVX-512 CPUs) plugins/cpu/gemm.c over fp16 panels and over the codes",
           "results": _measure()}
    write_result(res, args.out, "cpu_linear.json")
    return 0


def main(argv=None) -> int:
    if (sys.argv[1:] if argv is None else list(argv))[:1] == ["linear"]:
        return linear_main((sys.argv[1:] if argv is None else list(argv))[1:], argv)
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
    res = {**header("cpu_kernels", MODULE, argv, torch=torch),
           "what": "engine alone (no Triton), greedy, prefix cache off; rounds alternate ABBA",
           **run(Path(a.engine), a.batch, a.rounds, a.max_tokens)}
    if a.long_prompt:
        res["long_prompt"] = long_prefill(Path(a.engine), a.long_prompt, a.rounds)
    if a.row_threads:
        res["row_threads"] = row_threads(Path(a.engine), a.batch, a.row_threads)
    write_result(res, a.out, "cpu-kernels-ab.json")
    print(f"kernels {res['mean_tok_s']['kernels']} vs PyTorch ops {res['mean_tok_s']['pytorch_ops']} tok/s: "
          f"{res['speedup_of_means']}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
