"""Serve a Kiln model repository with a real Triton Inference Server (``make serve``).

    python -m harness.serve --model-repository build/smollm2-135m-fp8/model_repository

Uses ``tritonserver`` from PATH (NVIDIA's container) or else the one in the nvidia-pytriton wheel,
binds 127.0.0.1 (HTTP 8000, gRPC 8001, metrics 8002 unless overridden), waits until every model is
ready, prints client examples, and on Ctrl-C / SIGTERM first has the engine end every in-flight
request (each client gets a final response or an error; ``TritonServer.drain`` says why this must
come before the server's own SIGTERM), then stops the server and its Python backend stubs and
removes their shared-memory files.
"""
from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

from harness.serving_server import ServerError, TritonServer
from harness.model_names import repository_names

EXIT_MODEL_FAILED = 3  # the server or one of its model stubs died while serving


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m harness.serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-repository", required=True, help="the rendered repository (build/<stem>/model_repository)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument("--log-file", default=None, help="server log (default build/logs/tritonserver-*.log)")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--verbose", type=int, default=0, help="tritonserver --log-verbose level")
    a = p.parse_args(argv)
    for name in ("http_port", "grpc_port", "metrics_port"):
        v = getattr(a, name)
        if not 1 <= v <= 65535:
            p.error(f"--{name.replace('_', '-')}: {v}; allowed: 1..65535")
    if len({a.http_port, a.grpc_port, a.metrics_port}) != 3:
        p.error("--http-port, --grpc-port and --metrics-port must differ")
    repo = Path(a.model_repository)
    if not repo.is_dir():
        p.error(f"--model-repository: {repo} not found; build it first: make build")
    return a


def examples(srv: TritonServer) -> str:
    h, g = srv.http_url, srv.grpc_url
    names = repository_names(srv.repo)
    ens, bls = names.ensemble, names.bls
    return f"""
Kiln is serving {srv.repo}
  HTTP    http://{h}      gRPC {g}      metrics {srv.metrics_url}
  log     {srv.log_file}
  pid     {srv.proc.pid} (process group of the server and its Python backend stubs)

Try:
  python -m harness.client --url {g} --model {ens} --stream "Tell me about Paris"
  python -m harness.client --url {h} --protocol http --model {bls} "Tell me about Paris"
  curl -s -X POST http://{h}/v2/models/{ens}/generate \\
       -d '{{"text_input": "Tell me about Paris", "max_tokens": 64, "temperature": 0}}'
  curl -s -N -X POST http://{h}/v2/models/{ens}/generate_stream \\
       -d '{{"text_input": "Tell me about Paris", "max_tokens": 64, "stream": true}}'
  curl -s {srv.metrics_url} | grep kiln_

Ctrl-C stops the server.
"""


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    stop = threading.Event()
    srv = TritonServer(a.model_repository, http_port=a.http_port, grpc_port=a.grpc_port,
                       metrics_port=a.metrics_port, host=a.host, log_file=a.log_file,
                       startup_timeout=a.startup_timeout, verbose=a.verbose)

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
    try:
        srv.watch()
        print(examples(srv), flush=True)
        while not stop.wait(0.5):
            failure = srv.failure()
            if failure is not None:
                # A dead engine stub leaves Triton answering "ready" while its requests hang: stop
                # the whole server instead, so clients see their streams end and a supervisor
                # (systemd, Kubernetes) sees the exit and restarts it.
                print(f"error: {failure}; stopping the server (exit code {EXIT_MODEL_FAILED}); "
                      f"log {srv.log_file}:\n{srv.log_tail()}", file=sys.stderr)
                return EXIT_MODEL_FAILED
    finally:
        print("stopping ...", flush=True)
        code = srv.stop()
        print(f"stopped (tritonserver exit code {code})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
