"""Host overhead per engine step, with a model that costs nothing.

    python -m harness.perf.step.host_overhead [--num-seqs 256] [--steps 400] [--output F]

The "model" is a stub returning a fixed logits tensor (it computes nothing), so what is timed is
exactly the host work of a step: ``schedule()`` (scheduler + block manager), input preparation
(``InputPreparer.prepare``: input ids, positions, slot mapping, block tables, lengths, tensors),
sampling bookkeeping (greedy pick on the stub's logits and the copy back to Python) and
``update()`` (append tokens, finish checks, freeing). Two scenarios:

- ``decode``: ``num_seqs`` sequences all decoding (none finishes inside the window);
- ``churn``: the same population, but requests finish and are replaced by new 32-512 token prompts,
  so steps mix chunked prefills, admissions, prefix-cache commits and frees;
- ``executor`` and ``executor_overlap``: the whole ``Executor.step`` (the above plus the sampler's
  rows, the overlapped loop's late tokens and one event per request) with the synchronous and the
  overlapped loop, ``num_seqs`` requests decoding (``executor_stepper`` below).

The executor scenarios' executor is real (bundle, scheduler, preparer, sampler, events, both loops)
and only the forward is replaced: ``runner.execute`` returns ``harness.perf.lib.models.StubModel``'s
logits (vocabulary ``STUB_VOCAB``, so the greedy argmax stands in for a device op, not for a real
vocabulary's sampling on the CPU). A served step does that work on the same thread once per running
request; on a GPU it decides whether the host keeps up with the device at large batches: with overlap
scheduling it must fit inside the device's step, without it (speculative decoding) it adds to it.

Timings are wall clock on whatever machine runs it; on a shared development machine they are noisy
(the JSON records the CPU and the load average).
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import random
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np
import torch

from backend.engine.inputs import InputPreparer
from backend.engine.kv_cache import BlockManager
from backend.engine.request import Request
from backend.engine.sampling_params import SamplingParams
from backend.engine.scheduler import Scheduler
from harness.perf.lib.models import STUB_VOCAB, StubModel
from harness.perf.lib.results import header, write_result

PARTS = ("schedule", "prepare_inputs", "model_stub", "sample", "update")
# The code this benchmark measures: "-dirty" in the recorded commit means one of these differs.
_MEASURED_FILES = ("backend/engine/scheduler.py", "backend/engine/scheduler_types.py",
                   "backend/engine/scheduler_update.py", "backend/engine/scheduler_policies.py",
                   "backend/engine/kv_cache.py", "backend/engine/inputs.py",
                   "backend/engine/request.py", "backend/engine/sampling_params.py",
                   "backend/ops/attention/metadata.py", "backend/engine/executor.py", "backend/engine/overlap.py",
                   "backend/engine/late_tokens.py", "backend/engine/sampler.py", "backend/engine/events.py",
                   "backend/engine/request_table.py", "backend/engine/sync_loop.py",
                   "harness/perf/step/host_overhead.py", "harness/perf/lib/models.py")
SCENARIOS = ("decode", "churn", "executor", "executor_overlap")


# The engine classes a scenario drives: this tree's, or another revision's for an A/B
# (``harness/perf/step/overhead_ab.py``).
ENGINE = types.SimpleNamespace(BlockManager=BlockManager, Scheduler=Scheduler, InputPreparer=InputPreparer,
                               Request=Request, SamplingParams=SamplingParams)


def make_stepper(name: str, num_seqs: int, block_size: int, max_seq_len: int, max_num_tokens: int,
                 seed: int, engine: types.SimpleNamespace = ENGINE):
    """The scenario's engine with ``num_seqs`` requests queued, and its step function:
    ``one_step(times, cpu)`` runs one step and appends each part's wall time (ns) to ``times[i]`` and
    the thread's CPU time to ``cpu`` (both None: untimed). Returns (one_step, scheduler, block manager)."""
    rng = random.Random(seed)
    churn = name == "churn"
    num_blocks = num_seqs * (-(-max_seq_len // block_size)) + 64
    bm = engine.BlockManager(num_blocks, block_size, enable_prefix_caching=True)
    sched = engine.Scheduler(bm, max_batch_size=num_seqs, max_num_tokens=max_num_tokens,
                             policy="max_utilization", enable_chunked_prefill=True, max_seq_len=max_seq_len)
    prep = engine.InputPreparer(block_size, -(-max_seq_len // block_size), block_manager=bm)
    model = StubModel(max_num_tokens)
    counter = 0

    def new_request():
        nonlocal counter
        # decode: nobody finishes in the window; churn: lives of 20-300 tokens keep requests coming.
        max_tokens = max_seq_len - 513 if not churn else rng.randrange(20, 300)
        prompt = [rng.randrange(3, 256) for _ in range(rng.randrange(32, 513))]
        sched.add(engine.Request(f"req{counter}", prompt, engine.SamplingParams(
            max_tokens=max_tokens, ignore_eos=True, temperature=0.0)))
        counter += 1

    for _ in range(num_seqs):
        new_request()

    def one_step(times: list[list[int]] | None, cpu: list[int] | None) -> tuple[int, int]:
        c0 = time.thread_time_ns()
        t0 = time.perf_counter_ns()
        out = sched.schedule()
        t1 = time.perf_counter_ns()
        inp = prep.prepare(out)
        t2 = time.perf_counter_ns()
        logits = model(inp.input_ids, inp.meta, inp.logits_indices)
        t3 = time.perf_counter_ns()
        sampled = logits.argmax(dim=-1).tolist()
        t4 = time.perf_counter_ns()
        finished = sched.update(out, sampled)
        t5 = time.perf_counter_ns()
        c1 = time.thread_time_ns()
        if times is not None:
            for lst, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
                lst.append(dt)
            cpu.append(c1 - c0)
        if churn:
            for _ in finished:
                new_request()
        return len(out.scheduled), out.num_prefill_tokens

    return one_step, sched, bm


def warm_up(one_step, sched) -> int:
    """Steps until every sequence is decoding (all prompts prefilled), then some more."""
    return _until_decoding(lambda: one_step(None, None), sched)


def _until_decoding(step, sched) -> int:
    """``step()`` until no request waits or prefills, and at least 20 times: the steps taken."""
    warm = 0
    while sched.num_waiting or any(r.is_prefill for r in sched.running) or warm < 20:
        step()
        warm += 1
        assert warm < 10_000
    return warm


def ms_stats(ms) -> dict:
    """Mean, median and 99th percentile of per-step milliseconds."""
    return {"mean": float(np.mean(ms)), "p50": float(np.percentile(ms, 50)), "p99": float(np.percentile(ms, 99))}


def run_scenario(name: str, num_seqs: int, steps: int, block_size: int, max_seq_len: int,
                 max_num_tokens: int, seed: int, profile: cProfile.Profile | None) -> dict:
    one_step, sched, bm = make_stepper(name, num_seqs, block_size, max_seq_len, max_num_tokens, seed)
    num_blocks = bm.num_blocks
    warm = warm_up(one_step, sched)
    times: list[list[int]] = [[] for _ in PARTS]
    cpu: list[int] = []
    batch_sizes, prefill_tokens = [], []
    if profile is not None:
        profile.enable()
    for _ in range(steps):
        b, p = one_step(times, cpu)
        batch_sizes.append(b)
        prefill_tokens.append(p)
    if profile is not None:
        profile.disable()

    arr = np.array(times, dtype=np.float64) / 1000.0       # microseconds
    total = arr.sum(axis=0)
    host = total - arr[PARTS.index("model_stub")]
    summary = {
        "steps": steps, "warmup_steps": warm,
        "mean_batch_size": float(np.mean(batch_sizes)),
        "mean_prefill_tokens_per_step": float(np.mean(prefill_tokens)),
        # Wall clock of the host parts (model stub excluded). On a loaded machine the mean and
        # p99 include time the OS gave to other processes.
        "host_overhead_ms_per_step": ms_stats(host / 1000),
        # CPU time of this thread per step (stub included, it is ~1% of it): what a step costs
        # when the process has a core to itself, insensitive to other processes' load.
        "cpu_ms_per_step": ms_stats(np.array(cpu, dtype=np.float64) / 1e6),
        "breakdown_us_mean": {p: round(float(arr[i].mean()), 2) for i, p in enumerate(PARTS)},
        "breakdown_us_p50": {p: round(float(np.percentile(arr[i], 50)), 2)
                             for i, p in enumerate(PARTS)},
        "preemptions": sched.num_preemptions,
        "kv_blocks_total": num_blocks,
        "prefix_cache_hit_rate": round(bm.prefix_cache_hit_rate, 4),
    }
    return summary


@contextlib.contextmanager
def executor_stepper(overlap: bool, num_seqs: int, block_size: int, max_seq_len: int, max_num_tokens: int,
                     seed: int, engine=None):
    """An executor with ``num_seqs`` greedy requests of 32-512 prompt tokens, warmed up until every
    one decodes. Yields (executor, warm-up steps); shuts it down on exit. ``engine``: a namespace
    with ``Executor`` and ``SamplingParams`` (another revision's, ``harness/perf/step/overhead_ab.py``); None: this
    tree's. The other arguments are ``run_scenario``'s."""
    from harness.perf.lib.models import TINY, manifest_bundle, synthetic_fp8_weights
    from harness.perf.throughput.gpu import drop_event
    if engine is None:
        from backend.engine.executor import Executor
        engine = types.SimpleNamespace(Executor=Executor, SamplingParams=SamplingParams)

    model = dict(TINY, vocab_size=STUB_VOCAB, max_position_embeddings=max_seq_len)
    config = {"max_batch_size": num_seqs, "max_num_tokens": max_num_tokens, "max_seq_len": max_seq_len,
              "max_input_len": 512, "kv_block_size": block_size, "kv_cache_dtype": "fp8_e4m3",
              "enable_prefix_caching": True, "enable_chunked_prefill": True,
              "scheduler_policy": "max_utilization", "overlap_scheduling": overlap,
              "max_kv_tokens": num_seqs * max_seq_len + 64 * block_size}
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory() as tmp:
        bundle = manifest_bundle(model, config, Path(tmp) / "engine")
        ex = engine.Executor(bundle, weights=synthetic_fp8_weights(model, device="cpu"), start=False,
                             verify_hashes=False, speculative=False)
        try:
            stub = StubModel(max_num_tokens, STUB_VOCAB)
            ex.runner.execute = lambda ids, meta, rows, capture_hidden_layers=(): (stub(ids, meta, rows), {})
            # nobody finishes inside the window (as in the decode scenario)
            params = engine.SamplingParams(max_tokens=max_seq_len - 513, temperature=0.0, ignore_eos=True)
            for _ in range(num_seqs):
                # events go to a callback that drops them, as a server's consumer takes them: a handle
                # keeping them would grow the heap Python's collector scans, step after step
                ex.submit([rng.randrange(3, STUB_VOCAB) for _ in range(rng.randrange(32, 513))], params,
                          on_event=drop_event)
            yield ex, _until_decoding(ex.step, ex.scheduler)
        finally:
            ex.shutdown()


def run_executor_scenario(overlap: bool, num_seqs: int, steps: int, block_size: int, max_seq_len: int,
                          max_num_tokens: int, seed: int, profile=None) -> dict:
    """``num_seqs`` greedy requests decoding; ``steps`` executor steps timed (wall and thread CPU)."""
    with executor_stepper(overlap, num_seqs, block_size, max_seq_len, max_num_tokens, seed) as (ex, warm):
        wall, cpu = [], []
        if profile is not None:
            profile.enable()
        for _ in range(steps):
            c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
            n = ex.step()
            wall.append(time.perf_counter_ns() - t0)
            cpu.append(time.thread_time_ns() - c0)
            assert n == num_seqs, f"{n} sequences in a step of the window; every one of {num_seqs} decodes"
        if profile is not None:
            profile.disable()
    w = np.array(wall, dtype=np.float64) / 1e6
    c = np.array(cpu, dtype=np.float64) / 1e6
    overlap = ex.overlap is not None
    return {"steps": steps, "warmup_steps": warm, "mean_batch_size": float(num_seqs),
            "loop": "overlapped" if overlap else "synchronous",
            "host_overhead_ms_per_step": ms_stats(w), "cpu_ms_per_step": ms_stats(c),
            "us_per_sequence_p50": round(float(np.percentile(w, 50)) * 1e3 / num_seqs, 2)}


def python_speed_ms(repeats: int = 5) -> float:
    """Best time of a fixed 1M-iteration pure-Python loop: a yardstick for how fast this
    interpreter runs right now (a loaded shared machine can be several times slower than usual),
    so numbers from different machines or moments can be compared."""
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        acc = 0
        for i in range(1_000_000):
            acc += i
        best = min(best, time.perf_counter() - t)
    return best * 1000


def check_sizes(ap: argparse.ArgumentParser, args, positive: tuple[str, ...]) -> None:
    """The sizes every scenario needs (this benchmark's and the A/B's): ``positive`` at least 1,
    room for every sequence in a step and for the 32-512 token prompts."""
    for name in positive:
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_num_tokens < args.num_seqs:
        ap.error("--max-num-tokens must be >= --num-seqs (every sequence decodes each step)")
    if args.max_seq_len <= 600:
        ap.error("--max-seq-len must exceed 600 (prompts are 32-512 tokens)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-seq-len", type=int, default=2048)
    ap.add_argument("--max-num-tokens", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runs", type=int, default=3, help="repeat each scenario; report the median")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated; default: all of "
                    + ", ".join(SCENARIOS))
    ap.add_argument("--output", "--out", dest="output", default=None,
                    help="results JSON (default build/perf/host-overhead.json; '-' to print only)")
    ap.add_argument("--profile", action="store_true", help="print the top cProfile entries")
    args = ap.parse_args(argv)
    check_sizes(ap, args, ("num_seqs", "steps", "max_seq_len", "max_num_tokens", "runs"))
    if args.block_size < 1 or args.block_size & (args.block_size - 1):
        ap.error("--block-size must be a power of two")
    scenarios = [s for s in args.scenarios.split(",") if s]
    unknown = sorted(set(scenarios) - set(SCENARIOS))
    if unknown:
        ap.error(f"--scenarios: unknown {', '.join(unknown)}; allowed: {', '.join(SCENARIOS)}")

    torch.set_num_threads(1)   # the stub and the argmax are tiny; threads only add jitter
    profile = cProfile.Profile() if args.profile else None
    results = {}
    for name in scenarios:
        # Several runs, interleaved with nothing else: on a shared machine one run can be 2x off.
        # The run with the median p50 is reported in full, every run's p50 next to it.
        if name.startswith("executor"):
            runs = [run_executor_scenario(name == "executor_overlap", args.num_seqs, args.steps, args.block_size,
                                          args.max_seq_len, args.max_num_tokens, args.seed, profile)
                    for _ in range(args.runs)]
        else:
            runs = [run_scenario(name, args.num_seqs, args.steps, args.block_size, args.max_seq_len,
                                 args.max_num_tokens, args.seed, profile) for _ in range(args.runs)]
        runs.sort(key=lambda r: r["host_overhead_ms_per_step"]["p50"])
        r = results[name] = runs[len(runs) // 2]
        r["all_runs_host_p50_ms"] = [round(x["host_overhead_ms_per_step"]["p50"], 4) for x in runs]
        h = r["host_overhead_ms_per_step"]
        c = r["cpu_ms_per_step"]
        parts = f"breakdown (us, p50): {r['breakdown_us_p50']} | " if "breakdown_us_p50" in r else ""
        print(f"{name:16s} batch={r['mean_batch_size']:.0f} host overhead/step (wall): "
              f"p50 {h['p50']:.3f} ms, mean {h['mean']:.3f} ms, p99 {h['p99']:.3f} ms | "
              f"CPU time: p50 {c['p50']:.3f} ms, mean {c['mean']:.3f} ms | "
              f"{parts}p50 of each run: {r['all_runs_host_p50_ms']}")
    if profile is not None:
        pstats.Stats(profile).sort_stats("cumulative").print_stats(25)

    yardstick = python_speed_ms()
    doc = {**header("host-overhead", "harness.perf.step.host_overhead", argv, torch=torch,
                    dirty_paths=_MEASURED_FILES),
        "what": "engine step host overhead with a stub model returning fixed logits "
                f"(vocab {STUB_VOCAB}, no compute): decode/churn = scheduler + block manager + input "
                "preparation + greedy pick + update; executor/executor_overlap = the whole Executor.step "
                "(also the sampler's rows, late tokens and one event per request), synchronous and "
                "overlapped loop",
        "goal": "<= 0.25 ms per step at 256 running sequences (scheduler + block manager + input preparation "
                "+ bookkeeping)",
        "python_1m_loop_ms": round(yardstick, 1),
        "config": {"num_seqs": args.num_seqs, "steps": args.steps, "runs": args.runs,
                   "block_size": args.block_size,
                   "max_seq_len": args.max_seq_len, "max_num_tokens": args.max_num_tokens,
                   "prefix_caching": True, "chunked_prefill": True, "seed": args.seed},
        "results": results,
    }
    write_result(doc, args.output, "host-overhead.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
