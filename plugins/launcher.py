"""Launch ahead-of-time compiled kernels (the bundle's cubins) through the CUDA driver API.

`KernelSet.from_bundle(bundle_dir, entries, device)` loads the cubins for the device's SM (checking their
sha256), and `KernelSet.launch(key, grid, args)` runs one: grid from the caller's own launch logic
(plugins.common.launch), block = num_warps * 32 threads, the recorded shared memory, and Triton's
trailing scratch pointers (null when their sizes are 0). Serving then does not depend on the Triton
version installed on the GPU machine. Whenever the cubins cannot be used (no driver, another SM, a
driver too old for the cubin and its PTX, an unaligned pointer, an integer compiled as a multiple of 16
that is not one), `launch` returns False and the caller uses Triton JIT; a warning says why, once per
reason.

Every driver call is guarded: importing this module works on a machine without CUDA.
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import warnings
from pathlib import Path

import torch

from .common import AOT_META_VERSION, TORCH_TO_TRITON

try:  # cuda-python >= 12.6 layout; older releases exposed the same API as `cuda.cuda`
    from cuda.bindings import driver as _drv
except ImportError:  # pragma: no cover - depends on the installed cuda-python
    try:
        from cuda import cuda as _drv
    except ImportError:
        _drv = None

_CTYPE = {"i32": ctypes.c_int32, "i64": ctypes.c_int64, "u32": ctypes.c_uint32, "u64": ctypes.c_uint64,
          "fp32": ctypes.c_float, "i1": ctypes.c_int8, "u8": ctypes.c_uint8}
_PTX_OF = {"i32": "u32", "u32": "u32", "i64": "u64", "u64": "u64", "fp32": "f32", "i1": "u8", "u8": "u8"}


_TRITON_NAME = {**TORCH_TO_TRITON, torch.int8: "i8", torch.bool: "i1"}


class LaunchError(RuntimeError):
    pass


def _check(result):
    """cuda-python returns (CUresult, *values): raise on an error, return the values."""
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise LaunchError(f"CUDA driver error {err}")
    return rest[0] if len(rest) == 1 else rest


def pack_params(meta: dict, args: tuple, scratch_ptrs: tuple[int, int] = (0, 0)) -> list:
    """The kernel's parameters as ctypes values, in PTX order: its runtime arguments, then the
    `extra_params` scratch pointers Triton appends. Raises ValueError when an argument does not fit
    (an unaligned or non-CUDA tensor, wrong count)."""
    sig = [t for _, t in meta["signature"] if t != "constexpr"]
    if len(args) != len(sig):
        raise ValueError(f"{meta['key']}: {len(args)} arguments, kernel takes {len(sig)}")
    out = []
    aligned = set(meta.get("aligned", ()))
    divisible = set(meta.get("divisible", ()))
    for name, t, a in zip(meta["params"], sig, args):
        if name in divisible and int(a) % 16:
            raise ValueError(f"{meta['key']}: {name}={int(a)} is not a multiple of 16 (compiled as one)")
        if t.startswith("*"):
            if isinstance(a, torch.Tensor) and _TRITON_NAME.get(a.dtype) != t[1:]:
                raise ValueError(f"{meta['key']}: {name} is {a.dtype}, the cubin was compiled for {t}")
            ptr = a.data_ptr() if isinstance(a, torch.Tensor) else int(a or 0)
            if name in aligned and ptr % meta["aligned_pointers"]:
                raise ValueError(f"{meta['key']}: {name} is not {meta['aligned_pointers']}-byte aligned")
            out.append(ctypes.c_uint64(ptr))
        else:
            out.append(_CTYPE[t](a))
    extra = int(meta.get("extra_params", 0))
    assert extra <= 2, "Triton appends at most the global and profile scratch pointers"
    out.extend(ctypes.c_uint64(p) for p in scratch_ptrs[:extra])
    return out


def ptx_types_of(meta: dict) -> list[str]:
    """The PTX .param types pack_params produces (checked against the compiled PTX in tests)."""
    sig = [t for _, t in meta["signature"] if t != "constexpr"]
    return ["u64" if t.startswith("*") else _PTX_OF[t] for t in sig] + ["u64"] * int(meta.get("extra_params", 0))


class AotKernel:
    """One cubin: loaded into the current CUDA context on first launch."""

    def __init__(self, meta: dict, cubin: bytes, ptx: bytes | None):
        self.meta, self.cubin, self.ptx = meta, cubin, ptx
        self._func = None

    def _load(self, device: torch.device):
        # modules live in a context: use torch's (the device's primary context), making it current in
        # this thread if the runtime API has not done so yet (e.g. the executor's own thread)
        if int(_check(_drv.cuCtxGetCurrent())) == 0:   # a null CUcontext handle is still truthy
            dev = _check(_drv.cuDeviceGet(device.index or 0))
            _check(_drv.cuCtxSetCurrent(_check(_drv.cuDevicePrimaryCtxRetain(dev))))
        image = self.cubin
        try:
            module = _check(_drv.cuModuleLoadData(image))
        except LaunchError:
            if not self.ptx:
                raise
            # a driver that cannot take the cubin may still JIT the PTX (it is NUL-terminated for the driver)
            module = _check(_drv.cuModuleLoadData(self.ptx + b"\0"))
        func = _check(_drv.cuModuleGetFunction(module, self.meta["entry"].encode()))
        if self.meta["shared"] > 48 * 1024:
            attr = _drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            _check(_drv.cuFuncSetAttribute(func, attr, self.meta["shared"]))
        self._func = func

    def launch(self, grid: tuple, args: tuple, device: torch.device) -> None:
        gx, gy, gz = (tuple(grid) + (1, 1))[:3]
        scratch, keep = [0, 0], []
        for i, (size_key, align_key) in enumerate((("global_scratch_size", "global_scratch_align"),
                                                   ("profile_scratch_size", "profile_scratch_align"))):
            size = int(self.meta.get(size_key, 0))
            if size:
                buf = torch.empty(size * gx * gy * gz + int(self.meta.get(align_key, 1)), dtype=torch.uint8, device=device)
                keep.append(buf)
                align = int(self.meta.get(align_key, 1))
                scratch[i] = -(-buf.data_ptr() // align) * align
        params = pack_params(self.meta, args, tuple(scratch))   # validates the call before any driver work
        if self._func is None:
            self._load(device)
        ptrs = (ctypes.c_void_p * len(params))(*[ctypes.addressof(p) for p in params])
        stream = torch.cuda.current_stream(device).cuda_stream
        _check(_drv.cuLaunchKernel(self._func, gx, gy, gz, 32 * self.meta["num_warps"], 1, 1,
                                   self.meta["shared"], _drv.CUstream(stream), ctypes.addressof(ptrs), 0))
        del keep  # the scratch buffers are stream-ordered: freeing after enqueue is safe in torch


class KernelSet:
    """The bundle's AOT kernels for one device, looked up by variant key (plugins.common.variant_key)."""

    def __init__(self, kernels: dict[str, AotKernel], device: torch.device | str = "cuda"):
        self.kernels = kernels
        self.device = torch.device(device)
        self.launched: dict[str, int] = {}     # key -> launches through a cubin (for checks and benches)
        self._warned: set[str] = set()

    def _warn(self, reason: str) -> None:
        if reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(f"AOT kernels: {reason}; using Triton JIT", RuntimeWarning, stacklevel=3)

    @classmethod
    def from_bundle(cls, bundle_dir: str | Path, entries: list[dict], device: torch.device | str = "cuda") -> "KernelSet":
        """Load the entries of engine.json "kernels" for `device`'s SM. Never raises for an unusable
        environment: the set is then empty and every launch falls back to JIT (with a warning)."""
        device = torch.device(device)
        empty = cls({}, device)
        if device.type != "cuda" or not torch.cuda.is_available():
            empty._warn(f"device {device} is not a CUDA GPU")
            return empty
        if _drv is None:
            empty._warn("cuda-python is not installed")
            return empty
        try:
            _check(_drv.cuInit(0))
        except Exception as exc:  # noqa: BLE001 - any driver failure means: no AOT here
            empty._warn(f"CUDA driver unavailable ({exc})")
            return empty
        major, minor = torch.cuda.get_device_capability(device)
        sm = major * 10 + minor
        kernels = {}
        for e in entries:
            if int(e["sm"]) != sm:
                continue
            root = Path(bundle_dir)
            cubin = (root / e["cubin"]).read_bytes()
            if hashlib.sha256(cubin).hexdigest() != e["sha256"]["cubin"]:
                raise LaunchError(f"{root / e['cubin']}: sha256 mismatch; rebuild the engine (make build)")
            meta = json.loads((root / e["meta"]).read_text())
            if meta.get("meta_version") != AOT_META_VERSION:
                ks_reason = f"kernel metadata version {meta.get('meta_version')} (this runtime reads {AOT_META_VERSION})"
                empty._warn(ks_reason + "; rebuild the engine (make build)")
                return empty
            ptx_path = root / e["ptx"]
            kernels[meta["key"]] = AotKernel(meta, cubin, ptx_path.read_bytes() if ptx_path.is_file() else None)
        ks = cls(kernels, device)
        if not kernels:
            ks._warn(f"the bundle has no cubins for sm_{sm} (built for {sorted({e['sm'] for e in entries})})")
        return ks

    def launch(self, key: str, grid: tuple, args: tuple) -> bool:
        """Run variant `key`; False (caller JITs) when this set cannot."""
        k = self.kernels.get(key)
        if k is None:
            if self.kernels:
                self._warn(f"no AOT variant {key}")
            return False
        try:
            k.launch(grid, args, self.device)
        except ValueError as exc:       # this call's arguments (e.g. an unaligned view): JIT just this once
            self._warn(f"{key}: {exc}")
            return False
        except Exception as exc:  # noqa: BLE001 - driver/binding failure: the cubin is unusable here
            self.kernels.pop(key, None)
            self._warn(f"{key}: {type(exc).__name__}: {exc}")
            return False
        self.launched[key] = self.launched.get(key, 0) + 1
        return True
