"""The ``tensorrt`` build-config section and the combinations it refuses (docs/contracts.md section 1).

``tensorrt.enabled`` adds the TensorRT target to the bundle (builder/tensorrt/): the decoder graph,
the plugin PTX and the optimization profiles, derived from the ``engine`` limits; the plan itself is
built on a TensorRT host (``make engine-plan``) with ``workspace_gib`` and ``timing_cache``. Disabled,
the section is left out of every hash, so a build without it is byte-for-byte what it was before the
section existed.
"""
from __future__ import annotations

import dataclasses

from builder.schema import ConfigError, opt

# what the ONNX export expresses today (builder/tensorrt/onnx_export.py FORMATS: the 4-bit ones through
# the W4A16 GEMM plugin); int8_sq and w4a8_awq need their GEMM plugins in the graph first
TRT_FORMATS = ("none", "fp8", "int4_awq", "nvfp4")
GRAPH_RUNTIMES = ("onnx-reference", "tensorrt")
RUNTIMES = ("native", *GRAPH_RUNTIMES)


@dataclasses.dataclass(frozen=True)
class TensorRTConfig:
    enabled: bool = opt(False)
    # the builder's scratch memory limit for tactic selection (IBuilderConfig memory pool WORKSPACE)
    workspace_gib: float = opt(8.0, min=0.25, max=1024.0)
    # reused across plan builds on one host; null = <bundle>/tensorrt/timing.cache
    timing_cache: str | None = opt(None, allowed="null (the bundle's tensorrt/timing.cache) | a file path")


def check_tensorrt(cfg) -> None:
    """Refuse, with one line, what the TensorRT target or a graph runtime cannot do."""
    t, e, f = cfg.tensorrt, cfg.engine, cfg.file
    if e.runtime in GRAPH_RUNTIMES and not t.enabled:
        raise ConfigError(f, "engine.runtime", f"{e.runtime} runs the bundle's decoder graph, which only "
                          "tensorrt.enabled=true exports", "native, or tensorrt.enabled=true")
    if not t.enabled:
        return
    fmt = cfg.quantization.format
    if fmt not in TRT_FORMATS:
        raise ConfigError(f, "tensorrt.enabled", f"quantization.format={fmt} has no ONNX export yet (its GEMM "
                          "plugin is not in the graph)", f"false, or quantization.format {' | '.join(TRT_FORMATS)}")
    if e.tp_size > 1:
        raise ConfigError(f, "tensorrt.enabled", f"engine.tp_size={e.tp_size}: the graph is exported for one "
                          "device", "false, or engine.tp_size=1")
    # an EAGLE-3 draft is exported as draft.onnx; onnx-reference runs it for chains (its attention node
    # sees every earlier draft row), the TensorRT runner not at all yet (the executor would refuse to start)
    s = cfg.speculative
    if s.method != "none" and e.runtime == "tensorrt":
        raise ConfigError(f, "engine.runtime", f"tensorrt with speculative.method={s.method}: the draft has no "
                          "plan yet", "native or onnx-reference, or speculative.method=none")
    if s.method != "none" and e.runtime == "onnx-reference" and s.tree != "chain":
        raise ConfigError(f, "speculative.tree", f"{s.tree} with engine.runtime=onnx-reference: draft.onnx runs "
                          "chains only", "chain, or engine.runtime=native")
