"""python -m harness.openai: serve the OpenAI API in front of a running Triton server.

    python -m harness.openai --triton-url 127.0.0.1:8001 \\
        --model-repository build/smollm2-135m-fp8/model_repository [--host 127.0.0.1 --port 9000]

Endpoints: GET /v1/models, POST /v1/chat/completions, POST /v1/completions, POST /v1/responses
(streamed as server-sent events with "stream": true), GET /health (200 once Triton's engine model is ready, else 503),
GET /metrics (Triton's metrics text). Each request is one gRPC stream to the repository's engine
model (tensorrt_llm); the prompt is tokenized here with the bundle's tokenizer. `make serve` starts
this beside Triton on 127.0.0.1:9000.

A Triton that requires an API key (bound beyond loopback with keys: harness.serve --triton-host) is
sent the one in the environment variable KILN_TRITON_API_KEY on every engine call.

Try:
  curl -s localhost:9000/v1/chat/completions -H 'Content-Type: application/json' \\
       -d '{"model": "<id from /v1/models>", "messages": [{"role": "user", "content": "Hi!"}]}'
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from builder.schema import ConfigError
from harness.openai.auth import ENV, load_keys
from harness.openai.limits import DEFAULT_MAX_BODY_BYTES, Limits
from harness.openai.reasoning import REASONING_PARSERS
from harness.openai.tool_parsers import FORMATS
from harness.serve_ports import DEFAULT as DEFAULT_PORTS, config_ports
from harness.triton_auth import TRITON_KEY_ENV, grpc_headers

__all__ = ["main", "parse_args"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m harness.openai", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--triton-url", default=None,
                   help="Triton's gRPC address, host:port (default 127.0.0.1 on --config's serving.grpc_port, "
                        f"else 127.0.0.1:{DEFAULT_PORTS.grpc})")
    p.add_argument("--config", default=None,
                   help="the engine config Triton serves: its serving.grpc_port / metrics_port make the "
                        "default --triton-url and --metrics-url")
    p.add_argument("--model-repository", required=True,
                   help="the repository Triton serves (build/<stem>/model_repository): names the engine "
                        "model and its bundle (tokenizer, limits)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; 0.0.0.0 = every interface)")
    p.add_argument("--port", type=int, default=9000, help="port to bind (default 9000)")
    p.add_argument("--metrics-url", default=None,
                   help="Triton's metrics URL that GET /metrics passes on "
                        "(default http://<triton host>:<serving.metrics_port>/metrics)")
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients send (default: the bundle's config stem, e.g. smollm2-135m-fp8)")
    p.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help=f"require 'Authorization: Bearer KEY' on /v1/* (repeatable; also {ENV}, comma-separated, "
                        "and --api-key-file). A key on the command line is visible to other users in ps: "
                        "prefer the file or the environment")
    p.add_argument("--api-key-file", action="append", default=[], metavar="FILE",
                   help="a file of API keys, one per line (# comments); repeatable")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help=f"refuse bodies larger than this with 413 before reading them (default {DEFAULT_MAX_BODY_BYTES})")
    p.add_argument("--max-tokens-cap", type=int, default=None,
                   help="the most tokens one request may generate: larger max_tokens is a 400, none asked "
                        "means this many (default: all the room max_seq_len leaves)")
    p.add_argument("--tool-parser", default=None, choices=["auto", *FORMATS, "none"],
                   help="how tool calls are written and parsed: hermes (<tool_call>, Hermes and Qwen), llama3_json "
                        "(Llama 3.1-3.3), mistral ([TOOL_CALLS]), deepseek (DeepSeek V3/R1/V3.1), harmony "
                        "(gpt-oss); auto picks the one whose markers the bundle's chat template spells, hermes when it "
                        "spells none; none refuses tools (default: the build config's serving.tool_parser, auto)")
    p.add_argument("--reasoning-parser", default=None, choices=["auto", *REASONING_PARSERS, "none"],
                   help="how the model's thinking is split into reasoning_content: think (<think>...</think>, "
                        "DeepSeek-R1, Qwen3) or harmony (gpt-oss's analysis channel); auto picks the one whose markers "
                        "the chat template spells, else none (default: the build config's serving.reasoning_parser, "
                        "auto)")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template that replaces the bundle's (the parsers' auto then reads it)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (info logs one line per request)")
    a = p.parse_args(argv)
    try:
        ports = config_ports(a.config)
    except (ConfigError, ValueError) as e:
        p.error(str(e))
    if a.triton_url is None:
        a.triton_url = f"127.0.0.1:{ports.grpc}"
    if not 1 <= a.port <= 65535:
        p.error(f"--port: {a.port}; allowed: 1..65535")
    if ":" not in a.triton_url:
        p.error(f"--triton-url: {a.triton_url!r}; expected host:port (Triton's gRPC port, e.g. 127.0.0.1:8001)")
    if not Path(a.model_repository).is_dir():
        p.error(f"--model-repository: {a.model_repository} not found; build it first: make build")
    if a.chat_template is not None:
        try:
            a.chat_template = Path(a.chat_template).read_text(encoding="utf-8")
        except OSError as e:
            p.error(f"--chat-template: {e}")
    if a.max_body_bytes < 1024:
        p.error(f"--max-body-bytes: {a.max_body_bytes}; allowed: >= 1024")
    if a.max_tokens_cap is not None and a.max_tokens_cap < 1:
        p.error(f"--max-tokens-cap: {a.max_tokens_cap}; allowed: >= 1")
    try:
        a.api_keys = load_keys(a.api_key, a.api_key_file)
    except (OSError, ValueError) as e:
        p.error(str(e))
    del a.api_key  # only the resolved keys travel on
    if a.metrics_url is None:
        a.metrics_url = f"http://{a.triton_url.rsplit(':', 1)[0]}:{ports.metrics}/metrics"
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    import uvicorn

    from harness.openai.app import create_app
    from harness.openai.served_model import load_served_model

    try:
        model = load_served_model(a.model_repository, a.served_model_name, a.tool_parser, a.reasoning_parser,
                                  a.chat_template)
    except (OSError, ValueError, RuntimeError) as e:  # RuntimeError: backend.bundle.BundleError
        print(f"error: {e}", file=sys.stderr)
        return 2
    triton_key = os.environ.get(TRITON_KEY_ENV) or None   # from the environment only: ps shows argv
    app = create_app(model, a.triton_url, a.metrics_url, a.api_keys, Limits(a.max_body_bytes, a.max_tokens_cap),
                     grpc_headers(triton_key))
    # the number of keys, never a key
    auth = f"{len(a.api_keys)} API key(s) required on /v1" if a.api_keys else "no API key required"
    tools = model.tool_format.name if model.tool_format else "none"
    thinks = model.reasoning.name if model.reasoning else "none"
    with_key = " with its API key" if triton_key else ""   # that there is one, never the key
    print(f"OpenAI API for model '{model.name}' on http://{a.host}:{a.port}/v1 "
          f"(Triton gRPC {a.triton_url}{with_key}, engine model '{model.engine_model}'; tool calls: {tools}; "
          f"reasoning: {thinks}; {auth})", flush=True)
    # timeout_graceful_shutdown: on SIGTERM/Ctrl-C open streams are given a moment, then closed,
    # which cancels their engine requests (a stream can otherwise run for max_tokens)
    uvicorn.run(app, host=a.host, port=a.port, log_level=a.log_level, timeout_graceful_shutdown=3)
    return 0


if __name__ == "__main__":
    sys.exit(main())
