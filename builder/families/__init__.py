"""The families Kiln knows, one small file each, and the tables that find a checkpoint's family.

``read_spec`` maps a config.json to its family and ``ArchSpec``; a family whose ``runtime`` is False is
mapped (and tested) but refused at build until the runtime reads the spec. A new family is a new file
with a ``FAMILY`` and a row in ``FAMILIES``: nothing else asks which family a checkpoint is.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from backend.arch_spec import ArchSpec
from builder.families import gemma3, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3, qwen3_moe
from builder.families.base import Family
from builder.stages.base import StageError

FAMILIES: tuple[Family, ...] = tuple(m.FAMILY for m in (llama, mistral, qwen2, qwen3, gemma3, phi3, mixtral,
                                                        qwen3_moe, qwen2_moe))
BY_NAME = {f.name: f for f in FAMILIES}
BY_ARCHITECTURE = {cls: f for f in FAMILIES for cls in f.architectures}
BY_MODEL_TYPE = {t: f for f in FAMILIES for t in f.model_types}
BY_GGUF = {a: f for f in FAMILIES for a in f.gguf_architectures}


def runtime_table(by: Mapping[str, Family]) -> dict[str, str]:
    """name -> family name, for the families the runtime runs today (sources.py's SUPPORTED_* tables)."""
    return {key: f.name for key, f in by.items() if f.runtime}


def not_yet(family: Family, where: str) -> StageError:
    running = ", ".join(f.name for f in FAMILIES if f.runtime)
    return StageError(f"{where}: {family.name} is a known family but the runtime does not run it yet; "
                      f"allowed: {running}")


def family_of(hf: Mapping[str, Any], path: Path | str) -> Family:
    """The family of a config.json: its ``architectures`` class names first, then ``model_type``."""
    archs = hf.get("architectures") or []
    found = next((BY_ARCHITECTURE[a] for a in archs if isinstance(a, str) and a in BY_ARCHITECTURE), None) \
        if isinstance(archs, list) else None
    found = found or BY_MODEL_TYPE.get(hf.get("model_type"))
    if found is None:
        raise StageError(f"{path}: architectures: unsupported {archs or 'none given'} (model_type "
                         f"{hf.get('model_type')!r}); allowed: {', '.join(runtime_table(BY_ARCHITECTURE))}")
    return found


def read_spec(hf: Mapping[str, Any], path: Path | str,
              also_understood: frozenset[str] = frozenset()) -> tuple[Family, ArchSpec]:
    """The family and architecture spec of a config.json; StageError (one line) for anything unmappable.
    (It maps the families the runtime does not run yet too: builder/model_spec.py refuses those.)"""
    family = family_of(hf, path)
    return family, family.spec(hf, path, also_understood)
