"""Start and stop a real Triton Inference Server: the ``TritonServer`` context manager.

Used by ``harness/serve.py`` (``make serve``), the serving tests and the benchmark. It finds
``tritonserver`` on PATH (NVIDIA's container) or else the one in the ``nvidia-pytriton`` wheel,
assembles the Python backend folder as symlinks (copies break the stub's relative library path and
the server then hangs at load), puts this interpreter's ``bin/`` first on PATH (the stub runs the
first ``python3`` it finds, so it must see Kiln and numpy<2), binds 127.0.0.1 on free ports, waits
until ready, and on exit drains the engine (``stop``), stops the whole process group and removes
its shared-memory files. Bound to another ``host`` with an ``api_key``, every protocol but health
needs that key (``harness/triton_auth.py``).
"""
from __future__ import annotations

import dataclasses
import glob
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from harness.ports import free_port
from harness.triton_auth import connect_host, grpc_headers, http_headers, is_loopback, mask, restricted_args
from backend.serving.engine_model.serving_state import DRAIN_DIR_ENV, DRAIN_REQUEST, engine_marker, idle_marker

__all__ = ["TritonServer", "TritonBinary", "find_tritonserver", "free_port", "ServerError", "proc_stat", "stub_processes"]

ROOT = Path(__file__).resolve().parents[1]
STUB_PY = f"{sys.version_info.major}.{sys.version_info.minor}"
DRAIN_TIMEOUT_S = 10.0  # stop(): at most this long for the engines to end their requests
# drain(): after the engines acknowledged, time for the server to hand their last responses to the
# ensemble, whose postprocessing steps are then queued before the SIGTERM (after it they are refused,
# and one refused for a response that was not the last leaves its ensemble request unreleased)
DRAIN_SETTLE_S = 0.5


class ServerError(RuntimeError):
    pass


@dataclasses.dataclass(frozen=True)
class TritonBinary:
    path: Path
    backend_dir: Path | None   # None: the server's own default (NVIDIA container)
    source: str                # "PATH" | "nvidia-pytriton"


def _pytriton_root() -> Path | None:
    import importlib.util
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "tritonserver"


def assemble_backend_dir(tritonserver_root: Path, dest: Path) -> Path:
    """``dest/python/`` with symlinks to the wheel's Python backend and this Python's stub."""
    py = dest / "python"
    py.mkdir(parents=True, exist_ok=True)
    links = {
        "libtriton_python.so": tritonserver_root / "backends/python/libtriton_python.so",
        "triton_python_backend_utils.py": tritonserver_root / "backends/python/triton_python_backend_utils.py",
        "triton_python_backend_stub": tritonserver_root / f"python_backend_stubs/{STUB_PY}/triton_python_backend_stub",
    }
    for name, target in links.items():
        if not target.exists():
            raise ServerError(f"{target}: missing from nvidia-pytriton (Python {STUB_PY} stub needed)")
        link = py / name
        if link.is_symlink() and os.readlink(link) == str(target):
            continue
        # made beside it and renamed over it: servers started at once (pytest workers) never see a
        # missing link, nor fail on one another's
        tmp = py / f".{name}.{os.getpid()}"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(target)
        os.replace(tmp, link)
    return dest


def find_tritonserver(build_dir: Path = ROOT / "build") -> TritonBinary:
    on_path = _which_tritonserver()
    if on_path is not None:
        return TritonBinary(on_path, None, "PATH")
    root = _pytriton_root()
    if root is None or not (root / "bin/tritonserver").is_file():
        raise ServerError("no tritonserver on PATH and nvidia-pytriton is not installed; run: make setup")
    backends = assemble_backend_dir(root, build_dir / "triton-backends")
    return TritonBinary(root / "bin/tritonserver", backends, "nvidia-pytriton")


def _which_tritonserver() -> Path | None:
    import shutil
    found = shutil.which("tritonserver")
    return Path(found) if found else None


def proc_stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (state first, then ppid, ...; utime
    and stime are [11] and [12]), or None when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie has exited)."""
    fields = proc_stat(pid)
    return bool(fields) and fields[0] != "Z"


def stub_processes(server_pid: int) -> dict[int, str]:
    """pid -> model name of a tritonserver's Python backend stubs (one per model instance), from /proc."""
    out: dict[int, str] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        fields = proc_stat(int(pid))
        if not fields or int(fields[1]) != server_pid:
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"triton_python_backend_stub"):
            # the stub's first argument is <repository>/<model>/<version>/model.py
            model = next((Path(a.decode(errors="replace")).parent.parent.name
                          for a in argv[1:] if a.endswith(b"model.py")), "?")
            out[int(pid)] = model
    return out


class TritonServer:
    """``with TritonServer(repo) as srv: srv.http_url, srv.grpc_url, srv.metrics_url``.

    Ports default to free ones. ``model_control="explicit"`` starts with ``load_models`` only.
    ``host`` is the address of all three endpoints; the URLs name 127.0.0.1 for 0.0.0.0. ``api_key``
    restricts every protocol but health to callers sending it (``http_headers``, ``grpc_headers``)
    when ``host`` is not loopback, and does nothing on loopback.
    """

    def __init__(self, model_repository: str | Path, *, http_port: int | None = None,
                 grpc_port: int | None = None, metrics_port: int | None = None, host: str = "127.0.0.1",
                 log_file: str | Path | None = None, model_control: str = "none",
                 load_models: tuple[str, ...] = (), startup_timeout: float = 300.0,
                 exit_timeout: int = 10, verbose: int = 0, extra_args: tuple[str, ...] = (),
                 api_key: str | None = None):
        self.repo = Path(model_repository).resolve()
        if not self.repo.is_dir():
            raise ServerError(f"{self.repo}: model repository not found; build it with: make build")
        self.host = host
        self.api_key = api_key
        self.restricted = bool(api_key) and not is_loopback(host)
        self.ports = {"http": http_port or free_port(), "grpc": grpc_port or free_port(),
                      "metrics": metrics_port or free_port()}
        if len(set(self.ports.values())) != 3:
            raise ServerError(f"ports must differ: {self.ports}")
        self.log_file = Path(log_file) if log_file else ROOT / "build" / "logs" / f"tritonserver-{os.getpid()}-{self.ports['http']}.log"
        self.model_control = model_control
        self.load_models = tuple(load_models)
        self.startup_timeout = startup_timeout
        self.exit_timeout = exit_timeout
        self.verbose = verbose
        self.extra_args = tuple(extra_args)
        # per-server shared-memory prefix: cleanup removes only this server's regions, never another's
        self.shm_prefix = f"kiln_{os.getpid()}_{self.ports['http']}_"
        # stop()'s drain handshake with the engine stubs (backend/serving/engine_model/serving_state.py)
        self.drain_dir = Path(tempfile.gettempdir()) / f"{self.shm_prefix}drain"
        self.proc: subprocess.Popen | None = None
        self.binary: TritonBinary | None = None
        self.abort = threading.Event()  # set (e.g. from a signal handler) to give up waiting for ready

    @property
    def http_url(self) -> str:
        return f"{connect_host(self.host)}:{self.ports['http']}"

    @property
    def grpc_url(self) -> str:
        return f"{connect_host(self.host)}:{self.ports['grpc']}"

    @property
    def metrics_url(self) -> str:
        return f"http://{connect_host(self.host)}:{self.ports['metrics']}/metrics"

    @property
    def http_headers(self) -> dict[str, str]:
        """What an HTTP request must carry ({} when nothing is restricted)."""
        return http_headers(self.api_key) if self.restricted else {}

    @property
    def grpc_headers(self) -> dict[str, str]:
        """What a gRPC call must carry ({} when nothing is restricted)."""
        return grpc_headers(self.api_key) if self.restricted else {}

    def command(self) -> list[str]:
        b = self.binary
        cmd = [str(b.path), f"--model-repository={self.repo}",
               f"--http-address={self.host}", f"--http-port={self.ports['http']}",
               f"--grpc-address={self.host}", f"--grpc-port={self.ports['grpc']}",
               f"--metrics-address={self.host}", f"--metrics-port={self.ports['metrics']}",
               "--allow-gpu-metrics=false", f"--exit-timeout-secs={self.exit_timeout}",
               f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
               f"--log-verbose={self.verbose}", f"--model-control-mode={self.model_control}"]
        if b.backend_dir is not None:
            cmd.append(f"--backend-directory={b.backend_dir}")
        cmd += [f"--load-model={m}" for m in self.load_models]
        if self.restricted:
            cmd += restricted_args(self.api_key)
        return cmd + list(self.extra_args)

    def shown_command(self) -> list[str]:
        """``command()`` with the key masked: the one to print or log."""
        return mask(self.command(), [self.api_key])

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        venv_bin = str(Path(sys.executable).parent)
        env["PATH"] = venv_bin + os.pathsep + env.get("PATH", "")
        env.setdefault("PYTHONUNBUFFERED", "1")
        # each stub would otherwise start one torch thread per core: 2 cores shared by many stubs
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2))))
        env[DRAIN_DIR_ENV] = str(self.drain_dir)  # the stubs inherit it
        # The Python backend stub loads libpython3.X.so.1.0 from the library path: on these machines
        # that is the system's (Debian 3.11.2), older than the venv's interpreter (pyenv 3.11.7), whose
        # stdlib C modules then fail to load in the stub (_ssl: "undefined symbol: _PyModule_Add",
        # imported by xgrammar's dependencies for structured output). The interpreter's own first.
        libdir = sysconfig.get_config_var("LIBDIR")
        lib = f"libpython{sysconfig.get_config_var('LDVERSION')}.so.1.0"
        if libdir and (Path(libdir) / lib).is_file():
            env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (libdir, env.get("LD_LIBRARY_PATH")) if p)
        return env

    # ---- lifecycle -----------------------------------------------------------------------------
    def start(self) -> "TritonServer":
        self.binary = find_tritonserver()
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.drain_dir, ignore_errors=True)
        self.drain_dir.mkdir(parents=True)
        self._log = open(self.log_file, "ab")
        self.proc = subprocess.Popen(self.command(), stdout=self._log, stderr=subprocess.STDOUT,
                                     env=self.env(), start_new_session=True)
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        url = f"http://{self.http_url}/v2/health/ready"
        while time.monotonic() < deadline:
            if self.abort.is_set():
                raise ServerError("interrupted while waiting for the server to become ready")
            if self.proc.poll() is not None:
                raise ServerError(f"tritonserver exited with code {self.proc.returncode} during start-up "
                                  f"({' '.join(self.shown_command())}); log {self.log_file}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.25)
        raise ServerError(f"tritonserver not ready after {self.startup_timeout:.0f} s; log {self.log_file}:\n"
                          f"{self.log_tail()}")

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def drain(self, timeout: float = DRAIN_TIMEOUT_S) -> bool:
        """Ask the engine models to end every in-flight request and refuse new ones, and wait until
        each engine stub runs nothing (or ``timeout``). True when all acknowledged.

        Why before the SIGTERM (Triton 24.10): on SIGTERM Triton first stops every model's
        scheduler, then waits for in-flight requests. An ensemble stream whose engine step is still
        running then has its next postprocessing step refused, after which the ensemble ignores the
        rest of that engine step and never releases the request: the server waits out its exit
        timeout, exits 1 and crashes on the way out. Ending the engine requests first lets every
        ensemble, bls and engine stream end with a final response or error while the server still
        takes the ensemble's steps (backend/serving/engine_model/serving_state.py has the details)."""
        if not self.running():
            return False
        try:
            (self.drain_dir / DRAIN_REQUEST).touch()
        except OSError:
            return False
        deadline = time.monotonic() + timeout
        while True:
            alive = self.stub_pids()  # an engine stub that died or was unloaded has nothing to end
            waiting = [pid for pid in alive if engine_marker(self.drain_dir, pid).exists()
                       and not idle_marker(self.drain_dir, pid).exists()]
            if not waiting:
                break
            if time.monotonic() >= deadline or not self.running():
                return False
            time.sleep(0.05)
        time.sleep(DRAIN_SETTLE_S)
        return True

    def stop(self, grace_s: float | None = None) -> int | None:
        """Drain the engines (``drain``), then SIGTERM the server's process group (server + stubs),
        SIGKILL after the exit timeout, or after ``grace_s``: once a stub has died (``failure``),
        the requests it held never end, so Triton would only wait out its exit timeout for them."""
        if self.proc is None:
            return None
        code = self.proc.poll()
        if code is None:
            self.drain()
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                code = self.proc.wait(timeout=self.exit_timeout + 20 if grace_s is None else grace_s)
            except subprocess.TimeoutExpired:
                code = None
        # stubs left behind (a crashed or hung one) share the group: make sure none survive
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if code is None:
            code = self.proc.wait(timeout=10)
        self._log.close()
        shutil.rmtree(self.drain_dir, ignore_errors=True)
        for f in glob.glob(f"/dev/shm/{self.shm_prefix}*"):
            try:
                os.unlink(f)
            except OSError:
                pass
        self.proc = None
        return code

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    # ---- supervision ---------------------------------------------------------------------------
    def stub_pids(self) -> dict[int, str]:
        return {} if self.proc is None else stub_processes(self.proc.pid)

    def watch(self) -> None:
        """Remember the stubs running now (call once the server is ready); ``failure()`` then
        reports any of them that is gone."""
        self._watched = self.stub_pids()

    def failure(self) -> str | None:
        """Why this server can no longer serve, or None: it exited, or a watched model stub died
        (Triton keeps answering ready, but every request to that model then fails or hangs)."""
        if self.proc is None:
            return "the server is not running"
        # stubs first: a stub's death can take tritonserver down with it (it aborted, exit -6, on a
        # loaded machine) before this poll sees the stub gone; then both are said, the stub first
        watched = getattr(self, "_watched", {})
        # by pid, not by parent: stubs that outlive an aborted server are reparented, not dead
        dead = sorted(f"{model} (pid {pid})" for pid, model in watched.items() if not _running(pid))
        exited = self.proc.poll() is not None
        if dead and not (exited and len(dead) == len(watched)):   # not merely gone with the server
            stub = f"the Python backend stub of model {', '.join(dead)} died"
            return stub + (f"; tritonserver exited with code {self.proc.returncode}" if exited else "")
        if exited:
            return f"tritonserver exited with code {self.proc.returncode}"
        return None
