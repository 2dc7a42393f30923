"""Where the engine model's instances run: Triton instance groups for ``serving.device`` and the
GPUs each instance owns (data parallel x tensor parallel on one node). Pure: no torch, no Triton.

Instance ``i`` of ``n`` owns GPUs ``[i*tp, (i+1)*tp)``; its tensor-parallel ranks run on them in
order (rank r on the instance's first GPU + r). Triton starts ``count`` instances on EACH GPU a
group lists, so a group lists only its instance's first GPU; the whole list travels in the
``instance_gpus`` parameter (``"0,1;2,3"``), which the engine model and the serve-time check read.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

__all__ = ["PlacementError", "Placement", "DEVICES", "instance_gpus", "format_gpus", "parse_gpus",
           "instance_groups", "check_visible", "place_instance", "visible_gpus"]


class PlacementError(RuntimeError):
    """The engine's GPUs cannot be had on this host; the message names the numbers and the fix."""


@dataclass(frozen=True)
class Placement:
    device: str                   # what the executor gets: "cpu", "auto", "cuda", "cuda:<first GPU>"
    gpus: tuple[int, ...] = ()    # the instance's GPUs (its tensor-parallel ranks' devices); () = not placed


def instance_gpus(tp_size: int, instances: int) -> list[list[int]]:
    """GPUs of each instance: instance i gets [i*tp_size, (i+1)*tp_size)."""
    return [list(range(i * tp_size, (i + 1) * tp_size)) for i in range(instances)]


def format_gpus(groups: list[list[int]]) -> str:
    return ";".join(",".join(map(str, g)) for g in groups)


def parse_gpus(text: str) -> list[list[int]]:
    """``"0,1;2,3"`` -> [[0, 1], [2, 3]]; "" -> []."""
    try:
        return [[int(x) for x in part.split(",")] for part in text.split(";") if part.strip()]
    except ValueError:
        raise PlacementError(f"instance_gpus parameter {text!r}: allowed: GPU ids, ',' within an instance, "
                             "';' between instances (e.g. 0,1;2,3)") from None


def _cpu_groups(tp_size: int, instances: int) -> str:
    return f"{{ count: {instances} kind: KIND_CPU }}"


def _gpu_groups(tp_size: int, instances: int) -> str:
    lines = [f"  # instance {i}: GPUs {', '.join(map(str, g))} (its first only: Triton starts count instances per "
             f"GPU listed)\n  {{ count: 1 kind: KIND_GPU gpus: [ {g[0]} ] }}"
             for i, g in enumerate(instance_gpus(tp_size, instances))]
    return "\n" + ",\n".join(lines) + "\n"


# serving.device -> (instance groups renderer, whether instances own GPUs). auto cannot know at build
# time whether the serving host has a GPU, and a KIND_GPU group fails to load on a host without one,
# so it keeps KIND_CPU: the engine then takes cuda when one is visible, every instance the same GPU(s).
DEVICES: dict[str, tuple[Callable[[int, int], str], bool]] = {
    "auto": (_cpu_groups, False),
    "cpu": (_cpu_groups, False),
    "cuda": (_gpu_groups, True),
}


def instance_groups(device: str, tp_size: int, instances: int) -> tuple[str, str]:
    """(the body of the engine's ``instance_group [ ... ]``, the ``instance_gpus`` parameter)."""
    render, placed = DEVICES[device]
    return render(tp_size, instances), format_gpus(instance_gpus(tp_size, instances)) if placed else ""


def check_visible(tp_size: int, instances: int, visible: int, highest: int | None = None) -> None:
    """Refuse before any engine loads when the GPUs are not there. ``highest``: the largest GPU id
    the instances use (default tp_size * instances - 1)."""
    need = tp_size * instances
    top = need - 1 if highest is None else highest
    if need > visible or top >= visible:
        raise PlacementError(
            f"engine.tp_size {tp_size} x serving.engine_instances {instances} needs {need} GPUs"
            + (f" (ids up to {top})" if top != need - 1 else "") + f", but {visible} are visible "
            f"(CUDA_VISIBLE_DEVICES={_cuda_visible()}): rebuild with fewer (make build "
            f"OVERRIDES=\"engine.tp_size=... serving.engine_instances=...\", tp x instances <= {visible}) "
            "or serve on a host with more GPUs")


def _cuda_visible() -> str:
    return os.environ.get("CUDA_VISIBLE_DEVICES", "unset")


def place_instance(kind: str, device_id: int, device_param: str, gpus_param: str, tp_size: int,
                   visible: Callable[[], int]) -> Placement:
    """This instance's device, from Triton's ``model_instance_kind`` / ``model_instance_device_id``
    and the rendered parameters; refuses too few visible GPUs (another launcher than ``make serve``
    gets the same refusal here). ``visible`` is called only when GPUs are asked for."""
    groups = parse_gpus(gpus_param)
    if kind == "GPU":
        mine = [g for g in groups if g[0] == device_id]
        if not mine:
            raise PlacementError(f"instance on GPU {device_id}: no instance_gpus entry starts there "
                                 f"(instance_gpus {gpus_param!r}); rebuild the repository with make build")
        if any(len(g) != tp_size for g in groups):
            raise PlacementError(f"instance_gpus {gpus_param!r} was rendered for another tensor-parallel size "
                                 f"than the bundle's engine.tp_size {tp_size}; rebuild with make build")
        check_visible(tp_size, len(groups), visible(), max(max(g) for g in groups))
        return Placement(f"cuda:{device_id}", tuple(mine[0]))
    if device_param == "cuda" or (device_param == "auto" and tp_size > 1 and visible() > 0):
        # KIND_CPU on a GPU (serving.device auto): every instance shares the first tp_size GPUs
        n = visible()
        if tp_size > n:
            raise PlacementError(f"engine.tp_size {tp_size} needs {tp_size} GPUs, but {n} are visible "
                                 f"(CUDA_VISIBLE_DEVICES={_cuda_visible()}): rebuild with engine.tp_size <= {n} "
                                 "or serve on a host with more GPUs")
    return Placement(device_param)


def visible_gpus() -> int:
    """GPUs this process can use (CUDA_VISIBLE_DEVICES applies); 0 without CUDA."""
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0
