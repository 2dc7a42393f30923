"""What a target pass with k drafted tokens costs, and the speedup that follows for an acceptance.

    python -m harness.perf.step.eagle_cost --engine build/smollm2-135m-bf16-eagle3/engine --dtype float32   (CPU)
    python -m harness.perf.step.eagle_cost --llama8b                                                      (NVIDIA GPU)

Speculation's speedup at batch 1 is ``L(k) * C(0) / C(k)``: ``L(k)`` tokens per target pass with a
chain of k drafts (device-independent: it depends on the draft and the text only), ``C(k)`` the
wall time of one engine step that drafts k tokens and verifies them (device-dependent: the k
draft-model steps plus a target pass over 1 + k rows). This module measures ``C(k)``.

A step's cost does not depend on whether its drafts are accepted, so a draft of random weights
measures it as well as a trained one: ``--llama8b`` times a Llama-3.1-8B-shaped FP8 target (random
weights, as ``harness.perf.throughput.gpu``) with a random EAGLE-3 head of that shape, the one way to put a
number on the GPU side while no real 8B target and draft can reach the machine. ``L(k)`` comes from
the SmolLM2 draft's MT-bench run (docs/perf/eagle3.json, chain-4 histogram): a greedy chain's first
k drafts do not depend on its length, so ``L(k) = 1 + mean(min(accepted_4, k))`` for k <= 4. The
result also gives, per k, the ``L`` a real draft needs to break even and to reach 2.5x.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from harness.perf.lib import models

DEFAULT_LENS = (0, 1, 2, 3, 4, 6)
GOAL = 2.5  # the batch-1 speedup goal on a GPU


def attach_draft(ex, cfg, tensors):
    """An ``Eagle3Draft`` on ``ex``'s device and dtype, sharing the target's embedding and head."""
    from backend.speculative.draft_model import Eagle3Draft
    model, runner = ex.runner.model, ex.runner
    return Eagle3Draft(cfg, tensors, model.embed_tokens, None if cfg.has_lm_head else model.lm_head,
                       model.config.max_position_embeddings + 64, runner.device, runner.dtype)


def chain_speculator(ex, draft, k: int):
    """A speculator that drafts exactly ``k`` tokens every step (a chain, no confidence cut)."""
    from backend.speculative.grow import TreeGrower
    from backend.speculative.speculator import EagleSpeculator
    return EagleSpeculator(draft, ex.runner.kv_caches, TreeGrower.from_settings(draft, "chain", k, 1, k, None, 0.0),
                           ex.runner)


class _PartTimer:
    """Wall time inside the target's forward and each speculator phase, synchronizing the device
    around every call so GPU work lands in the part that queued it (costs a little overlap: use it
    for the breakdown, not for the headline numbers)."""
    PARTS = ("target", "prepare", "verify", "propose")

    def __init__(self, ex) -> None:
        import torch
        self.ms = dict.fromkeys(self.PARTS, 0.0)
        self._sync = torch.cuda.synchronize if ex.device.type == "cuda" else (lambda: None)
        self._undo = []
        self._wrap(ex.runner, "execute", "target")
        if ex.speculator is not None:
            for part in ("prepare", "verify", "propose"):
                self._wrap(ex.speculator, part, part)

    def _wrap(self, obj, name: str, part: str) -> None:
        fn = getattr(obj, name)

        def timed(*args, **kw):
            self._sync()
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                self._sync()
                self.ms[part] += (time.perf_counter() - t0) * 1e3
        setattr(obj, name, timed)
        self._undo.append((obj, name))

    def close(self) -> None:
        for obj, name in self._undo:
            delattr(obj, name)      # back to the class's method


def decode_pass_ms(ex, prompt: list[int], new_tokens: int, breakdown: bool = False) -> dict:
    """One greedy stream: ms per target pass after the prefill (the prefill step is not timed);
    ``breakdown``: also the ms per pass spent in each part (``_PartTimer``)."""
    from backend.engine.sampling_params import SamplingParams
    h = ex.submit(prompt, SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True))
    ex.step()
    timer = _PartTimer(ex) if breakdown else None
    passes, t0 = 0, time.perf_counter()
    try:
        while not h.finished:
            passes += 1 if ex.step() else 0
    finally:
        if timer is not None:
            timer.close()
    wall = time.perf_counter() - t0
    if not passes:
        raise ValueError(f"new_tokens={new_tokens}: the stream finished in its prefill step; ask for more tokens")
    res = {"ms_per_pass": wall / passes * 1e3, "passes": passes, "tokens": len(h.result().token_ids)}
    if timer is not None:
        res["parts_ms_per_pass"] = {p: round(v / passes, 3) for p, v in timer.ms.items()}
        res["parts_ms_per_pass"]["other"] = round(res["ms_per_pass"] - sum(timer.ms.values()) / passes, 3)
    return res


def step_costs(ex, draft, lens=DEFAULT_LENS, prompt_len: int = 128, new_tokens: int = 64,
               reps: int = 3, breakdown: bool = False) -> list[dict]:
    """``C(k)`` for each k in ``lens`` (0 = no speculation): the median of ``reps`` streams, the k
    interleaved so drift on a shared machine moves all of them alike. Also the drafts actually
    proposed per verify step, which must equal k (the check that the chain was not cut), and with
    ``breakdown`` one more stream per k timed part by part (``parts_ms_per_pass``)."""
    import random
    rng = random.Random(0)
    prompt = [rng.randrange(ex.runner.model.config.vocab_size) for _ in range(prompt_len)]
    saved = ex.speculator
    runs: dict[int, list[dict]] = {k: [] for k in lens}
    drafted: dict[int, float] = {}
    try:
        for k in lens:   # warm-up: allocations, kernel compiles, CUDA graphs of every shape timed below
            ex.speculator = chain_speculator(ex, draft, k) if k else None
            decode_pass_ms(ex, prompt[:16], 2 * k + 4)
        for _ in range(reps):
            for k in lens:
                spec = chain_speculator(ex, draft, k) if k else None
                ex.speculator = spec
                runs[k].append(decode_pass_ms(ex, prompt, new_tokens))
                if spec is not None and spec.stats.verify_steps:
                    drafted[k] = spec.stats.proposed / spec.stats.verify_steps
        parts = {}
        for k in lens if breakdown else ():
            ex.speculator = chain_speculator(ex, draft, k) if k else None
            parts[k] = decode_pass_ms(ex, prompt, new_tokens, breakdown=True)["parts_ms_per_pass"]
    finally:
        ex.speculator = saved
    base = statistics.median(r["ms_per_pass"] for r in runs[lens[0]])
    out = []
    for k in lens:
        ms = statistics.median(r["ms_per_pass"] for r in runs[k])
        out.append({"draft_len": k, "ms_per_pass": round(ms, 3), "cost_vs_plain": round(ms / base, 4),
                    "drafted_per_step": round(drafted.get(k, 0.0), 3),
                    "breakeven_tokens_per_pass": round(ms / base, 3),
                    f"tokens_per_pass_for_{GOAL}x": round(GOAL * ms / base, 3)})
        if k in parts:
            out[-1]["parts_ms_per_pass"] = parts[k]
    return out


def chain_acceptance(eagle3_json: Path) -> tuple[dict[int, float], str]:
    """``{k: L(k)}`` for k = 0..K from the chain-K batch-1 histogram of a ``harness.perf.throughput.eagle`` result."""
    doc = json.loads(Path(eagle3_json).read_text())
    modes, results = doc.get("modes", {}), doc.get("results", {})
    chains = [(m["max_draft_len"], name) for name, m in modes.items()
              if m.get("tree") == "chain" and not m.get("min_draft_prob") and f"{name}@batch1" in results]
    if not chains:
        raise ValueError(f"{eagle3_json}: no chain mode without min_draft_prob at batch 1; "
                         f"rerun `make bench-eagle`")
    big, name = max(chains)
    hist = {int(a): n for a, n in results[f"{name}@batch1"]["accepted_per_step_histogram"].items()}
    steps = sum(hist.values())
    return {k: 1 + sum(n * min(a, k) for a, n in hist.items()) / steps for k in range(big + 1)}, name


def project(costs: list[dict], acceptance: dict[int, float]) -> None:
    """Add ``tokens_per_pass`` and ``projected_speedup = L(k) / (C(k)/C(0))`` where L(k) is known."""
    for row in costs:
        L = acceptance.get(row["draft_len"])
        if L is not None:
            row["tokens_per_pass"] = round(L, 4)
            row["projected_speedup"] = round(L / row["cost_vs_plain"], 3)


def _engine_executor(a):
    from backend.bundle import as_dict
    from backend.engine.executor import Executor
    from backend.speculative.speculator import EagleSpeculator
    ex = Executor(a.engine, device=a.device, dtype=a.dtype, start=False, speculative=False, max_batch_size=8,
                  **({"cuda_graphs": False} if a.eager else {}))
    if not a.random_draft:
        draft = EagleSpeculator.for_executor(ex, tree="chain", max_draft_len=1, min_draft_prob=0.0).draft
        return ex, draft, "the bundle's trained draft"
    m = as_dict(ex.spec.model)
    cfg, t = models.random_draft(m, m["vocab_size"], device=a.device)
    return ex, attach_draft(ex, cfg, t), "random EAGLE-3 head of the target's shape"


def _llama8b_executor(a, tmp: Path):
    import torch

    from backend.engine.executor import Executor
    m = dict(models.LLAMA31_8B)
    seq = a.prompt_len + a.new_tokens + 64
    engine = {"max_batch_size": 8, "max_num_tokens": 2048, "max_seq_len": seq, "max_input_len": a.prompt_len + 8,
              "kv_block_size": 16, "kv_cache_dtype": "fp8_e4m3", "max_kv_tokens": 8 * seq,
              "enable_prefix_caching": False, "attention_backend": "triton"}
    weights = models.synthetic_fp8_weights(m, device=a.device)
    ex = Executor(models.manifest_bundle(m, engine, tmp / "engine"), device=a.device, weights=weights,
                  verify_hashes=False, start=False, cuda_graphs=False if a.eager else "auto")
    del weights
    cfg, t = models.random_draft(m, a.draft_vocab, device=a.device)
    draft = attach_draft(ex, cfg, t)
    del t
    torch.cuda.empty_cache()
    return ex, draft, f"random EAGLE-3 head, Llama-3.1-8B shape, draft vocabulary {a.draft_vocab}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.perf.step.eagle_cost", description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[2:]))
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--engine", help="an engine bundle with an EAGLE-3 draft (CPU or GPU)")
    src.add_argument("--llama8b", action="store_true",
                     help="Llama-3.1-8B-shaped FP8 target and EAGLE-3 head, random weights (NVIDIA GPU)")
    ap.add_argument("--random-draft", action="store_true", help="with --engine: a random head instead of the bundle's")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    ap.add_argument("--dtype", default=None, help="compute dtype with --engine (CPU: float32 is the fast one)")
    ap.add_argument("--draft-lens", default=",".join(map(str, DEFAULT_LENS)), help="k values; 0 = no speculation")
    ap.add_argument("--draft-vocab", type=int, default=32000, help="--llama8b draft vocabulary (EAGLE-3's 32k)")
    ap.add_argument("--prompt-len", type=int, default=128, help="tokens of the timed stream's (random) prompt")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens per timed stream")
    ap.add_argument("--reps", type=int, default=3, help="streams per k (median)")
    ap.add_argument("--breakdown", action="store_true",
                    help="one more stream per k, timed part by part: target forward, speculator prepare/verify/propose")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs (engine.cuda_graphs=false): the baseline they beat")
    ap.add_argument("--acceptance", default="docs/perf/eagle3.json",
                    help="a harness.perf.throughput.eagle result whose chain histogram gives L(k) ('' = none)")
    ap.add_argument("--out", "--output", dest="out", help="result JSON (default build/perf/eagle3-cost-<gpu name | cpu>.json)")
    a = ap.parse_args(argv)
    import torch
    a.device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    lens = tuple(int(x) for x in a.draft_lens.split(","))
    if lens[0] != 0 or any(k < 0 for k in lens):
        ap.error(f"--draft-lens {a.draft_lens}: must start with 0 (plain decoding, the baseline) and be >= 0")
    if a.llama8b and a.device != "cuda":
        print("harness.perf.step.eagle_cost --llama8b: needs an NVIDIA GPU (an 8B FP8 target on this CPU would take "
              "hours); on CPU use --engine", file=sys.stderr)
        return 2
    from harness.perf.lib.results import gpu_name, gpu_slug, header, product_path, write_result
    res = header("eagle3-cost", "harness.perf.step.eagle_cost", argv, torch=torch)
    with tempfile.TemporaryDirectory() as tmp:
        ex, draft, what = _llama8b_executor(a, Path(tmp)) if a.llama8b else _engine_executor(a)
        try:
            res["target"] = "Llama-3.1-8B shape, random FP8 weights" if a.llama8b else product_path(str(a.engine))
            res["draft"] = what
            res["device"], res["dtype"] = a.device, str(ex.runner.dtype).replace("torch.", "")
            res["workload"] = {"batch": 1, "prompt_len": a.prompt_len, "new_tokens": a.new_tokens, "reps": a.reps}
            res["cuda_graphs"] = ex.runner.graphs is not None
            costs = step_costs(ex, draft, lens, a.prompt_len, a.new_tokens, a.reps, a.breakdown)
            if ex.runner.graphs is not None:
                g = ex.runner.graphs
                res["graphs"] = g.failed or {"captured": len(g.graphs), "verify_steps": g.verify_steps}
        finally:
            ex.shutdown()
    if a.acceptance:
        acc, mode = chain_acceptance(Path(a.acceptance))
        project(costs, acc)
        res["acceptance_source"] = f"{product_path(a.acceptance)}: {mode}@batch1 histogram (SmolLM2 draft, MT-bench)"
    res["costs"] = costs
    for r in costs:
        extra = f"  L={r['tokens_per_pass']:.2f} -> {r['projected_speedup']:.2f}x" if "projected_speedup" in r else ""
        print(f"k={r['draft_len']}: {r['ms_per_pass']:8.2f} ms/pass  {r['cost_vs_plain']:.2f}x plain  "
              f"break-even L {r['breakeven_tokens_per_pass']:.2f}, {GOAL}x needs L {r[f'tokens_per_pass_for_{GOAL}x']:.2f}"
              + extra, flush=True)
    name = gpu_slug(gpu_name(res)) if a.device == "cuda" else "cpu"
    write_result(res, a.out, f"eagle3-cost-{name}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
