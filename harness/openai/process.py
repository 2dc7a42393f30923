"""Run the front door as a child process beside a Triton server: ``make serve``, tests, benchmarks.

A process of its own (not a thread of ``harness.serve``): uvicorn wants the main thread and its own
signal handling, and a crash of one must not take the other down silently; ``failure()`` lets the
caller notice and stop both. It gets its own session so that a terminal's Ctrl-C reaches only the
caller, which stops the front door FIRST (its open streams close, which cancels their engine
requests) and then drains Triton.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from harness.openai import auth
from harness.triton_auth import TRITON_KEY_ENV, connect_host

__all__ = ["OpenAIServer"]


class OpenAIServer:
    def __init__(self, model_repository: str | Path, triton_grpc_url: str, metrics_url: str | None,
                 host: str = "127.0.0.1", port: int = 9000, log_file: str | Path | None = None,
                 served_model_name: str | None = None, api_keys: tuple[str, ...] = (),
                 extra_args: tuple[str, ...] = (), triton_api_key: str | None = None):
        self.repo, self.grpc_url, self.metrics_url = Path(model_repository), triton_grpc_url, metrics_url
        self.host, self.port = host, port
        self.log_file = Path(log_file) if log_file else None
        self.served_model_name = served_model_name
        self.api_keys, self.extra_args = tuple(api_keys), tuple(extra_args)
        self.triton_api_key = triton_api_key  # what a restricted Triton wants (harness/triton_auth.py)
        self.proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://{connect_host(self.host)}:{self.port}/v1"

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "harness.openai", "--triton-url", self.grpc_url,
               "--model-repository", str(self.repo), "--host", self.host, "--port", str(self.port)]
        if self.metrics_url:
            cmd += ["--metrics-url", self.metrics_url]
        if self.served_model_name:
            cmd += ["--served-model-name", self.served_model_name]
        return cmd + list(self.extra_args)

    def env(self) -> dict[str, str]:
        root = Path(__file__).resolve().parents[2]  # so "-m harness.openai" resolves from anywhere
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
        # keys through the environment, never the command line (ps shows it to every user)
        env.pop(auth.ENV, None)
        env.pop(TRITON_KEY_ENV, None)
        if self.api_keys:
            env[auth.ENV] = ",".join(self.api_keys)
        if self.triton_api_key:
            env[TRITON_KEY_ENV] = self.triton_api_key
        return env

    def start(self, timeout: float = 60.0) -> "OpenAIServer":
        out = subprocess.DEVNULL
        if self.log_file is not None:
            self.log_file.parent.mkdir(parents=True, exist_ok=True)
            out = open(self.log_file, "ab")
        self.proc = subprocess.Popen(self.command(), stdout=out, stderr=subprocess.STDOUT, env=self.env(),
                                     start_new_session=True)
        if out is not subprocess.DEVNULL:
            out.close()  # the child holds its own copy
        deadline = time.monotonic() + timeout
        headers = {"Authorization": f"Bearer {self.api_keys[0]}"} if self.api_keys else {}
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                self.proc = None
                raise RuntimeError(f"the OpenAI server exited with code {code} while starting "
                                   f"(port {self.port} in use?); log: {self.log_file}")
            try:
                req = urllib.request.Request(f"{self.base_url}/models", headers=headers)
                with urllib.request.urlopen(req, timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the OpenAI server did not answer within {timeout:.0f} s; log: {self.log_file}")

    def failure(self) -> str | None:
        if self.proc is not None and self.proc.poll() is not None:
            return (f"the OpenAI server (pid {self.proc.pid}) exited with code {self.proc.returncode} "
                    f"(its log: {self.log_file})")
        return None

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM (uvicorn closes its connections, which cancels their engine requests), SIGKILL
        after ``timeout``."""
        if self.proc is None:
            return None
        proc, self.proc = self.proc, None
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        return proc.returncode

    def __enter__(self) -> "OpenAIServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
