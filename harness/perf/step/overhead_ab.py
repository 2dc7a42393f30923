"""Host overhead A/B: another revision's engine code against this tree's, step by step in one process.

    python -m harness.perf.step.overhead_ab --base HEAD~1 [--scenario decode|churn|executor|executor_overlap]
                                        [--steps 1200] [--output F]

Separate runs of ``harness.perf.step.host_overhead`` on a shared 2-core machine differ by up to 40% (the machine's
speed drifts in phases), far more than the changes worth measuring. Here both engines live in one
process and their steps alternate (A B, B A, ...), so every pair of steps sees the same phase; the
result is the median of the per-pair ratios and each side's medians per part.

The base revision's ``backend/engine/`` is read with ``git show`` into a temporary package
(``kiln_base_engine``, its imports of ``backend.engine`` renamed); everything below it (ops, the
attention metadata) is this tree's, so the A/B measures changes to the engine's host code only.
The stub model and the scenarios are ``harness.perf.step.host_overhead``'s; ``executor`` and
``executor_overlap`` time the whole ``Executor.step`` of each side (its ``executor_stepper``), whose
code outside ``backend/engine`` (the runner, the ops) is this tree's on both sides.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import torch

from harness.perf.lib.results import REPO, header, write_result
from harness.perf.step.host_overhead import (ENGINE, PARTS, check_sizes, executor_stepper, make_stepper,
                                             python_speed_ms, warm_up)

ROOT = REPO
BASE_PACKAGE = "kiln_base_engine"
CLASSES = {"kv_cache": ("BlockManager",), "scheduler": ("Scheduler",), "inputs": ("InputPreparer",),
           "request": ("Request",), "sampling_params": ("SamplingParams",), "executor": ("Executor",)}
EXECUTOR_SCENARIOS = {"executor": False, "executor_overlap": True}    # -> overlap scheduling


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout


def load_base_engine(rev: str, into: Path) -> types.SimpleNamespace:
    """``rev``'s backend/engine as the package ``kiln_base_engine`` under ``into``; its classes."""
    try:
        files = _git("ls-tree", "--name-only", rev, "backend/engine/").split()
    except subprocess.CalledProcessError as exc:
        raise SystemExit(f"--base {rev!r}: not a revision of this repository ({exc.stderr.strip()})") from None
    pkg = into / BASE_PACKAGE
    pkg.mkdir(parents=True)
    for f in files:
        if f.endswith(".py"):
            src = _git("show", f"{rev}:{f}").replace("backend.engine.", BASE_PACKAGE + ".")
            (pkg / Path(f).name).write_text(src)
    (pkg / "__init__.py").touch()
    for name in [m for m in sys.modules if m == BASE_PACKAGE or m.startswith(BASE_PACKAGE + ".")]:
        del sys.modules[name]            # an earlier call's base revision
    sys.path.insert(0, str(into))
    importlib.invalidate_caches()
    ns = {}
    for mod, names in CLASSES.items():
        m = importlib.import_module(f"{BASE_PACKAGE}.{mod}")
        ns.update({n: getattr(m, n) for n in names})
    return types.SimpleNamespace(**ns)


def run_executor_ab(base_engine: types.SimpleNamespace, overlap: bool, num_seqs: int, steps: int,
                    block_size: int, max_seq_len: int, max_num_tokens: int, seed: int) -> dict:
    """The whole ``Executor.step`` (``host_overhead.executor_stepper``), the two sides alternating."""
    host: dict[str, list[float]] = {"base": [], "new": []}
    with contextlib.ExitStack() as stack:
        sides = {name: stack.enter_context(executor_stepper(overlap, num_seqs, block_size, max_seq_len,
                                                            max_num_tokens, seed, engine))[0]
                 for name, engine in (("base", base_engine), ("new", None))}
        for i in range(steps):
            for name in (("base", "new") if i % 2 == 0 else ("new", "base")):
                t0 = time.perf_counter_ns()
                n = sides[name].step()
                host[name].append((time.perf_counter_ns() - t0) / 1000)
                assert n == num_seqs, f"{name}: {n} sequences in a step; every one of {num_seqs} decodes"
    ratios = [n / b for b, n in zip(host["base"], host["new"])]
    out = {"steps": steps, "loop": "overlapped" if overlap else "synchronous",
           "ratio_new_over_base_p50": round(statistics.median(ratios), 4)}
    for name, values in host.items():
        out[name] = {"host_us_p50": round(statistics.median(values), 1),
                     "host_us_mean": round(statistics.mean(values), 1)}
    return out


def run_ab(base_engine: types.SimpleNamespace, scenario: str, num_seqs: int, steps: int, block_size: int,
           max_seq_len: int, max_num_tokens: int, seed: int) -> dict:
    sides = {}
    for name, engine in (("base", base_engine), ("new", ENGINE)):
        one_step, sched, _ = make_stepper(scenario, num_seqs, block_size, max_seq_len, max_num_tokens, seed,
                                          engine)
        warm_up(one_step, sched)
        sides[name] = (one_step, [[] for _ in PARTS], [])
    host = {"base": [], "new": []}
    stub = PARTS.index("model_stub")
    for i in range(steps):
        for name in (("base", "new") if i % 2 == 0 else ("new", "base")):
            one_step, times, cpu = sides[name]
            one_step(times, cpu)
            host[name].append(sum(t[-1] for j, t in enumerate(times) if j != stub) / 1000)
    ratios = [n / b for b, n in zip(host["base"], host["new"])]
    out = {"steps": steps, "ratio_new_over_base_p50": round(statistics.median(ratios), 4)}
    for name, (_, times, _) in sides.items():
        out[name] = {"host_us_p50": round(statistics.median(host[name]), 1),
                     "host_us_mean": round(statistics.mean(host[name]), 1),
                     "breakdown_us_p50": {p: round(statistics.median(times[j]) / 1000, 1)
                                          for j, p in enumerate(PARTS)}}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", required=True, help="the revision to compare with (a commit, tag or branch)")
    ap.add_argument("--scenario", default="decode", choices=("decode", "churn", *EXECUTOR_SCENARIOS),
                    help="decode/churn: scheduler, preparer and update; executor(_overlap): the whole "
                         "Executor.step with the synchronous (overlapped) loop")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--steps", type=int, default=1200,
                    help="steps of each side (decode: at most ~1400 before the first requests end)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-seq-len", type=int, default=2048)
    ap.add_argument("--max-num-tokens", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", "--out", dest="output", default=None,
                    help="results JSON (default build/perf/host-overhead-ab.json; '-': print only)")
    args = ap.parse_args(argv)
    check_sizes(ap, args, ("num_seqs", "steps", "max_num_tokens"))
    if args.scenario != "churn" and args.steps > args.max_seq_len - 513 - 60:
        ap.error(f"--steps {args.steps}: the decode scenario's first requests end after "
                 f"{args.max_seq_len - 513} tokens; allowed: at most {args.max_seq_len - 573}")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="kiln-ab-") as tmp:
        base = load_base_engine(args.base, Path(tmp))
        if args.scenario in EXECUTOR_SCENARIOS:
            result = run_executor_ab(base, EXECUTOR_SCENARIOS[args.scenario], args.num_seqs, args.steps,
                                     args.block_size, args.max_seq_len, args.max_num_tokens, args.seed)
        else:
            result = run_ab(base, args.scenario, args.num_seqs, args.steps, args.block_size, args.max_seq_len,
                            args.max_num_tokens, args.seed)
    dirty = _git("status", "--porcelain", "--", "backend/engine").strip()
    doc = {**header("host-overhead-ab", "harness.perf.step.overhead_ab", argv, torch=torch),
           "what": "engine step host overhead (harness.perf.step.host_overhead's stub model), a base revision's "
                   "backend/engine against this tree's, steps alternating in one process",
           "python_1m_loop_ms": round(python_speed_ms(), 1),
           "base": _git("rev-parse", args.base).strip(),
           "new": _git("rev-parse", "HEAD").strip() + ("-dirty" if dirty else ""),
           "config": {"scenario": args.scenario, "num_seqs": args.num_seqs, "block_size": args.block_size,
                      "max_seq_len": args.max_seq_len, "max_num_tokens": args.max_num_tokens, "seed": args.seed},
           "results": result}
    b, n = result["base"], result["new"]
    print(f"{args.scenario}: host p50 {b['host_us_p50']} us (base) -> {n['host_us_p50']} us (new); "
          f"per-pair new/base median {result['ratio_new_over_base_p50']}")
    for side in ("base", "new") if "breakdown_us_p50" in b else ():
        print(f"  {side:4s} breakdown (us, p50): {result[side]['breakdown_us_p50']}")
    write_result(doc, args.output, "host-overhead-ab.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
