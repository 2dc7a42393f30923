"""The ports a served Kiln model listens on: the engine config's ``serving.http_port``,
``serving.grpc_port`` and ``serving.metrics_port``.

``make serve`` / ``python -m harness.serve --config``, ``make mlperf`` and the clients
(``harness.client``, ``harness.openai``) all read them here, so a config that moves the server to other
ports moves its clients with it. Without a config the defaults are the schema's (8000/8001/8002,
Triton's own), taken from ``ServingConfig`` so that there is one source for them.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from builder.config import BuildConfig, ServingConfig


@dataclasses.dataclass(frozen=True)
class Ports:
    http: int
    grpc: int
    metrics: int


_DEFAULT_SERVING = ServingConfig()
DEFAULT = Ports(_DEFAULT_SERVING.http_port, _DEFAULT_SERVING.grpc_port, _DEFAULT_SERVING.metrics_port)


def config_ports(config: str | Path | None, overrides: tuple[str, ...] | list[str] = ()) -> Ports:
    """The serving ports of ``config`` (with ``key=value`` overrides, as ``make build`` takes them);
    the defaults when ``config`` is None. A bad config raises builder's ConfigError (it names the key)."""
    if config is None:
        if overrides:
            raise ValueError(f"overrides {list(overrides)} given without a config: pass --config too")
        return DEFAULT
    s = BuildConfig.from_yaml(config, list(overrides)).serving
    return Ports(s.http_port, s.grpc_port, s.metrics_port)
