"""The language model of a multimodal checkpoint, imported as the text-only checkpoint it contains.

Gemma 3 from 4B up is published as ``Gemma3ForConditionalGeneration``: a SigLIP vision tower and a
projector beside a Gemma 3 text decoder whose config is the file's ``text_config`` and whose tensors
carry a prefix (``language_model.model.``, or ``model.language_model.`` as newer transformers save
it). For text generation the decoder is the whole model: with no image in the prompt the vision
tower is never run, and ``Gemma3ForConditionalGeneration``'s logits for a text-only prompt are its
language model's. So the import stage writes the decoder as a ``Gemma3ForCausalLM`` folder (config,
renamed tensors, streamed one at a time, the vision tensors left out), and every later stage, the
verify stage's transformers reference included, reads an ordinary text checkpoint.

One row per multimodal class (``TEXT_PARTS``); a tensor that is neither the decoder's nor a known
vision part is refused by name rather than dropped.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from builder.stages.base import StageError


@dataclass(frozen=True)
class TextPart:
    causal_class: str                     # the text-only class the folder is written as
    model_type: str
    config_key: str                       # where the decoder's config sits in config.json
    renames: tuple[tuple[str, str], ...]  # tensor name prefix -> the causal class's
    dropped: tuple[str, ...]              # tensor name prefixes of the parts text generation never runs
    inherited: tuple[str, ...]            # top-level fields the decoder's config takes when it lacks them


TEXT_PARTS: dict[str, TextPart] = {
    "Gemma3ForConditionalGeneration": TextPart(
        "Gemma3ForCausalLM", "gemma3_text", "text_config",
        (("language_model.model.", "model."), ("model.language_model.", "model."),
         ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head.")),
        ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector."),
        ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings")),
}


def text_part_of(hf: dict) -> TextPart | None:
    """The row for a config.json's ``architectures``, or None for a text-only checkpoint."""
    archs = hf.get("architectures") or []
    return next((TEXT_PARTS[a] for a in archs if isinstance(a, str) and a in TEXT_PARTS), None)


def text_config(hf: dict, part: TextPart, path: Path) -> dict:
    """The decoder's config.json: ``text_config`` as the causal class, top-level token ids inherited."""
    text = hf.get(part.config_key)
    if not isinstance(text, dict):
        raise StageError(f"{path}: {part.config_key}: missing or not an object; a {hf['architectures'][0]} "
                         f"checkpoint must give its language model's config there")
    out = dict(text)
    for field in part.inherited:
        if out.get(field) is None and hf.get(field) is not None:
            out[field] = hf[field]
    out["architectures"] = [part.causal_class]
    out["model_type"] = part.model_type
    return out


def renamed(name: str, part: TextPart, shard: Path) -> str | None:
    """The causal class's name of tensor ``name``; None for a vision part; StageError for anything else."""
    for old, new in part.renames:
        if name.startswith(old):
            return new + name[len(old):]
    if name.startswith(part.dropped):
        return None
    raise StageError(f"{shard}: tensor {name!r} is neither the language model's nor a known vision part; "
                     f"allowed prefixes: {', '.join(o for o, _ in part.renames)} (kept), "
                     f"{', '.join(part.dropped)} (left out)")


def write_text_part(src: Path, out: Path, part: TextPart) -> dict:
    """Write ``src``'s language model into ``out`` (config.json and one safetensors file per source shard
    that holds any of it, with an index when there are several). Returns counts for the stage record."""
    from safetensors import safe_open

    from builder.st_writer import SafetensorsWriter

    hf = json.loads((src / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(text_config(hf, part, src / "config.json"), indent=2) + "\n")
    shards = sorted(src.glob("*.safetensors"))
    kept, left_out, weight_map = 0, 0, {}
    written = []
    for shard in shards:
        with safe_open(str(shard), "pt") as f:
            names = [(n, renamed(n, part, shard)) for n in f.keys()]
            keep = [(n, new) for n, new in names if new is not None]
            left_out += len(names) - len(keep)
            if not keep:
                continue
            dest = out / shard.name
            with SafetensorsWriter(dest, metadata={"format": "pt"}) as w:
                for name, new in keep:
                    w.add(new, f.get_tensor(name))
                    weight_map[new] = shard.name
            kept += len(keep)
            written.append(shard.name)
    if not kept:
        raise StageError(f"{src}: no language-model tensors (prefixes {', '.join(o for o, _ in part.renames)})")
    if len(written) > 1:
        index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return {"text_part_of": hf["architectures"][0], "tensors_kept": kept, "tensors_left_out": left_out}


__all__ = ["TEXT_PARTS", "TextPart", "text_config", "text_part_of", "write_text_part"]
