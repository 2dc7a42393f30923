"""API keys: who may call ``/v1/*``.

Keys come from ``--api-key`` (repeatable), ``--api-key-file`` (one key per line, ``#`` comments) and
the ``KILN_API_KEY`` environment variable (one key, or several separated by commas); any one of them
opens ``/v1/*``. With no key at all the front door is open, as before. ``/health`` and ``/metrics``
stay open either way: load balancers and Prometheus probe them without credentials, and neither
generates anything.

A key is compared with ``hmac.compare_digest`` against EVERY configured key (no early exit), so the
time an answer takes says nothing about how much of a guess was right, nor which key it resembled.
No key is ever printed or logged: the refusal's message does not echo what was sent (OpenAI's own
message quotes part of the key; a log of refusals would then collect guesses and typos of real
keys), and ``harness.openai.process`` hands keys to the child process through its environment, not
its command line (which ``ps`` shows to every user of the machine).
"""
from __future__ import annotations

import hmac
import json
import os
from pathlib import Path
from typing import Iterable

from harness.openai.errors import error_body

__all__ = ["ENV", "load_keys", "KeyCheck", "ApiKeyMiddleware", "PROTECTED_PREFIX"]

ENV = "KILN_API_KEY"
PROTECTED_PREFIX = "/v1/"


def _split_env(value: str | None) -> list[str]:
    return [k.strip() for k in (value or "").split(",") if k.strip()]


def _read_file(path: str | Path) -> list[str]:
    keys = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keys.append(line)
    if not keys:
        raise ValueError(f"{path}: no API key in it (one key per line)")
    return keys


def load_keys(keys: Iterable[str] = (), files: Iterable[str | Path] = (), env: dict | None = None) -> tuple[str, ...]:
    """All configured keys, each once; raises ValueError for an empty key or a file without keys
    (a typo must not silently leave the server open) and OSError for a file that cannot be read."""
    out: list[str] = []
    for k in keys:
        if not k or not k.strip() or k != k.strip():
            raise ValueError("--api-key: a key must be non-empty and have no leading or trailing whitespace")
        out.append(k)
    for f in files:
        out += _read_file(f)
    out += _split_env((os.environ if env is None else env).get(ENV))
    return tuple(dict.fromkeys(out))


class KeyCheck:
    """``check(authorization_header) -> None`` if allowed, else OpenAI's 401 body."""

    def __init__(self, keys: Iterable[str]):
        self._keys = [k.encode("utf-8") for k in keys]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def refusal(self, authorization: str | None) -> dict | None:
        if not self._keys:
            return None
        scheme, _, given = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            return error_body("You didn't provide an API key. You need to provide your API key in an "
                              "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).",
                              "invalid_request_error", None, "invalid_api_key")
        sent = given.strip().encode("utf-8")
        ok = False
        for k in self._keys:  # all of them, always: the timing must not depend on which matched
            ok |= hmac.compare_digest(sent, k)
        if ok:
            return None
        return error_body("Incorrect API key provided.", "invalid_request_error", None, "invalid_api_key")


class ApiKeyMiddleware:
    """Plain ASGI, ahead of routing (an unknown ``/v1`` path is a 401 too: a caller without a key
    learns nothing). Not Starlette's BaseHTTPMiddleware: that one wraps ``receive``, and a
    non-streamed request then no longer sees its client disconnect, so it would not be cancelled."""

    def __init__(self, app, keys: KeyCheck):
        self.app, self.keys = app, keys

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] == "http" and (path.startswith(PROTECTED_PREFIX) or path == PROTECTED_PREFIX.rstrip("/")):
            headers = dict(scope.get("headers") or [])
            auth = headers.get(b"authorization", b"").decode("latin-1")
            refusal = self.keys.refusal(auth)
            if refusal is not None:
                body = json.dumps(refusal).encode()
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(body)).encode()),
                                        (b"www-authenticate", b"Bearer")]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)
