"""The engine spec: what the runtime reads from a bundle (its checked manifest, engine overrides
applied) and the one error every runtime raises for an unusable bundle or override."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backend.bundle import Bundle, BundleError, EngineSettings, Manifest, load_bundle
from backend.bundle_schema import ModelConfig


class EngineError(ValueError):
    """The engine bundle or an engine override is unusable: one line saying what to fix."""


@dataclass
class EngineSpec:
    """What the runtime reads from a bundle: its checked manifest (engine overrides applied) and path."""
    path: Path
    manifest: Manifest

    @property
    def model(self) -> ModelConfig:
        return self.manifest.model

    @property
    def engine(self) -> EngineSettings:
        return self.manifest.engine

    @property
    def quant_format(self) -> str:
        return self.manifest.quantization.format

    @property
    def kv_cache_dtype(self) -> str:
        return self.engine.kv_cache_dtype


def load_engine_spec(path: str | os.PathLike | Bundle, overrides: dict[str, Any] | None = None,
                     verify_hashes: bool = False) -> EngineSpec:
    """Read ``<path>/engine.json`` through ``backend.bundle`` (format version, fields, files present,
    optionally their sha256) and apply ``engine.*`` overrides by key. A ``Bundle`` already read is
    used as it is (its caller checked it)."""
    try:
        bundle = path if isinstance(path, Bundle) else load_bundle(path, verify_hashes=verify_hashes)
        manifest = bundle.manifest
        if overrides:
            manifest = manifest.replace(engine=manifest.engine.override(**overrides))
    except BundleError as exc:
        raise EngineError(str(exc)) from exc
    return EngineSpec(path=bundle.path, manifest=manifest)


__all__ = ["EngineError", "EngineSpec", "load_engine_spec"]
