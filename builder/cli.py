"""``python -m builder``: build, validate and inspect engine bundles.

Every user mistake ends with ONE line on stderr (``error: <file>: <key>: <problem>; allowed: ...``)
and a non-zero exit code; ``--debug`` shows the traceback instead.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import time

from builder.schema import ConfigError
from builder.stages.base import StageError

EXIT_USER_ERROR, EXIT_BUG, EXIT_INTERRUPTED = 2, 1, 130

BUILD_EPILOG = """\
overrides:
  Any config key as key.path=value; the value is parsed as YAML, so
  engine.max_batch_size=64, engine.enable_prefix_caching=false, engine.target_sms=[90],
  quantization.format=nvfp4, model.source=/path/to/checkpoint all work.
  Keys and allowed values: docs/contracts.md section 1, or the comments in configs/*.yaml.

stages (each skipped when its config section and inputs are unchanged):
  import    checkpoint (smollm2 | HF folder | .gguf | ModelOpt-quantized HF) -> work/import
  quantize  ModelOpt calibration + export (quantization.*)                  -> work/quantize
  draft     EAGLE-3 draft head (speculative.*)                                -> work/draft
  compile   runtime weight layout, tokenizer, AOT kernels, engine.json       -> engine/
  verify    the bundle vs the unquantized model (verify.*)                    -> engine.json "verify"
  package   Triton model repository (serving.*)                               -> model_repository/

examples:
  python -m builder build configs/smollm2-135m-fp8.yaml
  python -m builder build configs/smollm2-135m-nvfp4.yaml engine.max_batch_size=64 --output build/x
  python -m builder build configs/llama70b-fp8.yaml engine.tp_size=2
"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m builder",
        description="Kiln builder: turn a YAML engine config into an engine bundle (engine/) and a Triton "
                    "model repository (model_repository/).",
        epilog="Run `python -m builder <command> --help` for each command's options.")
    sub = p.add_subparsers(dest="command", required=True, metavar="command")

    b = sub.add_parser("build", help="build an engine bundle from a config",
                       description="Build CONFIG into <output>/engine (the bundle) and <output>/model_repository.",
                       epilog=BUILD_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    b.add_argument("config", help="YAML engine config, e.g. configs/smollm2-135m-fp8.yaml")
    b.add_argument("overrides", nargs="*", metavar="key=value",
                   help="config overrides applied after the file (values parsed as YAML)")
    b.add_argument("--output", "-o", metavar="DIR",
                   help="output folder (default: output.dir from the config, else build/<config file stem>)")
    b.add_argument("--force", action="store_true", help="rebuild every stage even if it is up to date")
    b.add_argument("--until", metavar="STAGE", help="stop after this stage (import, quantize, draft, compile, "
                   "verify, package)")
    b.add_argument("--memory-limit", type=float, metavar="GIB",
                   help="host memory a stage may use; a stage whose estimate exceeds it refuses to start "
                        "(default: the memory available when the stage starts)")
    b.add_argument("--debug", action="store_true", help="show full tracebacks on errors")

    v = sub.add_parser("validate", help="check config files without building",
                       description="Validate each config file (schema, types, allowed values, combinations). "
                                   "Checks that need the model's shape run at build time, in the import stage.")
    v.add_argument("files", nargs="+", metavar="FILE", help="YAML config files")
    v.add_argument("--debug", action="store_true", help="show full tracebacks on errors")

    i = sub.add_parser("inspect", help="print an engine bundle's summary",
                       description="Load a bundle (checking format version and file hashes) and print engine.json's "
                                   "summary: model, quantization, engine limits, kernels, files.")
    i.add_argument("bundle", help="bundle folder, e.g. build/smollm2-135m-fp8/engine")
    i.add_argument("--json", action="store_true", help="print the whole engine.json")
    i.add_argument("--no-verify", action="store_true", help="skip sha256 checks of the files")
    i.add_argument("--debug", action="store_true", help="show full tracebacks on errors")
    return p


def cmd_build(args) -> int:
    from rich.console import Console

    from builder import report
    from builder.config import BuildConfig
    from builder.pipeline import run_pipeline
    from builder.stages import STAGE_NAMES

    if args.until is not None and args.until not in STAGE_NAMES:
        raise ConfigError("--until", "", f"unknown stage '{args.until}'", ", ".join(STAGE_NAMES))
    console = Console(highlight=False, markup=False)
    cfg = BuildConfig.from_yaml(args.config, args.overrides)
    t0 = time.perf_counter()
    console.print(f"Building {cfg.file} -> {cfg.output_dir(args.output)}")
    result = run_pipeline(cfg, args.output, force=args.force, until=args.until, log=console.print,
                          progress_factory=report.progress_factory(console),
                          stage_done=lambda r: console.print(report.stage_line(r)),
                          memory_limit=None if args.memory_limit is None else int(args.memory_limit * 2**30))
    report.print_summary(console, result.root, result.results, time.perf_counter() - t0)
    return 0


def cmd_validate(args) -> int:
    from builder.config import BuildConfig

    failed = 0
    for f in args.files:
        try:
            cfg = BuildConfig.from_yaml(f)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            failed += 1
            continue
        q, e_ = cfg.quantization, cfg.engine
        print(f"ok: {f} (model {cfg.model.source}, {q.format} weights, kv {q.kv_cache}, tp {e_.tp_size}, "
              f"batch {e_.max_batch_size}, seq {e_.max_seq_len})")
    return EXIT_USER_ERROR if failed else 0


def cmd_inspect(args) -> int:
    from backend.bundle import as_dict, load_bundle

    b = load_bundle(args.bundle, verify_hashes=not args.no_verify)
    m = b.manifest
    if args.json:
        print(json.dumps(as_dict(m), indent=2))
        return 0
    mc, q, e = b.model, b.quantization, b.engine
    print(f"bundle      {b.path}  ({m.format} v{m.format_version}, kiln {m.kiln_version}, created {m.created})")
    print(f"config      {m.config_file}  hash {(m.hashes.get('config') or '')[:16]}")
    print(f"model       {mc.architecture}: {mc.num_layers} layers, hidden {mc.hidden_size}, "
          f"ffn {mc.intermediate_size}, heads {mc.num_heads}/{mc.num_kv_heads} x {mc.head_dim}, "
          f"vocab {mc.vocab_size}, context {mc.max_position_embeddings}, {mc.dtype}")
    print(f"source      sha256 {(m.hashes.get('source') or '')[:16]}")
    print(f"quant       weights {q.format}, kv cache {q.kv_cache}, group {q.group_size}, "
          f"unquantized {list(q.unquantized_modules)}")
    print(f"engine      batch {e.max_batch_size}, tokens/step {e.max_num_tokens}, seq {e.max_seq_len} "
          f"(input {e.max_input_len}), kv block {e.kv_block_size} {e.kv_cache_dtype}, tp {e.tp_size}, "
          f"prefix cache {e.enable_prefix_caching}, chunked prefill {e.enable_chunked_prefill}")
    print(f"targets     sm {list(m.targets.sms)}; {len(b.kernels)} AOT kernels")
    print(f"speculative {as_dict(m.speculative)}")
    print(f"verify      {as_dict(m.verify)}")
    print(f"tools       {', '.join(f'{k} {v}' for k, v in m.tools.items())}")
    print(f"files       {len(m.files)} ({'sha256 checked' if not args.no_verify else 'not checked'})")
    return 0


COMMANDS = {"build": cmd_build, "validate": cmd_validate, "inspect": cmd_inspect}


@contextlib.contextmanager
def _noting_interrupts():
    """Yields a list that a Ctrl-C (SIGINT) appends to, while raising KeyboardInterrupt as usual.

    Library code can catch that KeyboardInterrupt and raise something else in its place:
    ``torch.tensor()`` turns one raised while it reads a Python sequence into
    ``ValueError: could not determine the shape of object type ...`` (seen in a build interrupted
    mid-compile). The command still ends as interrupted (exit 130, the line saying so), whatever
    exception reaches ``main``. Where SIGINT is not Python's default (ignored in a background job, or
    a handler of the caller's) or this is not the main thread, nothing changes."""
    seen: list[int] = []

    def note(signum, frame):
        seen.append(signum)
        raise KeyboardInterrupt

    previous = None
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        with contextlib.suppress(ValueError):            # not the main thread
            previous = signal.signal(signal.SIGINT, note)
    try:
        yield seen
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    # parse_known_args so overrides may come after options too (build CONFIG --force a=1 b=2)
    args, extra = parser.parse_known_args(argv)
    stray = [x for x in extra if x.startswith("-") or "=" not in x or args.command != "build"]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = list(args.overrides) + extra
    from backend.bundle import BundleError
    from backend.logs import setup_cli

    setup_cli()  # warnings of the libraries the build drives (e.g. kernels falling back) on stderr

    try:
        with _noting_interrupts() as interrupted:
            try:
                return COMMANDS[args.command](args)
            except Exception as e:
                if interrupted:
                    raise KeyboardInterrupt from e
                raise
    except (ConfigError, StageError, BundleError) as e:
        if args.debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        if args.debug:
            raise
        print("error: interrupted; nothing partial was kept (the next build resumes from the last "
              "finished stage)", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as e:  # a bug or an environment problem: still one line unless --debug
        if args.debug:
            raise
        text = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(f"error: {type(e).__name__}: {text} (run again with --debug for the traceback)", file=sys.stderr)
        return EXIT_BUG
