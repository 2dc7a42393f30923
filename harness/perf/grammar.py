"""Which grammar library Kiln's structured output uses, by measurement: xgrammar vs llguidance on the
bundle's tokenizer, for the five test schemas (``SCHEMAS`` below).

For each library and schema: the time to compile the schema (first time, then a cache hit where the
library caches), and the time to compute the next-token mask at each token of a valid document
(what a decode step pays per guided sequence), mean and p99; then the time to apply one mask to a
``[1, vocab]`` fp32 logits row with torch. Writes ``build/perf/grammar-mask.json``.

    python -m harness.perf.grammar --tokenizer build/smollm2-135m-fp8/engine/tokenizer/tokenizer.json \
        --bundle build/smollm2-135m-fp8/engine

``SCHEMAS``, ``PROMPTS`` and ``EXAMPLES``: five JSON schemas of different shapes (nested objects,
arrays, enums, bounded numbers, required fields), each with a prompt that invites it and one valid
document (one line, ", " and ": " between items, as the engine's grammar writes JSON), shared with the
structured-output tests (tests/runtime/test_guided.py).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from harness.perf.lib.results import header, write_result

SCHEMAS: dict[str, dict] = {
    "person": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20},
                       "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"], "additionalProperties": False,
    },
    "order": {  # nested object and an array of objects
        "type": "object",
        "properties": {
            "customer": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9999},
                                                          "vip": {"type": "boolean"}},
                         "required": ["id", "vip"], "additionalProperties": False},
            "items": {"type": "array", "minItems": 1, "maxItems": 3,
                      "items": {"type": "object",
                                "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"},
                                               "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
                                "required": ["sku", "qty"], "additionalProperties": False}},
        },
        "required": ["customer", "items"], "additionalProperties": False,
    },
    "weather": {  # enum and a bounded number
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 24},
                       "sky": {"type": "string", "enum": ["sunny", "cloudy", "rain", "snow"]},
                       "celsius": {"type": "number", "minimum": -50, "maximum": 60}},
        "required": ["city", "sky", "celsius"], "additionalProperties": False,
    },
    "tags": {  # array of enums, unique
        "type": "object",
        "properties": {"tags": {"type": "array", "minItems": 2, "maxItems": 4,
                                "items": {"type": "string", "enum": ["red", "green", "blue", "black"]}},
                       "count": {"type": "integer", "minimum": 2, "maximum": 4}},
        "required": ["tags", "count"], "additionalProperties": False,
    },
    "point": {  # numbers only, all required, nested array of numbers
        "type": "object",
        "properties": {"x": {"type": "number", "minimum": -1, "maximum": 1},
                       "y": {"type": "number", "minimum": -1, "maximum": 1},
                       "history": {"type": "array", "maxItems": 3,
                                   "items": {"type": "integer", "minimum": 0, "maximum": 99}}},
        "required": ["x", "y", "history"], "additionalProperties": False,
    },
}

PROMPTS: dict[str, str] = {
    "person": "Describe a person as JSON with a name and an age:",
    "order": "Write a shop order as JSON (customer id and vip flag, a list of items with sku and qty):",
    "weather": "Give today's weather in a city as JSON (city, sky, celsius):",
    "tags": "List a few colours as JSON tags with their count:",
    "point": "A point in the unit square as JSON with a short history:",
}

EXAMPLES: dict[str, str] = {
    "person": '{"name": "Ada", "age": 36}',
    "order": '{"customer": {"id": 7, "vip": true}, "items": [{"sku": "ABC12", "qty": 2}]}',
    "weather": '{"city": "Paris", "sky": "rain", "celsius": 12.5}',
    "tags": '{"tags": ["red", "blue"], "count": 2}',
    "point": '{"x": 0.25, "y": -0.5, "history": [3, 14]}',
}



def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.array(xs), q)) if xs else 0.0


def _summary(compile_s: list[float], recompile_s: list[float], mask_s: list[float]) -> dict:
    return {"compile_ms_mean": 1e3 * statistics.mean(compile_s),
            "compile_ms_max": 1e3 * max(compile_s),
            "cached_compile_ms_mean": 1e3 * statistics.mean(recompile_s),
            "mask_us_mean": 1e6 * statistics.mean(mask_s),
            "mask_us_p99": 1e6 * _pct(mask_s, 99), "mask_samples": len(mask_s)}


def bench_xgrammar(tok_json: dict, ids_of: dict[str, list[int]], eos: list[int]) -> dict:
    import xgrammar as xgr
    from backend.engine.guided import tokenizer_info
    from backend.engine.vocab import vocab_strings
    vocab = vocab_strings(tok_json)
    info = tokenizer_info(tok_json, len(vocab), eos)
    compiler = xgr.GrammarCompiler(info, max_threads=2)
    compile_s, recompile_s, mask_s = [], [], []
    bitmask = xgr.allocate_token_bitmask(1, len(vocab))
    for name, schema in SCHEMAS.items():
        t0 = time.perf_counter()
        cg = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
        compile_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
        recompile_s.append(time.perf_counter() - t0)
        m = xgr.GrammarMatcher(cg)
        for tok in ids_of[name]:
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(bitmask, 0)
            mask_s.append(time.perf_counter() - t0)
            assert m.accept_token(tok), f"xgrammar refused token {tok} of the valid {name} document"
    return _summary(compile_s, recompile_s, mask_s)


class _Tokens:
    """What llguidance's TokenizerWrapper reads: each token's bytes (its own transformers adapter
    spelled this byte-level BPE's 'Ġ' as the two bytes of the character, not a space)."""

    def __init__(self, tok_path: str, eos: list[int]) -> None:
        from tokenizers import Tokenizer
        from backend.engine.vocab import token_bytes
        self._tok = Tokenizer.from_file(tok_path)
        self.tokens = token_bytes(json.loads(Path(tok_path).read_text(encoding="utf-8")))
        self.eos_token_id = eos[0]
        self.bos_token_id = None
        self.special_token_ids = eos

    def __call__(self, s: str) -> list[int]:
        return self._tok.encode(s, add_special_tokens=False).ids


def bench_llguidance(tok_path: str, ids_of: dict[str, list[int]], eos: list[int]) -> dict:
    import llguidance
    tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Tokens(tok_path, eos)))
    compile_s, recompile_s, mask_s = [], [], []
    for name, schema in SCHEMAS.items():
        t0 = time.perf_counter()
        m = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema)))
        compile_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema)))
        recompile_s.append(time.perf_counter() - t0)
        assert not m.is_error(), m.get_error()
        for t in ids_of[name]:
            t0 = time.perf_counter()
            m.compute_bitmask()
            mask_s.append(time.perf_counter() - t0)
            assert m.consume_token(t), f"llguidance refused token {t} of the valid {name} document"
    return _summary(compile_s, recompile_s, mask_s)


def bench_apply(vocab_size: int, repeats: int = 2000) -> dict:
    import torch
    from backend.engine.guided import apply_bitmask
    logits = torch.randn(1, vocab_size)
    words = torch.randint(-2**31, 2**31 - 1, (1, (vocab_size + 31) // 32), dtype=torch.int32)
    apply_bitmask(logits.clone(), words)
    t0 = time.perf_counter()
    for _ in range(repeats):
        apply_bitmask(logits.clone(), words)
    return {"apply_us_mean": 1e6 * (time.perf_counter() - t0) / repeats}


def bench_engine_step(bundle: str, tok_path: str, batch: int = 16, steps: int = 12, rounds: int = 3) -> dict:
    """Decode-step wall time of the real engine on this CPU, ``batch`` sequences, every one guided
    (json_schema, the schemas in turn) vs none: what the masks add to a step, fill and apply.
    Alternated over ``rounds`` (the first executor of a process pays warm-up costs), the same
    ``steps`` decode steps each time (all sequences still running); the fastest round's median."""
    from tokenizers import Tokenizer
    from backend.engine.executor import Executor
    from backend.engine.sampling_params import SamplingParams
    tok = Tokenizer.from_file(tok_path)
    names = list(SCHEMAS)
    prompts = [tok.encode(PROMPTS[names[i % len(names)]]).ids for i in range(batch)]
    medians: dict[str, list[float]] = {"unguided": [], "guided": []}
    for _ in range(rounds):
        for label in ("unguided", "guided"):
            ex = Executor(bundle, start=False, verify_hashes=False, speculative=False)
            params = [SamplingParams(max_tokens=4 * steps, temperature=0.0,
                                     guide=("json_schema", json.dumps(SCHEMAS[names[i % len(names)]]))
                                     if label == "guided" else None) for i in range(batch)]
            for p, sp in zip(prompts, params):
                ex.submit(p, sp)
            ex.step()                                   # the prefill
            times = []
            for _ in range(steps):
                t0 = time.perf_counter()
                n = ex.step()
                times.append(time.perf_counter() - t0)
                assert n == batch, "a sequence ended early: fewer steps, or longer outputs"
            ex.shutdown()
            medians[label].append(1e3 * statistics.median(times))
    out = {k: {"decode_step_ms_median": min(v), "rounds_ms": v, "steps": steps} for k, v in medians.items()}
    out["batch"] = batch
    out["added_ms_per_step"] = out["guided"]["decode_step_ms_median"] - out["unguided"]["decode_step_ms_median"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m harness.perf.grammar", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", required=True, help="the bundle's tokenizer.json")
    p.add_argument("--bundle", default=None, help="an engine bundle: also time decode steps with and without masks")
    p.add_argument("--out", "--output", dest="out", default=None, help="result JSON (default build/perf/grammar-mask.json)")
    a = p.parse_args(argv)
    from tokenizers import Tokenizer
    text = Path(a.tokenizer).read_text(encoding="utf-8")
    tok = Tokenizer.from_str(text)
    ids_of = {name: tok.encode(doc, add_special_tokens=False).ids for name, doc in EXAMPLES.items()}
    eos = [tok.token_to_id("<|endoftext|>")] if tok.token_to_id("<|endoftext|>") is not None else []
    head = header("grammar-mask", "harness.perf.grammar", argv)
    results = {"xgrammar": bench_xgrammar(json.loads(text), ids_of, eos), "llguidance": bench_llguidance(a.tokenizer, ids_of, eos)}
    results["apply"] = bench_apply(tok.get_vocab_size())
    if a.bundle:
        results["engine_step"] = bench_engine_step(a.bundle, a.tokenizer)
    import llguidance
    import xgrammar
    out = {
        **head,
        "what": "structured-output mask cost per guided sequence and decode step, SmolLM2 tokenizer (49,152 tokens)",
        "versions": {"xgrammar": getattr(xgrammar, "__version__", "0.2.8"), "llguidance": llguidance.get_version()},
        "results": results,
    }
    write_result(out, a.out, "grammar-mask.json")
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
