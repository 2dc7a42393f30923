"""What a Triton model.py needs from inside the Python backend: its config.pbtxt parameters (read in
``initialize(args)``) and, for the engine, how to end its stub when the engine fails."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

from backend.bundle import MANIFEST
from backend.logs import get_logger
from backend.serving.engine_model.placement import Placement, place_instance, visible_gpus
from backend.serving.engine_model.settings import ServingSettings

__all__ = ["model_config", "parameter", "engine_dir", "exit_stub", "instance_count", "instance_placement"]


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
    """Instances of the model (the sum over its instance groups; 1 when it has none). A KIND_GPU
    group starts ``count`` instances on each GPU it lists."""
    groups = cfg.get("instance_group") or [{}]
    return sum(int(g.get("count", 1)) * (len(g.get("gpus") or [0]) if g.get("kind") == "KIND_GPU" else 1)
               for g in groups)


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


def instance_placement(args: dict[str, Any], cfg: dict[str, Any], bundle_dir: str,
                       visible: Callable[[], int] = visible_gpus) -> Placement:
    """This instance's device from Triton's ``model_instance_kind`` / ``model_instance_device_id``
    (a KIND_GPU instance: ``cuda:<its first GPU>``, its GPUs from ``instance_gpus``); raises
    ``PlacementError`` when the host has fewer GPUs than tp_size x instances."""
    from backend.bundle import read
    return place_instance(args.get("model_instance_kind", "CPU"), int(args.get("model_instance_device_id") or 0),
                          ServingSettings.from_parameters(cfg).device, parameter(cfg, "instance_gpus", ""),
                          read(bundle_dir).engine.tp_size, visible)


def exit_stub(reason: str) -> None:
    """``on_fatal`` inside Triton: end this Python backend stub at once (after the final errors went
    out). Triton then reports the model's stub unhealthy, and harness.serve stops the server with
    exit code 3 so that a supervisor restarts it; threads stuck in a device call cannot be joined."""
    get_logger("serving.engine").critical("exiting the engine's stub process: %s", reason)
    os._exit(70)
