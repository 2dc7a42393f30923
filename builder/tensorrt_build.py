"""Build a bundle's TensorRT plan on a host with TensorRT: ``python -m builder.tensorrt_build <bundle>``.

The bundle (``make build ... OVERRIDES="tensorrt.enabled=true"``) holds the decoder graph
(``decoder.onnx``, its weights as external data in ``weights.safetensors``), the plugin PTX and the
optimization profiles. This script checks the bundle (format, every file's sha256), registers the
plugins for this GPU's SM (plugins/tensorrt/register.py), parses the graph into a strongly typed
network (the path given to the parser so external data resolves against the bundle root), adds the
context and generation profiles, builds, writes ``<tensorrt.dir>/engine.plan`` atomically (a temp file
renamed into place: a failure leaves no plan) and records it in engine.json (``tensorrt.plan``,
``tensorrt.version`` = the TensorRT that built it, the files' hashes refreshed).

Exit status: 0 built; 1 TensorRT failed (parse or build; its log says why); 2 refused before
building (bundle, arguments, no TensorRT here). Every refusal is one line on stderr.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

from backend import bundle as B
from backend.runtime.trt_files import (PLAN, PROFILES, Profiles, TensorRTFilesError, TensorRTMissing, import_tensorrt,
                                     load_profiles, register_plugins, section)
from plugins.tensorrt.variants import VariantError


class BuildRefused(ValueError):
    """The build cannot start (exit 2)."""


class BuildFailed(RuntimeError):
    """TensorRT refused the graph or the build (exit 1)."""


def _say(msg: str) -> None:
    print(f"[tensorrt_build] {msg}", file=sys.stderr, flush=True)


def command(bundle: Path) -> str:
    return f"python -m builder.tensorrt_build {bundle}  (make engine-plan OUT={bundle.parent})"


def gpu_sm() -> int | None:
    """This host's GPU as an SM number (90 = H100/H200), or None when no GPU is visible."""
    import torch
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return major * 10 + minor


def resolve_sm(asked: int | None, visible: int | None) -> int:
    """The SM to build for: TensorRT builds a plan for the GPU it runs on, so --sm only names it."""
    if asked is not None and visible is not None and asked != visible:
        raise BuildRefused(f"--sm {asked}, but this host's GPU is sm_{visible}: TensorRT builds a plan for the GPU "
                           f"it runs on; drop --sm or build on an sm_{asked} GPU")
    sm = asked if asked is not None else visible
    if sm is None:
        raise BuildRefused("no CUDA GPU visible and no --sm given: TensorRT builds on the GPU the plan is for")
    return sm


def network_flags(trt) -> int:
    """Strongly typed (TensorRT 10; always so, and the flag ignored, in 11), AOT plugin implementations."""
    flags = 0
    for name in ("STRONGLY_TYPED", "PREFER_AOT_PYTHON_PLUGINS"):
        flag = getattr(trt.NetworkDefinitionCreationFlag, name, None)
        if flag is None and name == "STRONGLY_TYPED" and int(trt.__version__.split(".")[0]) < 11:
            raise BuildRefused(f"TensorRT {trt.__version__} cannot build strongly typed networks; use 10.x or newer")
        if flag is not None:
            flags |= 1 << int(flag)
    return flags


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _check_inputs(network, profiles: Profiles) -> None:
    """Every network input has a profile shape and every profiled input is a network input."""
    names = {network.get_input(i).name for i in range(network.num_inputs)}
    missing = sorted(names - set(profiles.inputs))
    extra = sorted(set(profiles.inputs) - names)
    if missing or extra:
        raise BuildRefused(f"{profiles.path}: inputs do not match the graph's (no shapes for {missing or 'none'}; "
                          f"not graph inputs: {extra or 'none'}); rebuild the bundle: graph and profiles come "
                          f"from one build")


TIMING_CACHE = "timing.cache"


def build_plan(bundle: Path, sm: int | None = None, workspace_gib: float | None = None,
               timing_cache: Path | None = None) -> Path:
    """Build and record ``<bundle>/<tensorrt.dir>/engine.plan``. -> its path. ``workspace_gib`` and
    ``timing_cache`` default to engine.json's tensorrt section (the build config's tensorrt.*; a null
    timing_cache is ``<tensorrt.dir>/timing.cache`` in the bundle, then hashed with the plan)."""
    manifest = B.read(bundle)
    B.verify(bundle, manifest, hashes=True)
    sec = section(manifest, bundle)
    workspace_gib = sec.workspace_gib if workspace_gib is None else workspace_gib
    if timing_cache is None:
        timing_cache = Path(sec.timing_cache) if sec.timing_cache else bundle / sec.dir / TIMING_CACHE
    graph = bundle / sec.graph
    profiles = load_profiles(bundle / sec.dir / PROFILES)
    trt = import_tensorrt(command(bundle))
    sm = resolve_sm(sm, gpu_sm())
    chosen = register_plugins(bundle, manifest, sm, profiles)
    _say(f"TensorRT {trt.__version__}, sm_{sm}; plugins: " + ", ".join(f"{n} ({m['key']})" for n, m in chosen.items()))

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(network_flags(trt))
    parser = trt.OnnxParser(network, logger)
    _say(f"parsing {graph}")
    if not parser.parse(graph.read_bytes(), path=str(graph)):
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
        raise BuildFailed(f"{graph}: TensorRT's ONNX parser failed: {errors[0] if errors else 'no error given'}{more}")
    _check_inputs(network, profiles)

    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gib * (1 << 30)))
    aliased = getattr(getattr(trt, "PreviewFeature", None), "ALIASED_PLUGIN_IO_10_03", None)
    if aliased is not None:   # TensorRT 10.x: in-place plugin outputs (the KV write) are a preview feature
        config.set_preview_feature(aliased, True)
    for i, name in enumerate(profiles.names):
        profile = builder.create_optimization_profile()
        for inp, (lo, opt, hi) in profiles.shapes(i).items():
            profile.set_shape(inp, lo, opt, hi)
        if config.add_optimization_profile(profile) != i:
            raise BuildFailed(f"{profiles.path}: TensorRT refused profile {name!r} (its log says why)")
    old = timing_cache.read_bytes() if timing_cache.is_file() else b""
    _say(f"timing cache {timing_cache} ({len(old)} bytes)")
    config.set_timing_cache(config.create_timing_cache(old), False)

    _say(f"building ({len(profiles.names)} profiles: {', '.join(profiles.names)}); this takes minutes")
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise BuildFailed(f"{graph}: TensorRT built no plan (its log above says why)")
    target = bundle / sec.dir / PLAN
    _atomic_write(target, bytes(plan))
    _atomic_write(timing_cache, bytes(config.get_timing_cache().serialize()))
    try:
        rel = str(target.relative_to(bundle))
        new = manifest.replace(tensorrt=dataclasses.replace(sec, plan=rel, version=trt.__version__))
        B.write(bundle, new.replace(files=B.file_hashes(bundle)))
    except BaseException:
        target.unlink(missing_ok=True)   # a plan engine.json does not list is no plan
        raise
    _say(f"wrote {target} ({target.stat().st_size} bytes); engine.json: tensorrt.plan={rel}")
    return target


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m builder.tensorrt_build",
        description="Build the TensorRT plan of an engine bundle built with OVERRIDES=\"tensorrt.enabled=true\". "
                    "Needs TensorRT (10.x or 11.x, with tensorrt.plugin) and the NVIDIA GPU the plan is for.",
        epilog="On success <bundle>/tensorrt/engine.plan exists and engine.json records it; serve it with "
               "engine.runtime=tensorrt. Exit status: 0 built, 1 TensorRT failed, 2 refused.")
    ap.add_argument("bundle", type=Path, help="the engine bundle folder (build/<stem>/engine)")
    ap.add_argument("--sm", type=int, help="the GPU's SM (90 = H100/H200, 100 = B200); default: the visible GPU's")
    ap.add_argument("--workspace-gib", type=float,
                    help="TensorRT's workspace limit in GiB (default: engine.json tensorrt.workspace_gib)")
    ap.add_argument("--timing-cache", type=Path,
                    help="a timing cache file, read when it exists and written after the build (faster rebuilds); "
                         "default: engine.json tensorrt.timing_cache, or <bundle>/tensorrt/timing.cache")
    a = ap.parse_args(argv)
    if a.workspace_gib is not None and a.workspace_gib <= 0:
        ap.error(f"--workspace-gib: {a.workspace_gib}; allowed: a positive number")
    try:
        build_plan(a.bundle, a.sm, a.workspace_gib, a.timing_cache)
    except TensorRTMissing as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (B.BundleError, TensorRTFilesError, VariantError, BuildRefused) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except BuildFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
