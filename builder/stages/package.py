"""Package stage: render model_repository/ templates into ``<output>/model_repository``.

Templates are ``<model>/config.pbtxt.tmpl`` with ``${name}`` placeholders plus files copied as they
are (each thin ``1/model.py``). Unlike NVIDIA's fill_template.py, which leaves an unknown
``${...}`` in place for Triton to choke on at load time, rendering here fails at build time on a
placeholder with no value, on a malformed one, and on a value no template uses.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
from pathlib import Path
from typing import Mapping

from backend.serving.conversion.neutral_inputs import ENGINE, TEXT, declarations, ensemble_input_maps
from backend.serving.engine_model.placement import instance_groups
from backend.serving.engine_model.settings import ServingSettings
from builder.stages.base import StageContext, StageError

__all__ = ["TEMPLATE_ROOT", "MODELS", "RenderError", "render_text", "render_repository",
           "template_values", "fingerprint", "run"]

TEMPLATE_ROOT = Path(__file__).resolve().parents[2] / "model_repository"
TEMPLATE_SUFFIX = ".tmpl"
# template folder -> the value naming its rendered folder (serving.model_names.<key>; the engine's
# template folder is "engine", its default Triton name NVIDIA's "tensorrt_llm")
MODELS: dict[str, str] = {
    "preprocessing": "preprocessing_name", "engine": "engine_name", "postprocessing": "postprocessing_name",
    "ensemble": "ensemble_name", "bls": "bls_name",
}
_PLACEHOLDER = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
_MODEL_NAME = re.compile(r"[A-Za-z0-9_.-]+")


class RenderError(StageError):
    """A template problem: one line naming the file, the placeholder and what is known."""


def render_text(text: str, values: Mapping[str, object], source: str = "<template>") -> tuple[str, set[str]]:
    """Fill ``${name}`` placeholders; return the text and the names used."""
    used: set[str] = set()

    def fill(m: re.Match) -> str:
        name = m.group(1)
        if name not in values:
            raise RenderError(f"{source}: unknown placeholder ${{{name}}}; known: {', '.join(sorted(values))}")
        used.add(name)
        return str(values[name])

    out = _PLACEHOLDER.sub(fill, text)
    left = out.find("${")
    if left >= 0:
        line = out.count("\n", 0, left) + 1
        snippet = out[left:left + 24].split("\n")[0]
        raise RenderError(f"{source}: line {line}: unfilled or malformed placeholder {snippet!r}; "
                          "allowed: ${name} with name in [A-Za-z0-9_]")
    return out, used


def render_repository(values: Mapping[str, object], out_dir: Path, template_root: Path = TEMPLATE_ROOT) -> list[str]:
    """Render every model of ``template_root`` into ``out_dir``; return the model names written."""
    names = [str(values[MODELS[m]]) for m in MODELS]
    if len(set(names)) != len(names):
        raise RenderError(f"model names must differ, got {names} (serving.model_names must hold five "
                          "distinct names)")
    for name in names:  # the config refuses these already; a folder must never land outside out_dir
        if not _MODEL_NAME.fullmatch(name) or name in (".", ".."):
            raise RenderError(f"{out_dir}: model name {name!r} is not a plain folder name; "
                              "allowed: letters, digits, '_', '.', '-' (not '.' or '..')")
    # render everything in memory first: a template error leaves nothing half-written
    used: set[str] = set()
    files: list[tuple[Path, str | None, Path]] = []   # (target, rendered text | None = copy, source)
    for model in MODELS:
        src = template_root / model
        if not (src / ("config.pbtxt" + TEMPLATE_SUFFIX)).is_file():
            raise RenderError(f"{src}: config.pbtxt{TEMPLATE_SUFFIX} missing from the templates")
        dest = out_dir / str(values[MODELS[model]])
        files.append((dest / "1", None, src))  # Triton needs a version folder, even an ensemble's
        for path in sorted(src.rglob("*")):
            if path.is_dir() or "__pycache__" in path.parts:
                continue
            rel = str(path.relative_to(src))
            if path.name.endswith(TEMPLATE_SUFFIX):
                text, names_used = render_text(path.read_text(encoding="utf-8"), values, str(path))
                used |= names_used
                files.append((dest / rel[: -len(TEMPLATE_SUFFIX)], text, path))
            else:
                files.append((dest / rel, None, path))
    unused = sorted(set(values) - used - set(MODELS.values()))
    if unused:
        raise RenderError(f"{template_root}: value(s) {', '.join(unused)} are used by no template")
    for target, text, source in files:
        if source.is_dir():
            target.mkdir(parents=True, exist_ok=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        if text is None:
            shutil.copy2(source, target)
        else:
            target.write_text(text, encoding="utf-8")
    return names


def template_values(serving, engine_dir: str, max_batch_size: int = 64, tp_size: int = 1) -> dict[str, object]:
    """The placeholder table, from the config's ``serving`` section (contracts section 1) and the
    engine's ``max_batch_size`` and ``tp_size`` (GPUs per engine instance)."""
    names = serving.model_names
    groups, gpus = instance_groups(serving.device, tp_size, serving.engine_instances)
    return {
        "ensemble_name": names.ensemble,
        "engine_name": names.engine,
        "bls_name": names.bls,
        "preprocessing_name": names.preprocessing,
        "postprocessing_name": names.postprocessing,
        # NVIDIA's decoupled_mode, for the engine and bls models (the ensemble follows the engine)
        "decoupled": "true" if serving.decoupled else "false",
        # NVIDIA's triton_max_batch_size: every model takes [B, ...] tensors as its clients send them
        # (B = 1 per request: backend/serving/conversion/batching.py); the engine's own bound on sequences in flight
        "triton_max_batch_size": max_batch_size,
        "engine_dir": engine_dir,
        # device, stream_interval, step_timeout_s, response_thread, coalesce_responses: the engine
        # model's run-time settings, as its model.py reads them back (backend/serving/engine_model/settings.py)
        **ServingSettings(**{k: getattr(serving, k) for k in ServingSettings.__dataclass_fields__}).parameters(),
        # serving.device cuda: one KIND_GPU group per instance and the GPUs each owns (DP x TP)
        "engine_instance_groups": groups,
        "engine_instance_gpus": gpus,
        "preprocessing_instances": serving.preprocessing_instances,
        "postprocessing_instances": serving.postprocessing_instances,
        # NVIDIA's inputs for features Kiln lacks, declared so that they are checked, not refused
        # unread by Triton (backend/serving/conversion/neutral_inputs.py)
        "neutral_engine_inputs": declarations(ENGINE),
        "neutral_text_inputs": declarations(TEXT),
        "neutral_ensemble_maps": ensemble_input_maps(),
    }


def fingerprint(ctx: StageContext) -> str:
    """Templates are inputs too: editing one re-renders the repository on the next build."""
    h = hashlib.sha256()
    # the neutral-input table renders into the templates (template_values)
    h.update(declarations(ENGINE).encode() + declarations(TEXT).encode() + ensemble_input_maps().encode())
    for path in sorted(TEMPLATE_ROOT.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            h.update(str(path.relative_to(TEMPLATE_ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def run(ctx: StageContext) -> dict:
    compiled = ctx.results.get("compile")
    if compiled is None or compiled.path is None:
        raise StageError("package: no engine bundle (the compile stage did not run)")
    # relative to the repository root so build/<stem>/ can be moved or mounted as a whole
    engine_rel = os.path.relpath(compiled.path.resolve(), (ctx.root / "model_repository").resolve())
    values = template_values(ctx.config.serving, engine_rel, max_batch_size=ctx.config.engine.max_batch_size,
                             tp_size=ctx.config.engine.tp_size)
    models = render_repository(values, ctx.out_dir)
    ctx.log(f"model repository: {', '.join(models)} (serve with: make serve)")
    return {"models": models, "engine_dir": engine_rel, "ensemble": ctx.config.serving.model_names.ensemble,
            "model_names": ctx.config.serving.model_names.as_dict()}
