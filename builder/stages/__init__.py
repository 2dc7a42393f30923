"""The stage registry: the one table the pipeline walks, in order (interface: ``base.py``).

Stages owned by other engineers (draft, verify, package) are imported lazily; while their module
does not exist the pipeline logs "unavailable" and goes on, so the build works end to end today and
picks them up as they land.
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
    optional: bool = False          # a missing module is skipped (owned elsewhere, may not have landed)
    engine_json_key: str | None = None  # returned info is recorded under this key of engine.json


STAGES: tuple[StageSpec, ...] = (
    StageSpec("import", "builder.stages.import_", "work/import", ("model",), ()),
    StageSpec("quantize", "builder.stages.quantize", "work/quantize",
              ("model", "quantization"), ("import",)),
    # Only the keys that shape the draft's weights: the tree settings are read at run time (compile
    # writes them into engine.json), so trying another tree does not train the draft again.
    StageSpec("draft", "builder.stages.draft", "work/draft",
              ("model", "speculative.method", "speculative.draft", "speculative.aux_layers", "speculative.train"),
              ("import", "quantize"), optional=True),
    StageSpec("compile", "builder.stages.compile", "engine",
              ("model", "quantization", "speculative", "engine"), ("import", "quantize", "draft")),
    StageSpec("verify", "builder.stages.verify", "work/verify",
              ("verify",), ("import", "compile"), optional=True, engine_json_key="verify"),
    StageSpec("package", "builder.stages.package", "model_repository",
              ("serving", "engine"), ("compile",), optional=True),
)

STAGE_NAMES = tuple(s.name for s in STAGES)


def get(name: str) -> StageSpec:
    for spec in STAGES:
        if spec.name == name:
            return spec
    raise KeyError(f"unknown stage {name!r}; stages: {', '.join(STAGE_NAMES)}")
