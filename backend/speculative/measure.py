"""Greedy runs that measure a draft: acceptance length, acceptance rate, target passes per token.

Shared by the build's verify stage (held-out prompts, recorded in engine.json) and the benchmark
(``harness/perf/throughput/eagle.py``, MT-bench). The executor is stepped by hand (``start=False``) so that every target
forward pass is counted: one ``step()`` that schedules anything is one pass.
"""
from __future__ import annotations

import time

from backend.engine.sampling_params import SamplingParams


def run_greedy(ex, prompts: list[list[int]], max_tokens: int, batch: int) -> dict:
    """Generate greedily for ``prompts`` in groups of ``batch`` (all of a group submitted at once,
    the next group after the last one finished). -> tokens per prompt and pass/time counts."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    out, steps, t0 = [], 0, time.perf_counter()
    for i in range(0, len(prompts), batch):
        hs = [ex.submit(p, params) for p in prompts[i:i + batch]]
        while not all(h.finished for h in hs):
            steps += 1 if ex.step() else 0
        out += [h.result().token_ids for h in hs]
    wall = time.perf_counter() - t0
    ntok = sum(len(o) for o in out)
    return {"tokens": out, "generated_tokens": ntok, "target_passes": steps, "wall_s": round(wall, 3),
            "tokens_per_s": round(ntok / wall, 2) if wall > 0 else 0.0,
            # At batch > 1 one pass serves several sequences; per sequence it is still one pass.
            "passes_per_token": round(steps * batch / ntok, 4) if batch == 1 and ntok else None}


def acceptance(ex, prompts: list[list[int]], max_tokens: int, batch: int) -> dict:
    """The draft attached to ``ex`` on ``prompts``: the speculator's counters for this run plus the
    run's counts (the stats start from zero here)."""
    spec = ex.speculator
    assert spec is not None and spec.stats is not None, "acceptance() needs an executor with a draft attached"
    spec.stats = type(spec.stats)()
    r = run_greedy(ex, prompts, max_tokens, batch)
    r.pop("tokens")
    st = spec.stats.as_dict()
    return {"mean_acceptance_length": round(st["mean_acceptance_length"], 4),
            "tokens_per_target_pass": round(st["tokens_per_target_pass"], 4),
            "spec_undrafted_steps": st["spec_undrafted_steps"],
            "acceptance_rate": round(st["acceptance_rate"], 4),
            "draft_tokens_proposed": st["draft_tokens_proposed"],
            "draft_tokens_accepted": st["draft_tokens_accepted"],
            "spec_verify_steps": st["spec_verify_steps"],
            "accepted_per_step_histogram": st["accepted_per_step_histogram"],
            "num_prompts": len(prompts), "max_tokens": max_tokens, "batch": batch, **r}


__all__ = ["acceptance", "run_greedy"]
