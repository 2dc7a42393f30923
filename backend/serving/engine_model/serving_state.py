"""Whether the engine model should still serve: its cue to end every in-flight request when the
server is about to stop (or unloads the model). Standard library only (the harness imports it too).

Why the engine must end them itself (Triton 24.10, measured with tests/serving/test_shutdown.py): on
SIGTERM the server marks itself exiting, stops every model's scheduler from taking new requests
(``StopAllModels``) and waits up to ``--exit-timeout-secs`` for in-flight inferences before it
unloads anything. A Python backend model learns nothing until its ``finalize()``, which runs only
once no request holds the model. The clients are still connected, so a 600-token stream outlived
the timeout; the server then gave up ("Exit timeout expired. Exiting immediately."), exited 1 and
crashed on the way out (malloc abort, Signal 6/11) while the stubs still ran.

The signal (``EngineHost._check_serving``): the drain request of
``harness.serving_server.TritonServer.stop`` (a file in the folder named by ``$KILN_DRAIN_DIR``),
BEFORE it sends SIGTERM. Draining first is what makes ``ensemble`` streams end cleanly: once
Triton's ``StopAllModels`` ran, the ensemble's next postprocessing step is refused ("Setting state
from PENDING to FAILED_ENQUEUE" in a verbose log) and Triton 24.10's ensemble then ignores the rest
of its running engine step (``EnsembleContext::PrepareSteps`` skips every later step completion once
its status is an error), so that ensemble request is never released and holds the server for the
whole exit timeout, whatever the engine does after the SIGTERM. Draining first, the engine's final
responses go through the ensemble while its steps are still accepted. The engine acknowledges
(``<pid>.idle``) once it runs nothing, and the harness waits for every engine that registered
(``<pid>.engine``), then signals the server. A deployment without the harness touches the same file
before its SIGTERM (model_repository/README.md "Shutdown").

Not used, on purpose: Triton's readiness (``pb_utils.is_model_ready``) as a second signal for a bare
SIGTERM. Asked while the server is exiting, the call can abort the server (a call still open when
Triton finalizes the model: boost::interprocess::lock_exception, Signal 6) or never return (seen in
a CI run: the poller blocked, the engine never ended its streams and the server hung after its exit
timeout), so the engine makes no IPC call during shutdown at all.
"""
from __future__ import annotations

import os
from pathlib import Path

from backend.logs import get_logger

__all__ = ["DRAIN_DIR_ENV", "DRAIN_REQUEST", "SHUTTING_DOWN", "ServingState", "engine_marker", "idle_marker"]

_LOG = get_logger("serving.state")

DRAIN_DIR_ENV = "KILN_DRAIN_DIR"   # set by harness.serving_server for the server and its stubs
DRAIN_REQUEST = "drain"            # the file whose existence asks the engines to end their requests
SHUTTING_DOWN = "the server is shutting down; retry on a running server"


def engine_marker(drain_dir: str | os.PathLike, pid: int) -> Path:
    """Written by each engine stub at start: the harness waits for its idle marker when draining."""
    return Path(drain_dir) / f"{pid}.engine"


def idle_marker(drain_dir: str | os.PathLike, pid: int) -> Path:
    """Written by an engine stub once it was asked to drain and runs no request any more."""
    return Path(drain_dir) / f"{pid}.idle"


class ServingState:
    """``stopped()`` -> None while the engine should serve, else why not (``SHUTTING_DOWN``)."""

    def __init__(self, model_name: str, drain_dir: str | None = None):
        self.model_name = model_name
        self.drain_dir = drain_dir if drain_dir is not None else (os.environ.get(DRAIN_DIR_ENV) or None)
        self._said: str | None = None
        self._idle_said = False
        if self.drain_dir:
            try:
                engine_marker(self.drain_dir, os.getpid()).touch()
            except OSError as e:  # the harness then does not wait for this engine: SIGTERM alone
                _LOG.warning("cannot register for drains in %s: %s", self.drain_dir, e)
                self.drain_dir = None

    def stopped(self) -> str | None:
        """Final once not None: a drained engine never serves again (the server is about to stop)."""
        if self._said is not None:
            return SHUTTING_DOWN
        if not (self.drain_dir and os.path.exists(os.path.join(self.drain_dir, DRAIN_REQUEST))):
            return None
        self._said = "the harness asked to drain before stopping the server"
        _LOG.warning("model %s stops serving (%s): ending its requests, refusing new ones", self.model_name,
                     self._said)
        return SHUTTING_DOWN

    def idle(self) -> None:
        """Acknowledge a drain: nothing runs here any more (once; the harness removes the folder)."""
        if self.drain_dir and not self._idle_said:
            self._idle_said = True
            try:
                idle_marker(self.drain_dir, os.getpid()).touch()
            except OSError:  # the harness then waits out its drain timeout
                pass
