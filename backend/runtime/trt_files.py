"""A bundle's TensorRT target, as the plan builder (builder/tensorrt_build.py) and the plan runner
(backend/runtime/trt_runner.py) both read it: the manifest's ``tensorrt`` section, the optimization
profiles (``<dir>/profiles.json``), what the graph fixes for its plugins, the plugin registration and
the lazy ``import tensorrt`` with the one-line answer when it is missing.

profiles.json (written with the graph, from ``graph_io.profiles()``)::

    {"profiles": [{"name": "context" | "generation", "dims": {dim: [min, opt, max]}}],
     "inputs": {graph input: [dim name or int, ...]}}

Profile i of the plan is profile i of the file (the builder adds them in this order).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from backend.bundle import TensorRT, rebuild_hint
from plugins.common import ACT_TYPES
from plugins.tensorrt.variants import W4A16, GraphConsts

if TYPE_CHECKING:
    from backend.bundle import Manifest

PROFILES = "profiles.json"
PLAN = "engine.plan"
ENABLE = 'OVERRIDES="tensorrt.enabled=true"'
# Where TensorRT can be had: not on this project's own machines (docs/tensorrt.md)
WHERE = ("run it in NVIDIA's TensorRT container (nvcr.io/nvidia/tensorrt:<yy.mm>-py3) or Triton's "
         "(nvcr.io/nvidia/tritonserver:<yy.mm>-py3), or after `pip install tensorrt` from NVIDIA's index "
         "(--extra-index-url https://pypi.nvidia.com), on a host with an NVIDIA GPU")
KV_TRITON = {"fp8_e4m3": "fp8e4nv", "float8_e4m3fn": "fp8e4nv"}


class TensorRTFilesError(ValueError):
    """The bundle's TensorRT files are missing or do not fit; the message names the file and what to do."""


class TensorRTMissing(ImportError):
    """``import tensorrt`` failed; the message says where TensorRT runs."""


def import_tensorrt(command: str):
    """The ``tensorrt`` module, or TensorRTMissing saying where ``command`` can run."""
    try:
        import tensorrt
    except ImportError as exc:
        why = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise TensorRTMissing(f"TensorRT is not installed here ({why}); {WHERE}, then: {command}") from None
    return tensorrt


def section(manifest: "Manifest", bundle: Path) -> TensorRT:
    """The manifest's ``tensorrt`` section, or the one line saying how to get one."""
    if manifest.tensorrt is None:
        cfg = manifest.config_file if manifest.config_file and not manifest.config_file.startswith("<") \
            else "<its config>"
        raise TensorRTFilesError(f"{bundle / 'engine.json'}: no tensorrt section (the bundle was built without "
                                 f"the TensorRT target); rebuild with: make build CONFIG={cfg} {ENABLE}")
    return manifest.tensorrt


@dataclass(frozen=True)
class Profiles:
    """The plan's optimization profiles: their names and dim ranges, and each graph input's dims."""
    path: Path
    names: tuple[str, ...]
    dims: tuple[dict[str, tuple[int, int, int]], ...]
    inputs: dict[str, tuple[str | int, ...]]

    def index(self, name: str) -> int:
        return self.names.index(name)

    def shapes(self, i: int) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
        """input -> (min, opt, max) shapes in profile ``i``."""
        out = {}
        for name, dims in self.inputs.items():
            ranges = [(d, d, d) if isinstance(d, int) else self.dims[i][d] for d in dims]
            out[name] = tuple(tuple(r[k] for r in ranges) for k in range(3))
        return out

    def max_dim(self, dim: str) -> int:
        return max(d[dim][2] for d in self.dims)


def load_profiles(path: str | Path) -> Profiles:
    """Read and check profiles.json (every error names the file and the key)."""
    path = Path(path)
    where = f"{path}"
    if not path.is_file():
        raise TensorRTFilesError(f"{where}: missing; rebuild with {ENABLE}")
    try:
        doc = json.loads(path.read_text())
    except ValueError as exc:
        raise TensorRTFilesError(f"{where}: not JSON ({exc}); rebuild with {ENABLE}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("profiles"), list) or not doc["profiles"] \
            or not isinstance(doc.get("inputs"), dict):
        raise TensorRTFilesError(f"{where}: expected {{\"profiles\": [...], \"inputs\": {{...}}}}; "
                                 f"rebuild with {ENABLE}")
    names, dims = [], []
    for i, p in enumerate(doc["profiles"]):
        if not isinstance(p, dict) or not isinstance(p.get("name"), str) or not isinstance(p.get("dims"), dict):
            raise TensorRTFilesError(f"{where}: profiles[{i}]: expected {{\"name\": str, \"dims\": {{...}}}}")
        ranges = {}
        for d, r in p["dims"].items():
            ok = isinstance(r, list) and len(r) == 3 and all(isinstance(x, int) and not isinstance(x, bool) for x in r)
            if not ok or not 0 <= r[0] <= r[1] <= r[2]:
                raise TensorRTFilesError(f"{where}: profiles[{i}].dims.{d}: {r!r}; expected [min, opt, max] ints, "
                                         f"0 <= min <= opt <= max")
            ranges[d] = (r[0], r[1], r[2])
        names.append(p["name"])
        dims.append(ranges)
    inputs = {}
    for name, ds in doc["inputs"].items():
        if not isinstance(ds, list):
            raise TensorRTFilesError(f"{where}: inputs.{name}: {ds!r}; expected a list of dim names or ints")
        for d in ds:
            if not isinstance(d, int) and not all(isinstance(d, str) and d in r for r in dims):
                raise TensorRTFilesError(f"{where}: inputs.{name}: dim {d!r} is neither an int nor a dim of every "
                                         f"profile")
        inputs[name] = tuple(ds)
    return Profiles(path, tuple(names), tuple(dims), inputs)


def graph_consts(manifest: "Manifest", profiles: Profiles) -> GraphConsts:
    """What the bundle's decoder graph fixes for its plugin nodes."""
    m, e = manifest.model, manifest.engine
    act = ACT_TYPES.get(m.dtype)
    if act is None:
        raise TensorRTFilesError(f"engine.json: model.dtype {m.dtype!r} has no TensorRT plugin variants "
                                 f"(allowed: {', '.join(ACT_TYPES)}); {rebuild_hint(manifest)}")
    kv = KV_TRITON.get(e.kv_cache_dtype, ACT_TYPES.get(e.kv_cache_dtype))
    if kv not in (act, "fp8e4nv"):
        raise TensorRTFilesError(f"engine.json: engine.kv_cache_dtype {e.kv_cache_dtype!r}: the plugins take a KV "
                                 f"pool of the model dtype or fp8_e4m3; {rebuild_hint(manifest)}")
    tree = "tree" in profiles.dims[0] and profiles.max_dim("tree") > 0
    q = manifest.quantization   # a 4-bit bundle's packed linears are kiln_w4a16_gemm nodes
    return GraphConsts(num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
                       block_size=e.kv_block_size, act=act, kv=kv, tree=tree,
                       w4a16=q.format if q.format in W4A16 else None, group_size=q.group_size)


def register_plugins(bundle: Path, manifest: "Manifest", sm: int, profiles: Profiles) -> dict[str, dict]:
    """Register the bundle's plugins with TensorRT for an sm_``sm`` GPU (tensorrt must import)."""
    from plugins.tensorrt.register import register
    sec = section(manifest, bundle)
    if sec.sms and sm not in sec.sms:
        raise TensorRTFilesError(f"{bundle / 'engine.json'}: tensorrt.sms is {list(sec.sms)}, not sm_{sm}; rebuild "
                                 f"with {ENABLE} and engine.target_sms including {sm}")
    return register(bundle / sec.dir / "plugins", sm, list(sec.plugins), graph_consts(manifest, profiles))
