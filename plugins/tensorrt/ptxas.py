"""Assemble a plugin's PTX with ptxas for its target SM: TensorRT JIT-compiles the PTX an AOT plugin
returns, so PTX that ptxas rejects (a declaration removed that was still used, a wrong .target) would
fail only on a TensorRT host. Checking here catches it at build time.

The ptxas used is the one Triton ships (CUDA 12.8's for sm_90a, `ptxas-blackwell`, CUDA 13.1's, for
sm_100a and up, as Triton itself picks), so a PTX ISA version Triton emits is one the assembler knows.
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile
from pathlib import Path

from .ptx import ConventionError


class PtxasError(ConventionError):
    """ptxas rejected a plugin's PTX; the message carries ptxas's own."""


def ptxas_path(sm: int) -> str:
    """The ptxas Triton would use for `sm` (TRITON_PTXAS_PATH / TRITON_PTXAS_BLACKWELL_PATH respected)."""
    from triton.backends.nvidia.compiler import get_ptxas   # internal, but what Triton's own compile calls
    return get_ptxas(sm).path


def arch(sm: int) -> str:
    """sm_90a / sm_100a: Triton targets the architecture-specific ISA (wgmma, tcgen05) from 90 on."""
    return f"sm_{sm}a" if sm >= 90 else f"sm_{sm}"


def assemble(ptx: str, sm: int, name: str = "kernel") -> bytes:
    """ptxas `ptx` for `sm` -> the cubin bytes; PtxasError naming `name` with ptxas's message otherwise."""
    target = re.search(r"^\s*\.target\s+(\w+)", ptx, re.M)
    if target is None or target.group(1) != arch(sm):
        raise PtxasError(f"{name}: PTX targets {target.group(1) if target else 'nothing'}, not {arch(sm)}")
    exe = ptxas_path(sm)
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "k.ptx", Path(tmp) / "k.cubin"
        src.write_text(ptx)
        proc = subprocess.run([exe, f"--gpu-name={arch(sm)}", str(src), "-o", str(out)],
                              capture_output=True, text=True, env={**os.environ, "LC_ALL": "C"})
        if proc.returncode:
            msg = " | ".join(line.strip() for line in (proc.stderr or proc.stdout).splitlines()[:4] if line.strip())
            raise PtxasError(f"{name}: ptxas --gpu-name={arch(sm)} failed ({proc.returncode}): {msg}")
        return out.read_bytes()
