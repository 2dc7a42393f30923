"""The serve-time GPU check, before ``tritonserver`` starts (``make serve``, ``make run``/``mlperf``).

A repository built for tp_size x engine_instances GPUs is refused on a host that shows fewer, with
both numbers and what to change, instead of Triton failing to load the model minutes later (or an
engine running out of memory on a GPU another instance holds). The engine model repeats the check in
its ``initialize`` for repositories started by another launcher (backend/serving/engine_model/placement.py).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

from backend import bundle
from backend.serving.engine_model.placement import PlacementError, parse_gpus, place_instance, visible_gpus
from harness.model_names import repository_names

__all__ = ["PlacementError", "engine_parameters", "check_repository_gpus"]

_PARAM = re.compile(r'parameters:\s*\{\s*key:\s*"([^"]+)"\s*value:\s*\{\s*string_value:\s*"([^"]*)"\s*\}\s*\}')


def engine_parameters(repo: str | Path) -> dict[str, str]:
    """The engine model's string parameters from its rendered config.pbtxt ({} when it has none)."""
    cfg = Path(repo) / repository_names(repo).engine / "config.pbtxt"
    return dict(_PARAM.findall(cfg.read_text(encoding="utf-8"))) if cfg.is_file() else {}


def check_repository_gpus(repo: str | Path, visible: Callable[[], int] = visible_gpus) -> None:
    """Raise ``PlacementError`` when the repository's engine needs more GPUs than ``visible()``
    (called only for a layout that asks for GPUs). A repository without a readable bundle is left
    to the server, which names what is missing."""
    repo = Path(repo)
    params = engine_parameters(repo)
    engine_dir = Path(params.get("engine_dir", ""))
    if not engine_dir.is_absolute():
        engine_dir = (repo / engine_dir).resolve()   # relative to the repository root (model_args.engine_dir)
    if not params or not (engine_dir / bundle.MANIFEST).is_file():
        return
    tp_size = bundle.read(engine_dir).engine.tp_size
    groups = parse_gpus(params.get("instance_gpus", ""))
    # one instance stands for all: the check counts every instance's GPUs
    place_instance("GPU" if groups else "CPU", groups[0][0] if groups else 0, params.get("device", "cpu"),
                   params.get("instance_gpus", ""), tp_size, visible)
