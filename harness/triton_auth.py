"""Triton's own endpoints and API keys: where they listen, and what a caller must then send.

Triton's HTTP, gRPC and metrics endpoints listen on 127.0.0.1 unless ``harness.serve --triton-host``
(``make serve TRITON_HOST=...``) names another address. Bound to any other address while API keys
are configured, ``tritonserver`` starts with its restricted-API options, so that every protocol but
``health`` (``RESTRICTED_APIS``: inference, model control and the rest) needs the key:

    HTTP   Authorization: Bearer KEY                         (the OpenAI API's header)
    gRPC   triton-grpc-protocol-authorization: Bearer KEY    (metadata)

Triton compares the header's value exactly and its name case-insensitively over HTTP; over gRPC it
prefixes every restricted protocol's header name with ``triton-grpc-protocol-`` (metadata names are
lower case). Health stays open because load balancers and Kubernetes probe it without credentials and
it answers nothing but "up" or "ready". Metrics cannot be restricted (Triton has no option for them):
they follow ``--triton-host`` and stay open, read-only. Triton holds one value per protocol group, so
with several keys the FIRST one opens Triton (every key opens the OpenAI API). Bound to loopback,
nothing is restricted: local clients and NVIDIA's scripts work unchanged.

Triton reads these options from its command line only, so local users of the machine can read the
key in ``/proc/<pid>/cmdline`` (``ps``) while it runs. Kiln never prints it: ``mask`` hides it in
any command line Kiln shows.
"""
from __future__ import annotations

import ipaddress
from typing import Iterable

from harness.openai.auth import load_keys

__all__ = ["HTTP_HEADER", "GRPC_HEADER", "RESTRICTED_APIS", "OPEN_APIS", "TRITON_KEY_ENV", "is_loopback",
           "connect_host", "restricted_args", "http_headers", "grpc_headers", "client_key", "mask",
           "open_warning"]

HTTP_HEADER = "authorization"
GRPC_PREFIX = "triton-grpc-protocol-"   # what Triton puts before a gRPC restriction's header name
GRPC_HEADER = GRPC_PREFIX + HTTP_HEADER
OPEN_APIS = ("health",)
RESTRICTED_APIS = ("metadata", "inference", "shared-memory", "model-config", "model-repository", "statistics",
                   "trace", "logging")
# harness.openai's key for a restricted Triton, handed over in its environment (never its command line)
TRITON_KEY_ENV = "KILN_TRITON_API_KEY"
MASKED = "***"


def _address(host: str) -> str:
    h = host.strip()
    if h.lower().startswith("ipv6:"):   # Triton's spelling of an IPv6 address: ipv6:[::1]
        h = h[5:]
    return h.strip("[]")


def is_loopback(host: str) -> bool:
    """Whether ``host`` reaches this machine only (127.0.0.0/8, ::1, localhost). Any other name
    counts as reachable from elsewhere."""
    h = _address(host)
    if h.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def connect_host(host: str) -> str:
    """The address a client on this machine uses for a server bound to ``host``: 127.0.0.1 for the
    IPv4 wildcard 0.0.0.0 (every interface), else ``host`` itself."""
    return "127.0.0.1" if _address(host) == "0.0.0.0" else host


def restricted_args(key: str) -> list[str]:
    """tritonserver's options that make every protocol but health need ``Authorization: Bearer key``
    (its syntax: ``<api>[,<api>...]:<header>=<value>``; the value is everything after the ``=``)."""
    apis = ",".join(RESTRICTED_APIS)
    return [f"--http-restricted-api={apis}:{HTTP_HEADER}=Bearer {key}",
            f"--grpc-restricted-protocol={apis}:{HTTP_HEADER}=Bearer {key}"]


def http_headers(key: str | None) -> dict[str, str]:
    """The header a restricted Triton's HTTP endpoint wants (``headers=`` of tritonclient.http, requests)."""
    return {"Authorization": f"Bearer {key}"} if key else {}


def grpc_headers(key: str | None) -> dict[str, str]:
    """The metadata a restricted Triton's gRPC endpoint wants (``headers=`` of tritonclient.grpc calls)."""
    return {GRPC_HEADER: f"Bearer {key}"} if key else {}


def client_key(keys: Iterable[str] = (), files: Iterable[str] = (), env: dict | None = None) -> str | None:
    """A client's key: the first of ``--api-key``, ``--api-key-file`` and ``KILN_API_KEY`` (the one
    Triton holds when the server was given the same keys), None when there is none."""
    found = load_keys(keys, files, env)
    return found[0] if found else None


def mask(argv: Iterable[str], secrets: Iterable[str | None]) -> list[str]:
    """``argv`` with every secret replaced by ``***``: a command line fit to print or log."""
    out = list(argv)
    for s in filter(None, secrets):
        out = [a.replace(s, MASKED) for a in out]
    return out


def open_warning(host: str) -> str:
    return (f"warning: Triton's HTTP, gRPC and metrics endpoints listen on {host} with no API key: anyone who "
            "can reach it can run inference and use Triton's other protocols (model repository, statistics, trace "
            "and log settings). Set a key "
            "(make serve API_KEY=..., KILN_API_KEY or --api-key-file) or keep the default --triton-host 127.0.0.1.")
