"""Serve a Kiln model repository with a real Triton Inference Server (``make serve``).

    python -m harness.serve --config configs/smollm2-135m-fp8.yaml      # what make serve runs
    python -m harness.serve --model-repository build/smollm2-135m-fp8/model_repository

Uses ``tritonserver`` from PATH (NVIDIA's container) or else the one in the nvidia-pytriton wheel,
binds ``--triton-host`` (127.0.0.1) on the config's ``serving.http_port`` / ``grpc_port`` /
``metrics_port`` (8000, 8001, 8002 without ``--config``; ``--http-port`` and the like beat both),
waits until every model is
ready, prints client examples, and on Ctrl-C / SIGTERM first has the engine end every in-flight
request (each client gets a final response or an error; ``TritonServer.drain`` says why this must
come before the server's own SIGTERM), then stops the server and its Python backend stubs and
removes their shared-memory files.

With ``--openai-port`` (``make serve`` passes 9000; 0 = off) it also starts the OpenAI-compatible
front door (``harness.openai``) on that port once Triton is ready, stops it first on the way out
(its open streams close, cancelling their engine requests), and stops everything when it dies.

Addresses: ``--host`` is the OpenAI front door's, ``--triton-host`` Triton's HTTP, gRPC and metrics
endpoints' (both 127.0.0.1: this machine only). Triton bound to another address with an API key
requires the FIRST key on every protocol but health (HTTP ``Authorization: Bearer KEY``, gRPC
metadata ``triton-grpc-protocol-authorization: Bearer KEY``; metrics stay open: Triton cannot
restrict them); without a key a warning says its endpoints are open to anyone who reaches them.
The key is then on tritonserver's command line, readable by local users in /proc while it runs;
nothing Kiln prints or logs shows it.
"""
from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

from builder.config import BuildConfig
from builder.schema import ConfigError
from harness.serve_ports import config_ports
from harness.serving_server import ServerError, TritonServer
from harness.model_names import repository_names
from harness.serve_gpus import PlacementError, check_repository_gpus
from harness.openai.auth import load_keys
from harness.openai.process import OpenAIServer
from harness.openai.reasoning import REASONING_PARSERS
from harness.openai.tool_parsers import FORMATS
from harness.triton_auth import GRPC_HEADER, is_loopback, open_warning

EXIT_MODEL_FAILED = 3  # the server or one of its model stubs died while serving
# After a failure, how long Triton gets to exit on SIGTERM before it is killed: the dead stub's
# requests never end, so its exit timeout would pass in full and then it crashes on the way out.
FAILED_STOP_GRACE_S = 3.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m harness.serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None,
                   help="the engine config the repository was built from: its serving.*_port keys are the "
                        "ports (default: 8000/8001/8002) and its output folder the default --model-repository")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="config override, as given to make build (OVERRIDES); repeatable; needs --config")
    p.add_argument("--model-repository", default=None,
                   help="the rendered repository (default with --config: build/<config stem>/model_repository)")
    p.add_argument("--host", default="127.0.0.1",
                   help="the OpenAI front door's address (default 127.0.0.1; 0.0.0.0 = every interface); "
                        "Triton's is --triton-host")
    p.add_argument("--triton-host", default="127.0.0.1",
                   help="the address of Triton's HTTP, gRPC and metrics endpoints (default 127.0.0.1: this "
                        "machine only). Another address with an API key makes every Triton protocol but "
                        "health require the first key; without a key Triton is open (a warning says so)")
    p.add_argument("--http-port", type=int, default=None, help="beats the config's serving.http_port")
    p.add_argument("--grpc-port", type=int, default=None, help="beats the config's serving.grpc_port")
    p.add_argument("--metrics-port", type=int, default=None, help="beats the config's serving.metrics_port")
    p.add_argument("--openai-port", type=int, default=0,
                   help="also serve the OpenAI API (harness.openai) on this port; 0 = off (default; "
                        "make serve passes 9000)")
    p.add_argument("--api-key-file", action="append", default=[], metavar="FILE",
                   help="API keys, one per line (also KILN_API_KEY, comma-separated; make serve API_KEY=...): "
                        "/v1/* then needs 'Authorization: Bearer KEY' (any key), and so does Triton when "
                        "--triton-host is not loopback (the first key: this file's first line, else "
                        "KILN_API_KEY's first)")
    p.add_argument("--openai-max-body-bytes", type=int, default=None,
                   help="the OpenAI API's body size limit (python -m harness.openai --max-body-bytes)")
    p.add_argument("--openai-max-tokens-cap", type=int, default=None,
                   help="the OpenAI API's per-request max_tokens cap (python -m harness.openai --max-tokens-cap)")
    # the choices are checked here too, so a misspelt name stops before Triton is started
    p.add_argument("--openai-tool-parser", default=None, choices=["auto", *FORMATS, "none"],
                   help="the OpenAI API's tool-call syntax (python -m harness.openai --tool-parser; default auto)")
    p.add_argument("--openai-reasoning-parser", default=None, choices=["auto", *REASONING_PARSERS, "none"],
                   help="the OpenAI API's reasoning split (python -m harness.openai --reasoning-parser; default auto)")
    p.add_argument("--log-file", default=None, help="server log (default build/logs/tritonserver-*.log)")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--verbose", type=int, default=0, help="tritonserver --log-verbose level")
    a = p.parse_args(argv)
    try:
        ports = config_ports(a.config, a.override)
    except (ConfigError, ValueError) as e:
        p.error(str(e))
    for name in ("http", "grpc", "metrics"):
        if getattr(a, f"{name}_port") is None:
            setattr(a, f"{name}_port", getattr(ports, name))
    if a.model_repository is None:
        if a.config is None:
            p.error("--model-repository or --config is required")
        a.model_repository = str(BuildConfig.from_yaml(a.config, a.override).output_dir() / "model_repository")
    for name in ("http_port", "grpc_port", "metrics_port"):
        v = getattr(a, name)
        if not 1 <= v <= 65535:
            p.error(f"--{name.replace('_', '-')}: {v}; allowed: 1..65535")
    if len({a.http_port, a.grpc_port, a.metrics_port}) != 3:
        p.error("--http-port, --grpc-port and --metrics-port must differ")
    if a.openai_port and not 1 <= a.openai_port <= 65535:
        p.error(f"--openai-port: {a.openai_port}; allowed: 0 (off) or 1..65535")
    if a.openai_port in (a.http_port, a.grpc_port, a.metrics_port):
        p.error(f"--openai-port {a.openai_port} is one of Triton's ports")
    try:
        a.api_keys = load_keys(files=a.api_key_file)
    except (OSError, ValueError) as e:
        p.error(str(e))
    a.openai_args = tuple(arg for flag, v in (("--max-body-bytes", a.openai_max_body_bytes),
                                              ("--max-tokens-cap", a.openai_max_tokens_cap),
                                              ("--tool-parser", a.openai_tool_parser),
                                              ("--reasoning-parser", a.openai_reasoning_parser))
                          if v is not None for arg in (flag, str(v)))
    repo = Path(a.model_repository)
    if not repo.is_dir():
        p.error(f"--model-repository: {repo} not found; build it first: make build")
    return a


def openai_examples(oai: OpenAIServer | None, model: str) -> str:
    if oai is None:
        return ""
    key = " -H \"Authorization: Bearer $KILN_API_KEY\"" if oai.api_keys else ""  # the variable, never a key
    return f"""
OpenAI API  {oai.base_url}   model "{model}"   (python -m harness.openai --help)
  curl -s {oai.base_url}/chat/completions -H 'Content-Type: application/json'{key} \\
       -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Tell me about Paris"}}], "max_tokens": 64}}'
"""


def triton_access(srv: TritonServer) -> str:
    """Who may call Triton, in one line (never the key)."""
    if srv.restricted:
        return (f"bound to {srv.host}: every protocol but health needs the first API key (HTTP 'Authorization: "
                f"Bearer KEY', gRPC '{GRPC_HEADER}: Bearer KEY'; the clients below read it from "
                f"KILN_API_KEY); metrics are open")
    if not is_loopback(srv.host):
        return f"bound to {srv.host} with no API key: open to anyone who reaches it"
    return f"bound to {srv.host}: this machine only"


def examples(srv: TritonServer, oai: OpenAIServer | None = None, model: str = "") -> str:
    h, g = srv.http_url, srv.grpc_url
    names = repository_names(srv.repo)
    ens, bls = names.ensemble, names.bls
    key = " -H \"Authorization: Bearer $KILN_API_KEY\"" if srv.restricted else ""  # the variable, never a key
    return f"""
Kiln is serving {srv.repo}
  HTTP    http://{h}      gRPC {g}      metrics {srv.metrics_url}
  access  {triton_access(srv)}
  log     {srv.log_file}
  pid     {srv.proc.pid} (process group of the server and its Python backend stubs)

Try:
  python -m harness.client --url {g} --model {ens} --stream "Tell me about Paris"
  python -m harness.client --url {h} --protocol http --model {bls} "Tell me about Paris"
  curl -s -X POST http://{h}/v2/models/{ens}/generate{key} \\
       -d '{{"text_input": "Tell me about Paris", "max_tokens": 64, "temperature": 0}}'
  curl -s -N -X POST http://{h}/v2/models/{ens}/generate_stream{key} \\
       -d '{{"text_input": "Tell me about Paris", "max_tokens": 64, "stream": true}}'
  curl -s {srv.metrics_url} | grep kiln_
{openai_examples(oai, model)}
Ctrl-C stops the server.
"""


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    try:  # tp_size x engine_instances GPUs: refused here, before Triton loads anything
        check_repository_gpus(a.model_repository)
    except PlacementError as e:
        print(f"error: {a.model_repository}: {e}", file=sys.stderr)
        return 1
    stop = threading.Event()
    # Triton holds one key per protocol group: the first (every key opens the OpenAI API)
    srv = TritonServer(a.model_repository, http_port=a.http_port, grpc_port=a.grpc_port,
                       metrics_port=a.metrics_port, host=a.triton_host, log_file=a.log_file,
                       startup_timeout=a.startup_timeout, verbose=a.verbose,
                       api_key=a.api_keys[0] if a.api_keys else None)
    if not is_loopback(a.triton_host) and not a.api_keys:
        print(open_warning(a.triton_host), file=sys.stderr, flush=True)
    if not is_loopback(a.host) and not a.openai_port:
        print(f"warning: --host {a.host} is the OpenAI API's address and the OpenAI API is off (--openai-port 0): "
              f"Triton listens on --triton-host ({a.triton_host})", file=sys.stderr, flush=True)

    def on_signal(signum, _frame):
        stop.set()
        srv.abort.set()  # also stops waiting for a server that is still loading models
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    print(f"starting {srv.repo} (log {srv.log_file}) ...", flush=True)
    try:
        srv.start()  # stops the server itself when start-up fails or is interrupted
    except ServerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 130 if stop.is_set() else 1
    oai = None
    failed = False
    try:
        model = ""
        if a.openai_port:
            from harness.openai.served_model import load_served_model
            model = load_served_model(srv.repo).name
            oai = OpenAIServer(srv.repo, srv.grpc_url, srv.metrics_url, host=a.host, port=a.openai_port,
                               log_file=srv.log_file.with_name(srv.log_file.stem + "-openai.log"),
                               api_keys=a.api_keys, extra_args=a.openai_args,
                               triton_api_key=srv.api_key if srv.restricted else None)
            try:
                oai.start()
            except RuntimeError as e:
                oai = None
                print(f"error: {e}", file=sys.stderr)
                return 1
        srv.watch()
        print(examples(srv, oai, model), flush=True)
        while not stop.wait(0.5):
            failure = srv.failure() or (oai.failure() if oai is not None else None)
            if failure is not None:
                # A dead engine stub leaves Triton answering "ready" while its requests hang: stop
                # the whole server instead, so clients see their streams end and a supervisor
                # (systemd, Kubernetes) sees the exit and restarts it.
                print(f"error: {failure}; stopping the server (exit code {EXIT_MODEL_FAILED}); "
                      f"log {srv.log_file}:\n{srv.log_tail()}", file=sys.stderr)
                failed = True
                return EXIT_MODEL_FAILED
    finally:
        print("stopping ...", flush=True)
        if oai is not None:
            oai.stop()
        code = srv.stop(FAILED_STOP_GRACE_S if failed else None)
        print(f"stopped (tritonserver exit code {code})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
