"""Which Triton model plays which role in a built Kiln repository (serving.model_names).

Defaults are NVIDIA's tensorrtllm_backend names (``builder.config.ModelNamesConfig``); a repository
built with other names is read back from its rendered config.pbtxt files: the ensemble is the model
with ``platform: "ensemble"`` and its steps name preprocessing, the engine and postprocessing in that
order; the bls model is the one whose ``engine_model`` parameter names the engine.
"""
from __future__ import annotations

import re
from pathlib import Path

from builder.config import ModelNamesConfig

__all__ = ["DEFAULT", "repository_names"]

DEFAULT = ModelNamesConfig()
_STEP = re.compile(r'model_name:\s*"([^"]+)"')
_NAME = re.compile(r'^name:\s*"([^"]+)"', re.M)


def repository_names(repo: str | Path) -> ModelNamesConfig:
    """The roles of the models in ``repo``; the defaults when it does not look like a Kiln build."""
    found: dict[str, str] = {}
    for cfg in sorted(Path(repo).glob("*/config.pbtxt")):
        text = cfg.read_text(encoding="utf-8")
        m = _NAME.search(text)
        name = m.group(1) if m else cfg.parent.name
        if re.search(r'platform:\s*"ensemble"', text):
            steps = _STEP.findall(text)
            if len(steps) == 3:
                found.update(ensemble=name, preprocessing=steps[0], engine=steps[1], postprocessing=steps[2])
        elif '"engine_model"' in text:
            found["bls"] = name
    return ModelNamesConfig(**found) if found else DEFAULT
