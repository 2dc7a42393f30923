"""A build folder as the builder lays it out, without a model: engine/ (engine.json only, no weights)
beside model_repository/ rendered by the package stage's own code. For checks that read the layout
(tp_size, instances, GPUs), never for serving."""
from __future__ import annotations

from pathlib import Path

from backend import bundle
from backend.bundle_schema import ModelConfig
from builder.config import BuildConfig
from builder.stages.package import render_repository, template_values


def fake_build(root: Path, tp_size: int, **serving) -> Path:
    """``root``/model_repository (returned) and ``root``/engine for engine.tp_size and ``serving`` keys."""
    m = bundle.Manifest(
        model=ModelConfig(architecture="llama", hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8,
                          num_kv_heads=8, head_dim=8, vocab_size=128, rms_norm_eps=1e-5, rope_theta=1e4,
                          max_position_embeddings=256),
        quantization=bundle.Quantization("none"), engine=bundle.EngineSettings(tp_size=tp_size))
    (root / "engine").mkdir(parents=True)
    bundle.write(root / "engine", m)
    cfg = BuildConfig.from_dict({"serving": serving, "engine": {"tp_size": tp_size}})
    render_repository(template_values(cfg.serving, "../engine", tp_size=tp_size), root / "model_repository")
    return root / "model_repository"
