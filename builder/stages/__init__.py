"""The stage registry: the one table the pipeline walks, in order (interface: ``base.py``).

Every stage is required; its module is imported when the pipeline reaches it (a stage that does not
apply to a config says so through ``skip_reason``).
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class StageSpec:
    name: str
    module: str                     # imported lazily by the pipeline
    dest: str                       # output folder relative to the build root
    sections: tuple[str, ...]       # config sections whose hashes are part of the stage key
    depends: tuple[str, ...]        # earlier stages whose keys are part of the stage key
    engine_json_key: str | None = None  # returned info is recorded under this key of engine.json


STAGES: tuple[StageSpec, ...] = (
    StageSpec("import", "builder.stages.import_", "work/import", ("model",), ()),
    StageSpec("quantize", "builder.stages.quantize", "work/quantize",
              ("model", "quantization"), ("import",)),
    # Only the keys that shape the draft's weights: the tree settings are read at run time (compile
    # writes them into engine.json), so trying another tree does not train the draft again.
    StageSpec("draft", "builder.stages.draft", "work/draft",
              ("model", "speculative.method", "speculative.draft", "speculative.aux_layers", "speculative.train"),
              ("import", "quantize")),
    StageSpec("compile", "builder.stages.compile", "engine",
              ("model", "quantization", "speculative", "engine", "tensorrt"), ("import", "quantize", "draft")),
    StageSpec("verify", "builder.stages.verify", "work/verify",
              ("verify",), ("import", "compile"), engine_json_key="verify"),
    StageSpec("package", "builder.stages.package", "model_repository",
              ("serving", "engine"), ("compile",)),
)

STAGE_NAMES = tuple(s.name for s in STAGES)


def get(name: str) -> StageSpec:
    for spec in STAGES:
        if spec.name == name:
            return spec
    raise KeyError(f"unknown stage {name!r}; stages: {', '.join(STAGE_NAMES)}")
