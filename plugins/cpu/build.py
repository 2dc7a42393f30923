"""Build and load the CPU kernels (kernels.c, attention.c, gemm.c) with the machine's C compiler: once per source version.

The library is compiled into a cache keyed by a hash of the source and the flags
(``build/cache/cpu-kernels/`` in the checkout, or ``KILN_CPU_KERNEL_DIR``), by ``make build`` (the
builder's compile stage calls ``ensure``) or else by the first process that loads it; compiling
takes well under a second and needs no Python or torch headers. A new file is written under another
name and renamed into place, so processes building at once (test workers, Triton's model stubs)
never load half a file. The loaded library reports the hash it was built from and is refused if it
differs.

Without a C compiler, or with ``KILN_CPU_KERNELS=0``, ``load`` returns None and the callers
(plugins/cpu/ops.py) run the PyTorch references: the same numbers, more dispatched ops.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
# compiled together into one library; the header is part of the source hash too
SOURCES = (HERE / "kernels.c", HERE / "attention.c", HERE / "gemm.c")
HEADERS = (HERE / "kiln_cpu.h",)
# -ffp-contract=off: no multiply-add fused into an FMA (kernels.c gives PyTorch's bits op by op).
# -fopenmp: the threads of gemm.c and attention.c. The library asks for libgomp.so.1, the soname of
# the libgomp PyTorch's wheel ships and has loaded by then (ops.py imports torch first), so the loader
# hands it that one: their parallel regions run on PyTorch's own OpenMP team, not on a second team
# competing for the same cores.
FLAGS = ("-O3", "-std=gnu11", "-ffp-contract=off", "-fno-fast-math", "-fopenmp", "-fPIC", "-shared", "-Wall",
         "-Wno-psabi")
# A compiler without OpenMP (clang without libomp, say) builds the same kernels on one thread: the
# same bits (every output is computed whole by one thread either way), slower.
SERIAL_FLAGS = tuple(f for f in FLAGS if f != "-fopenmp") + ("-Wno-unknown-pragmas",)
ENV_DISABLE = "KILN_CPU_KERNELS"      # "0": never load (the PyTorch references run)
ENV_DIR = "KILN_CPU_KERNEL_DIR"
_REPO_CACHE = Path(__file__).resolve().parents[2] / "build" / "cache" / "cpu-kernels"

log = logging.getLogger("kiln.plugins.cpu")


class CpuKernelBuildError(RuntimeError):
    """No C compiler, or it failed on kernels.c."""


# (argtypes) of each exported function; restype None unless named in RESTYPES
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
SIGNATURES = {
    "kiln_fake_quant_fp8": (_P, _I, _P, _I, _I, _F, _I),
    "kiln_mul_fake_quant_fp8": (_P, _I, _P, _I, _P, _I, _I, _F, _I),
    "kiln_write_kv_fp8": (_P, _I, _P, _I, _P, _P, _P, _I, _I, _F, _F, _I),
    "kiln_rope": (_P, _I, _P, _P, _P, _I, _I, _I, _I),
    "kiln_add_rms_norm": (_P, _I, _P, _I, _P, _P, _P, _I, _I, _F, _I, _F, _I),
    "kiln_paged_attention": (_P, _I, _P, _P, _P, _I, _P, _P, _P, _P, _I, _P, _I, _I, _I, _I, _I, _F, _I),
    "kiln_gemm_available": (),
    "kiln_gemm": (_P, _I, _I, _P, _I, _I, _P, _P, _F, _I),
    "kiln_cpu_threaded": (),
    "kiln_row_threads": (_I, _I, _I),
}
# kiln_paged_attention: the threads it ran on, or -1 (out of memory); kiln_gemm_available: 1 or 0;
# kiln_gemm: 0, or -1
RESTYPES = {"kiln_paged_attention": ctypes.c_int, "kiln_gemm_available": ctypes.c_int, "kiln_gemm": ctypes.c_int,
            "kiln_cpu_threaded": ctypes.c_int,   # 1: built with OpenMP; 0: SERIAL_FLAGS
            "kiln_row_threads": ctypes.c_int}    # the threads kernels.c shares such a call between


def source_hash() -> str:
    h = hashlib.sha256()
    for path in (*SOURCES, *HEADERS):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    h.update(" ".join(FLAGS).encode())
    h.update(platform.machine().encode())
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    if os.environ.get(ENV_DIR):
        return Path(os.environ[ENV_DIR])
    if os.access(_REPO_CACHE.parents[2], os.W_OK):    # a checkout: beside the other build outputs
        return _REPO_CACHE
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kiln" / "cpu-kernels"


def library_path() -> Path:
    return cache_dir() / f"libkiln_cpu-{source_hash()}.so"


def compiler() -> str | None:
    """``CC`` if set, else the first of cc, gcc, clang on PATH."""
    if os.environ.get("CC"):
        return os.environ["CC"]
    return next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)


def ensure() -> Path:
    """The library for the current source, compiled now if the cache lacks it. Raises
    ``CpuKernelBuildError`` (no compiler, or the compiler's own message)."""
    path = library_path()
    if path.exists():
        return path
    cc = compiler()
    if cc is None:
        raise CpuKernelBuildError("no C compiler found (set CC, or install gcc): the CPU path runs the "
                                  "PyTorch references instead, same numbers, slower")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.stem + ".", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        failed = _compile(cc, FLAGS, tmp)
        if failed:
            if _compile(cc, SERIAL_FLAGS, tmp):
                raise CpuKernelBuildError(failed)       # not OpenMP's fault: the first error says why
            log.warning("Kiln CPU kernels built without OpenMP (%s could not link it): the GEMM and the "
                        "attention kernel run on one thread; install the compiler's OpenMP runtime (libgomp, "
                        "libomp) for both cores. First error: %s", cc, failed.splitlines()[-1][:300])
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _compile(cc: str, flags: tuple[str, ...], out: str) -> str | None:
    """Compile the sources with ``flags`` into ``out``: None, or what went wrong."""
    cmd = [cc, *flags, f'-DKILN_SOURCE_HASH="{source_hash()}"', *map(str, SOURCES), "-o", out]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as exc:
        raise CpuKernelBuildError(f"C compiler {cc!r} could not run ({exc}); set CC to a working one") from None
    return None if done.returncode == 0 else f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr.strip()}"


_loaded: list = []   # [library or None] once load() has decided


def load() -> ctypes.CDLL | None:
    """The kernels for this process (built on first use), or None: disabled, no compiler, or a build
    that failed (logged once; the PyTorch references run instead)."""
    if _loaded:
        return _loaded[0]
    lib = None
    if os.environ.get(ENV_DISABLE, "1") != "0":
        try:
            lib = _open(ensure())
        except (CpuKernelBuildError, OSError) as exc:
            log.warning("Kiln CPU kernels not loaded: %s", exc)
    _loaded.append(lib)
    return lib


def _open(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    lib.kiln_cpu_source_hash.restype = ctypes.c_char_p
    built = lib.kiln_cpu_source_hash().decode()
    if built != source_hash():
        raise CpuKernelBuildError(f"{path} was built from source {built}, not {source_hash()}")
    for name, args in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, RESTYPES.get(name)
    return lib
