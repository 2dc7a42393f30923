"""Free TCP ports that no other Kiln process on this machine is handed at the same time.

Binding port 0 and closing the socket (the usual trick) races twice: another process asking the
same way may be given the same port before our server binds it (two pytest workers' Triton servers
did: "Socket already in use"), and the kernel hands the ephemeral range to outgoing connections
(the servers' own gRPC clients, gloo's pairs) at any moment. So ports come from below the ephemeral
range, and every hand-out is recorded under a machine-wide file lock: a port handed out in the last
``HOLD_S`` seconds is not handed out again, whichever process asks.
"""
from __future__ import annotations

import fcntl
import json
import os
import random
import socket
import tempfile
import time
from pathlib import Path

LOW, HIGH = 20000, 32000   # below Linux's default ephemeral range (32768-60999)
HOLD_S = 600.0             # long enough for any server to bind what it was given
REGISTRY = Path(tempfile.gettempdir()) / "kiln-ports.json"


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _read(f) -> dict[str, float]:
    f.seek(0)
    try:
        held = json.loads(f.read() or "{}")
    except ValueError:     # a writer killed mid-write: the registry only ever holds hints
        return {}
    return held if isinstance(held, dict) else {}


def free_port(rng: random.Random | None = None) -> int:
    """A port on 127.0.0.1 that is free now and handed to no other caller for ``HOLD_S`` seconds."""
    rng = rng or random.Random()
    fd = os.open(REGISTRY, os.O_RDWR | os.O_CREAT, 0o666)
    with os.fdopen(fd, "r+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)   # released when the file closes
        now = time.time()
        held = {p: t for p, t in _read(f).items() if now - t < HOLD_S}
        for _ in range(HIGH - LOW):
            port = rng.randrange(LOW, HIGH)
            if str(port) not in held and _bindable(port):
                break
        else:
            raise RuntimeError(f"no free port in {LOW}-{HIGH} on 127.0.0.1 ({len(held)} held in {REGISTRY})")
        held[str(port)] = now
        f.seek(0)
        f.truncate()
        f.write(json.dumps(held))
        return port
