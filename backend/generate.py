"""Command line generation from an engine bundle.

    python -m backend.generate --engine build/smollm2-135m-fp8/engine --prompt "Hello" \
        [--prompt ...] [--max-tokens N] [--temperature T] [--seed S] [--chat] [--json]

All prompts run as one in-flight batch. ``--json`` prints one JSON object per prompt (``prompt``,
``token_ids``, ``text``, ``finish_reason``, ``compute_dtype`` (what the engine computed in, why, and
on a CPU with ``engine.cpu_dtype: auto`` the timings it chose by: backend/runtime/cpu_dtype.py), and
with an EAGLE draft ``draft_tokens_proposed`` / ``draft_tokens_accepted``); otherwise the generated
text of each prompt. ``--no-spec`` leaves a bundle's draft unused; ``--cpu-dtype`` overrides the
bundle's ``engine.cpu_dtype``.
"""
from __future__ import annotations

import argparse
import json
import sys

from backend.engine.executor import Executor
from backend.engine.sampling_params import SamplingParams
from backend.logs import setup_cli
from backend.runtime.spec import EngineError
from backend.serving.conversion.tokenizer import load_tokenizer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m backend.generate", description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", required=True, help="engine bundle folder (holds engine.json)")
    p.add_argument("--prompt", action="append", required=True, help="a prompt; repeat for a batch")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt")
    p.add_argument("--device", default="cpu", help="cpu | cuda")
    p.add_argument("--no-spec", action="store_true",
                   help="do not use the bundle's EAGLE draft (speculative decoding off)")
    p.add_argument("--cpu-dtype", default=None, help="override engine.cpu_dtype: auto | float32 | bfloat16")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_cli()
    try:
        tok = load_tokenizer(args.engine)
        prompts = [tok.encode(text, chat=args.chat) for text in args.prompt]
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_k=args.top_k, top_p=args.top_p, seed=args.seed)
        # Field checks before paying for the model load; the executor re-checks against the engine.
        params.validate(max(args.max_tokens, 1))
        overrides = {"cpu_dtype": args.cpu_dtype} if args.cpu_dtype is not None else {}
        with Executor(args.engine, device=args.device, speculative=not args.no_spec, **overrides) as ex:
            results = ex.generate(prompts, params)
        spec = ex.speculator
        dtype = ex.runner.dtype_choice.as_dict()
    except (EngineError, ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for text, res in zip(args.prompt, results):
        out = tok.decode(res.token_ids)
        if args.json:
            doc = {"prompt": text, "token_ids": res.token_ids, "text": out,
                   "finish_reason": res.finish_reason, "compute_dtype": dtype}
            if spec is not None:  # EAGLE: this request's draft tokens scored / kept
                doc.update(spec.request_stats(res.request_id))
            print(json.dumps(doc, ensure_ascii=False))
        else:
            print(out)
    return 0 if all(r.finish_reason in ("length", "stop") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
