"""Reading a model's config.pbtxt parameters inside the Python backend's ``initialize(args)``."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from backend.bundle import MANIFEST

__all__ = ["model_config", "parameter", "engine_dir", "instance_count"]


def model_config(args: dict[str, Any]) -> dict[str, Any]:
    return json.loads(args["model_config"])


def parameter(cfg: dict[str, Any], key: str, default: str | None = None) -> str:
    value = cfg.get("parameters", {}).get(key, {}).get("string_value")
    if value is None or value == "":
        if default is None:
            raise ValueError(f"model '{cfg.get('name')}': config.pbtxt parameter '{key}' is missing")
        return default
    return value


def instance_count(cfg: dict[str, Any]) -> int:
    """Instances of the model (the sum over its instance groups; 1 when it has none)."""
    groups = cfg.get("instance_group") or [{}]
    return sum(int(g.get("count", 1)) for g in groups)


def engine_dir(args: dict[str, Any], cfg: dict[str, Any]) -> str:
    """The bundle path; a relative one is relative to the model repository root, so the build folder
    (engine/ beside model_repository/) can be moved or mounted elsewhere as a whole."""
    value = Path(parameter(cfg, "engine_dir"))
    if not value.is_absolute():
        repo_root = Path(args["model_repository"]).resolve().parent
        value = (repo_root / value).resolve()
    if not (value / MANIFEST).is_file():
        raise FileNotFoundError(f"model '{cfg.get('name')}': engine bundle {value} has no {MANIFEST}; "
                                "rebuild with: make build")
    return str(value)
