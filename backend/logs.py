"""Logging for the runtime and the builder: one logger tree under ``kiln``, request ids in serving lines.

Everything logs through ``logging.getLogger("kiln.<area>")`` (``get_logger``). Where the lines go is
decided once by the process that hosts Kiln, never by library code:

* inside Triton's Python backend, ``route_to_triton(pb_utils)`` sends them to Triton's own logger
  (``pb_utils.Logger``), so they appear in the server log with its timestamps and verbosity;
* the command lines (``python -m builder``, ``python -m backend.generate``) call ``setup_cli``;
* in tests and notebooks nothing is installed and Python's defaults apply (warnings and errors
  reach stderr through ``logging.lastResort``).

``for_request(log, request_id)`` prefixes every line with ``[request <id>]`` so one request's story
can be grepped out of a busy server's log. Standard library only: it runs inside the Triton stub.
"""
from __future__ import annotations

import logging
from typing import Any

ROOT = "kiln"
__all__ = ["ROOT", "get_logger", "for_request", "route_to_triton", "setup_cli"]


def get_logger(area: str) -> logging.Logger:
    """``kiln.<area>``, e.g. ``get_logger("engine.executor")``."""
    return logging.getLogger(f"{ROOT}.{area}")


class _RequestAdapter(logging.LoggerAdapter):
    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        return f"[request {self.extra['request_id']}] {msg}", kwargs


def for_request(log: logging.Logger, request_id: str) -> logging.LoggerAdapter:
    """A logger whose every line names the request: ``[request <id>] ...``."""
    return _RequestAdapter(log, {"request_id": request_id})


class _TritonHandler(logging.Handler):
    """Forwards records to ``pb_utils.Logger`` (Triton >= 23.04); levels map to Triton's four."""

    def __init__(self, pb_logger: Any):
        super().__init__(logging.DEBUG)
        self._log = pb_logger

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = f"{record.name}: {self.format(record)}"
            if record.levelno >= logging.ERROR:
                self._log.log_error(text)
            elif record.levelno >= logging.WARNING:
                self._log.log_warn(text)
            elif record.levelno >= logging.INFO:
                self._log.log_info(text)
            else:
                self._log.log_verbose(text)
        except Exception:  # noqa: BLE001 - logging must never take a request or the model down
            self.handleError(record)


def route_to_triton(pb_utils: Any, level: int = logging.INFO) -> None:
    """Send every ``kiln`` record to Triton's logger. Idempotent: each model of a repository calls it
    from ``initialize`` and they may share one stub process."""
    root = logging.getLogger(ROOT)
    root.setLevel(level)
    root.propagate = False  # Triton's log is the one place; no second copy on the stub's stderr
    if not any(isinstance(h, _TritonHandler) for h in root.handlers):
        root.addHandler(_TritonHandler(pb_utils.Logger))


def setup_cli(verbose: bool = False) -> None:
    """Command lines: ``kiln.*`` warnings (and info with ``verbose``) on stderr, one line each."""
    root = logging.getLogger(ROOT)
    root.setLevel(logging.INFO if verbose else logging.WARNING)
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)
