"""The engine bundle format (docs/contracts.md section 3): the one module that reads, checks and writes
``engine.json``. Everything else goes through it.

* ``read(path) -> Manifest``: parse ``<path>/engine.json`` and check its format, version and every
  field's presence and type into frozen dataclasses (``Manifest`` and its sections).
* ``verify(path, manifest, hashes=True)``: every file the manifest lists exists (and its sha256 matches).
* ``load_bundle(path, verify_hashes=True) -> Bundle``: both, plus lazy access to the weights.
* ``write(path, manifest)``: write ``engine.json`` atomically (indent 2, no NaN or infinity);
  ``rewrite(path, key, value)`` replaces one section (the pipeline's ``verify`` record).
* ``file_hashes(path)``: the ``files`` section of a bundle folder; ``as_dict(section)``: a section as JSON.

Whatever it refuses is a ``BundleError``: one line naming the file and the field, and what to rebuild.
Engine settings' defaults are stated once (``EngineSettings``) and resolved against the model when
a ``Manifest`` is made. The typed manifest itself (``Manifest``, its sections, the format's constants,
``as_dict``) is ``backend/bundle_schema.py``, re-exported here: import it from this module. The generic
field-by-field checking of JSON against the dataclasses is ``backend/bundle_fields.py``. Imports only the
standard library (safetensors when a tensor is read): it runs inside Triton's Python backend.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from backend.bundle_fields import non_finite as _non_finite
from backend.bundle_schema import (FORMAT, FORMAT_VERSION, MANIFEST, MODEL_KEYS, OMIT, REQUIRED,
                                   SUPPORTED_VERSIONS, WEIGHTS, BundleError, EngineSettings, Kernel, Manifest,
                                   Quantization, Speculative, Targets, TensorRT, Verify, as_dict,
                                   default_kv_cache_dtype, rank_weights, rebuild_hint, version_for)

__all__ = ["FORMAT", "FORMAT_VERSION", "SUPPORTED_VERSIONS", "MANIFEST", "WEIGHTS", "UNLISTED", "MODEL_KEYS",
           "OMIT", "REQUIRED", "rank_weights", "version_for", "BundleError", "Quantization",
           "default_kv_cache_dtype", "EngineSettings", "Targets", "Kernel", "Speculative", "TensorRT", "Verify",
           "Manifest", "as_dict", "rebuild_hint", "sha256_file", "file_hashes", "read", "verify", "write",
           "rewrite", "Bundle", "load_bundle"]

UNLISTED = (MANIFEST, "stage.json")  # the files a manifest's ``files`` never lists


# ---- files ------------------------------------------------------------------------------------

def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, streamed (bundles hold multi-GB weights)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def file_hashes(path: str | Path) -> dict[str, str]:
    """The ``files`` section for the bundle folder ``path``: every file but engine.json and stage.json."""
    root = Path(path)
    return {str(p.relative_to(root)): sha256_file(p) for p in sorted(root.rglob("*"))
            if p.is_file() and p.name not in UNLISTED}


def read(path: str | Path) -> Manifest:
    """The checked manifest of the bundle folder ``path`` (its files are not looked at: see verify)."""
    path = Path(path)
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        what = "does not exist" if not path.exists() else f"is not an engine bundle (no {MANIFEST})"
        raise BundleError(f"{path}: {what}; {rebuild_hint(None)}")

    def no_constant(name: str):
        raise ValueError(f"{name} is not JSON")
    try:
        doc = json.loads(manifest_path.read_text(encoding="utf-8"), parse_constant=no_constant)
    except (ValueError, UnicodeDecodeError) as e:
        raise BundleError(f"{manifest_path}: unreadable, not valid JSON ({e}); {rebuild_hint(None)}") from None
    return Manifest.from_dict(doc, str(manifest_path))


def verify(path: str | Path, manifest: Manifest, hashes: bool = True) -> None:
    """Every file ``manifest`` lists is in the bundle folder ``path`` and, with ``hashes``, unchanged."""
    path = Path(path)
    for weights in manifest.weights:
        if weights not in manifest.files:
            raise BundleError(f"{path / MANIFEST}: files: does not list {weights}; {rebuild_hint(manifest)}")
    for rel, digest in manifest.files.items():
        f = path / rel
        if not f.is_file():
            raise BundleError(f"{f}: missing from the bundle; {rebuild_hint(manifest)}")
        if hashes and sha256_file(f) != digest:
            raise BundleError(f"{f}: changed since the build (sha256 differs from {MANIFEST} files[{rel!r}]); "
                              f"{rebuild_hint(manifest)}")


def write(path: str | Path, manifest: Manifest) -> Path:
    """Write ``<path>/engine.json`` atomically (indent 2, trailing newline); NaN/infinity are refused."""
    target = Path(path) / MANIFEST
    doc = as_dict(manifest)
    bad = _non_finite(doc)
    if bad:
        raise BundleError(f"{target}: {bad}: not a finite number (JSON has no NaN or infinity); "
                          f"fix what produced it, then {rebuild_hint(manifest)}")
    tmp = target.with_name(f"{MANIFEST}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(doc, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    os.replace(tmp, target)
    return target


def rewrite(path: str | Path, key: str, value: Any) -> bool:
    """Replace the top-level ``key`` of ``<path>/engine.json`` with ``value``, atomically. -> changed."""
    manifest = read(path)
    new = manifest.replace(str(Path(path) / MANIFEST), **{key: value})
    if new == manifest:
        return False
    write(path, new)
    return True


# ---- an opened bundle -------------------------------------------------------------------------

@dataclass
class Bundle:
    path: Path
    manifest: Manifest
    _handle: Any = dataclasses.field(default=None, repr=False)

    model = property(lambda self: self.manifest.model)
    engine = property(lambda self: self.manifest.engine)
    quantization = property(lambda self: self.manifest.quantization)
    speculative = property(lambda self: self.manifest.speculative)
    kernels = property(lambda self: self.manifest.kernels)

    @property
    def tokenizer_dir(self) -> Path:
        return self.path / "tokenizer"

    @property
    def weights_path(self) -> Path:
        """The one weights file; a tensor-parallel bundle has one per rank instead (rank_weights_path)."""
        if len(self.manifest.weights) > 1:
            raise BundleError(f"{self.path}: its weights are split into {len(self.manifest.weights)} rank files "
                              f"(engine.tp_size={len(self.manifest.weights)}): read one rank's with "
                              f"rank_weights_path(rank), or the whole model with "
                              f"backend.runtime.tp_shard.load_unsharded")
        return self.path / WEIGHTS

    @property
    def weight_paths(self) -> list[Path]:
        """Every weights file, in rank order (one for a bundle built with tp_size 1)."""
        return [self.path / w for w in self.manifest.weights]

    def rank_weights_path(self, rank: int) -> Path:
        """Rank ``rank``'s weights file (only its share of the sharded tensors)."""
        if not 0 <= rank < len(self.manifest.weights):
            raise BundleError(f"{self.path}: rank {rank}: the bundle has weights for ranks "
                              f"0..{len(self.manifest.weights) - 1}; {rebuild_hint(self.manifest)}")
        return self.path / self.manifest.weights[rank]

    @property
    def draft_dir(self) -> Path | None:
        d = self.path / (self.speculative.draft_dir if self.speculative else "draft")
        return d if d.is_dir() else None

    def _open(self):
        if self._handle is None:
            from safetensors import safe_open
            self._handle = safe_open(str(self.weights_path), "pt")
        return self._handle

    def tensor_names(self) -> list[str]:
        return list(self._open().keys())

    def tensor(self, name: str):
        """One weight tensor, read lazily (mmap) from weights.safetensors."""
        try:
            return self._open().get_tensor(name)
        except Exception as e:  # safetensors raises a bare SafetensorError for a missing name
            raise BundleError(f"{self.weights_path}: no tensor {name!r} ({e}); {rebuild_hint(self.manifest)}") from None

    def tensors(self, prefix: str = "") -> Iterator[tuple[str, Any]]:
        for name in self.tensor_names():
            if name.startswith(prefix):
                yield name, self.tensor(name)


def load_bundle(path: str | Path, verify_hashes: bool = True) -> Bundle:
    """read + verify: the bundle at ``path``, checked before anything runs."""
    path = Path(path)
    manifest = read(path)
    verify(path, manifest, hashes=verify_hashes)
    return Bundle(path=path, manifest=manifest)
