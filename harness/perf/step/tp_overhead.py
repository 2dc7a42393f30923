"""The collectives' cost in a decode step on ONE GPU: TP 1 plain (``ModelRunner``) against TP 1 through
the distributed code path (``TPDriver``, world size 1 over NCCL: the step's input broadcast and every
all-reduce run, each over one rank). One GPU cannot show a TP speed-up; it shows what the distributed
path adds to a step, which a TP N step pays on top of its 1/N share of the weights.

    python -m harness.perf.step.tp_overhead [--bundle build/gpu-check/fp8/engine] [--pairs eager fast] [--out F]

Two pairs, each A/B/A/B on the same bundle:

* ``eager`` (keys ``b<N>_ms``): the torch attention backend's plain ops, no CUDA graph, both sides;
* ``fast`` (keys ``fast_b<N>_ms``): what a GPU engine runs, the triton backend's fused decoder layer
  with decode steps replayed from CUDA graphs, both sides; the driver's graphs hold its all-reduces,
  so this is the measurement asked for: what the collectives cost inside the decode step. The driver's
  input broadcast (host pickles) stays outside any graph: ``distributed_forward`` (rank 0's own step:
  graph replay with the collectives, the logits gather) shows the step without it.

Part ``tp`` of harness/gpucheck/device.sh, on the tiny bundles of ``make gpu-check-prepare`` (carried
to the GPU machine): decode steps of ``--batches`` sequences with ``--context`` cached tokens each,
median of ``--iters`` each; the collective kernels of one profiled step per pair; whether each side's
steps took its graphs (``fast_graphs``). Writes build/perf/tp-overhead-<gpu>.json.

When ``TPDriver(spec, tp_size=1, device="cuda")`` fails, the script refuses with one line and exit
code 3, writing the refusal into the JSON, so device.sh goes on with its other parts. ``--dry-run``
runs the same code on the CPU (the fast pair through Triton's interpreter and the graphs' static-buffer
path, nothing captured).
"""
from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
BUNDLE = REPO / "build" / "gpu-check" / "fp8" / "engine"
EXIT_NO_GPU, EXIT_NO_TP_PATH = 2, 3
# each pair is compared like for like: the same layer code and the same graph setting on both sides
PAIRS = {"eager": {"cuda_graphs": False, "attention_backend": "torch"},
         "fast": {"cuda_graphs": True, "attention_backend": "triton"}}
OVERRIDES = PAIRS["eager"]
# where each pair's results go in the JSON (the eager pair keeps its first keys)
PREFIX = {"eager": "", "fast": "fast_"}


def load_spec(bundle: Path, overrides: dict | None = None):
    from backend.runtime.spec import load_engine_spec
    return load_engine_spec(bundle, dict(OVERRIDES if overrides is None else overrides))


def plain_runner(spec, device: str):
    from backend.runtime.native import ModelRunner
    return ModelRunner(spec, device=device)


def distributed_runner(spec, device: str):
    """The interface the NCCL path is written to (world size 1: no worker process)."""
    from backend.runtime.tp_driver import TPDriver
    return TPDriver(spec, tp_size=1, device=device)


def _view(runner, spec):
    """What decode_perf.decode_inputs reads, for a runner that does not carry its spec (the driver)."""
    import torch
    return types.SimpleNamespace(device=torch.device(runner.device), block_size=runner.block_size,
                                 num_blocks=runner.num_blocks, spec=spec)


def time_steps(runners: dict, spec, batch: int, context: int, iters: int, rounds: int = 2) -> dict:
    """ms per eager decode step of each runner, interleaved ``rounds`` times (clocks and caches warm
    alike); the mean of each runner's per-round medians."""
    from harness.perf.lib.timing import median_ms
    from harness.perf.step.decode_perf import decode_inputs
    inputs = {name: decode_inputs(_view(r, spec), batch, context) for name, r in runners.items()}
    out: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(rounds):
        for name, r in runners.items():
            ids, meta, rows = inputs[name]
            dev = _view(r, spec).device
            out[name].append(median_ms(lambda: r.execute(ids, meta, rows), iters, warmup=3 if dev.type == "cuda" else 0,
                                       device=dev))
    return {name: sum(v) / len(v) for name, v in out.items()}


def collective_kernels(runner, spec, batch: int, context: int) -> dict:
    """Calls and device time (us) of the collectives in one profiled step, by kernel/op name."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from harness.perf.step.decode_perf import decode_inputs
    view = _view(runner, spec)
    ids, meta, rows = decode_inputs(view, batch, context)
    runner.execute(ids, meta, rows)
    cuda = view.device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        runner.execute(ids, meta, rows)
        if cuda:
            torch.cuda.synchronize()
    keys = ("nccl", "allreduce", "all_reduce", "broadcast", "allgather", "all_gather", "gather")
    found = {}
    for e in prof.key_averages():
        if any(k in e.key.lower() for k in keys):
            us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0) or e.cpu_time_total
            found[e.key[:100]] = {"calls": e.count, "us": round(us, 1)}
    return found


def graph_steps(runner) -> dict | None:
    """How many steps took the runner's decode graphs and whether capture failed (None: no graphs)."""
    inner = getattr(runner, "runner", runner)   # the driver: rank 0's TPRunner
    g = getattr(inner, "graphs", None)
    if g is None:
        return None
    return {"steps": g.steps, "captured": len(g.graphs), "failed": g.failed}


def run_pair(name: str, a, spec, device: str, res: dict) -> str | None:
    """Time one pair into ``res`` under its prefix; a refusal line when its distributed side fails."""
    pre = PREFIX[name]
    try:   # first: it is the part that may fail, and refusing costs nothing then
        dist_runner = distributed_runner(spec, device)
    except Exception as e:  # noqa: BLE001 - whatever the path raises, one line, not a traceback
        first = str(e).splitlines()[0] if str(e) else ""
        return (f"tp_overhead: the distributed GPU path is not available ({name} pair): TPDriver(spec, "
                f"tp_size=1, device={device!r}) raised {type(e).__name__}: {first}")
    try:
        runners = {"plain": plain_runner(spec, device), "distributed": dist_runner}
        inner = getattr(dist_runner, "runner", None)   # rank 0's forward alone: collectives, no input broadcast
        if inner is not None and hasattr(inner, "execute"):
            runners["distributed_forward"] = inner
        for b in a.batches:
            ms = time_steps(runners, spec, b, a.context, a.iters)
            ms["overhead"] = ms["distributed"] - ms["plain"]
            ms["ratio"] = ms["distributed"] / ms["plain"]
            res[f"{pre}b{b}_ms"] = ms
            print(f"{name} batch {b}: " + ", ".join(f"{k} {v:.4f}" for k, v in ms.items()), flush=True)
        res[f"{pre}collectives_b1"] = collective_kernels(dist_runner, spec, 1, a.context)
        if name == "fast":
            res["fast_graphs"] = {k: graph_steps(r) for k, r in runners.items() if k != "distributed_forward"}
    finally:
        shutdown = getattr(dist_runner, "shutdown", None)
        if shutdown is not None:
            shutdown()
    return None


def _refuse(res: dict, out: Path | None, message: str) -> int:
    res["refused"] = message
    _write(res, out)
    print(message, file=sys.stderr)
    return EXIT_NO_TP_PATH


def _write(res: dict, out: Path | None) -> None:
    import json
    if out is None and res["gpu"].startswith("cpu"):   # a dry run times nothing: never into a result file
        print(json.dumps(res, indent=1))
        return
    from harness.perf.lib.results import gpu_slug, write_result
    write_result(res, out, f"tp-overhead-{gpu_slug(res['gpu'])}.json", indent=1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.perf.step.tp_overhead", description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path, default=BUNDLE, help=f"engine bundle (default {BUNDLE.relative_to(REPO)})")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--context", type=int, default=512, help="cached tokens per sequence (default 512)")
    ap.add_argument("--iters", type=int, default=30, help="timed steps per runner and round (median)")
    ap.add_argument("--pairs", nargs="+", choices=list(PAIRS), default=list(PAIRS),
                    help="eager: torch backend, no graphs; fast: fused layer + CUDA graphs (default both)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, 2 iterations: checks the script, times nothing")
    ap.add_argument("--out", "--output", dest="out", type=Path, help="result JSON (default build/perf/tp-overhead-<gpu>.json)")
    a = ap.parse_args(argv)
    import torch
    if a.dry_run:
        a.batches, a.context, a.iters = [1, 2], 40, 2
        # the fast pair's kernels on the CPU: before triton is first imported (plugins import it lazily)
        import os
        os.environ.setdefault("TRITON_INTERPRET", "1")
    elif not torch.cuda.is_available():
        print("tp_overhead: no NVIDIA GPU visible; run on the GPU machine (or --dry-run here)", file=sys.stderr)
        return EXIT_NO_GPU
    from harness.perf.lib.results import header, product_path
    device = "cpu" if a.dry_run else "cuda"
    res = {**header("tp-overhead", "harness.perf.step.tp_overhead", argv, torch=torch), "what": "decode step, TP 1 plain vs TP 1 through the distributed path (world size 1) on one device; "
                   "pair eager (torch backend, no graphs) and pair fast (fused layer, CUDA graphs: fast_*)",
           "gpu": torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)",
           "bundle": product_path(str(a.bundle)), "context": a.context, "batches": a.batches, "iters": a.iters,
           "pairs": {name: PAIRS[name] for name in a.pairs}}
    for name in a.pairs:
        try:
            spec = load_spec(a.bundle, PAIRS[name])
        except Exception as e:  # noqa: BLE001 - a missing bundle is a setup step, said in one line
            print(f"tp_overhead: cannot load {a.bundle} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                  "run make gpu-check-prepare on the CPU machine and carry build/gpu-check", file=sys.stderr)
            return EXIT_NO_GPU
        refusal = run_pair(name, a, spec, device, res)
        if refusal is not None:
            return _refuse(res, a.out, refusal)
    if device == "cuda":
        res["peak_gpu_gib"] = torch.cuda.max_memory_allocated() / 2**30
    _write(res, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
