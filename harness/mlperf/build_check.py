"""`make run` / `make mlperf` serve the build of the run's config: this checks that the build's
parallel layout (engine.tp_size, serving.engine_instances, serving.device) is the one the config and
its overrides ask for. The output folder is named after the config file alone, so a build made with
`OVERRIDES="engine.tp_size=2"` sits where the plain config's would, and a run would otherwise report
(and lay out for submission) a layout other than the one it measured.
"""
from __future__ import annotations

from pathlib import Path

from backend import bundle
from harness.model_names import repository_names
from harness.serve_gpus import engine_parameters

__all__ = ["LAYOUT_KEYS", "built_layout", "wanted_layout", "check_build_matches"]

# config key -> how the run names it; the keys that decide how many GPUs a run uses and how
LAYOUT_KEYS = ("engine.tp_size", "serving.engine_instances", "serving.device")


def built_layout(out_dir: Path) -> dict[str, object] | None:
    """The layout a build was made with (None while it has no bundle or repository)."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    repo, engine = out_dir / "model_repository", out_dir / "engine"
    cfg = repo / repository_names(repo).engine / "config.pbtxt"
    if not (engine / bundle.MANIFEST).is_file() or not cfg.is_file():
        return None
    pb = text_format.Parse(cfg.read_text(encoding="utf-8"), model_config_pb2.ModelConfig())
    gpu = model_config_pb2.ModelInstanceGroup.KIND_GPU
    instances = sum(g.count * (len(g.gpus) if g.kind == gpu else 1) for g in pb.instance_group) or 1
    return {"engine.tp_size": bundle.read(engine).engine.tp_size, "serving.engine_instances": instances,
            "serving.device": engine_parameters(repo).get("device", "cpu")}


def wanted_layout(cfg) -> dict[str, object]:
    return {"engine.tp_size": cfg.engine.tp_size, "serving.engine_instances": cfg.serving.engine_instances,
            "serving.device": cfg.serving.device}


def check_build_matches(cfg, out_dir: Path, config: Path, overrides: tuple[str, ...] = ()) -> dict | None:
    """The build's layout; RuntimeError naming both layouts and the two ways out when they differ."""
    built = built_layout(out_dir)
    if built is None:
        return None
    want = wanted_layout(cfg)
    if built != want:
        diff = [k for k in LAYOUT_KEYS if built[k] != want[k]]
        # the build's settings: the run's other overrides, with the differing keys set as built
        runs = [o for o in overrides if o.split("=", 1)[0] not in diff] + [f"{k}={built[k]}" for k in diff]
        rebuild = f"make build CONFIG={config}" + (f" OVERRIDES=\"{' '.join(overrides)}\"" if overrides else "")
        raise RuntimeError(
            f"{out_dir} was built with {', '.join(f'{k}={built[k]}' for k in diff)}, but {config} "
            f"(overrides: {' '.join(overrides) or 'none'}) asks for {', '.join(f'{k}={want[k]}' for k in diff)}: "
            f"run with the build's settings (OVERRIDES=\"{' '.join(runs)}\") or rebuild ({rebuild})")
    return built
