"""Open an engine bundle (docs/contracts.md section 3) and check it before anything runs.

``load_bundle(path, verify_hashes=True) -> Bundle``. Refuses an unknown format or version, a missing
file, or a file whose sha256 differs from engine.json, with a ``BundleError`` that says what to
rebuild. Imports only the standard library, torch and safetensors: it runs inside Triton's Python
backend.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any, Iterator

FORMAT = "kiln-engine"
SUPPORTED_VERSIONS = (1,)
WEIGHTS = "weights.safetensors"


class BundleError(RuntimeError):
    """The bundle cannot be used as it is; the message says what to rebuild."""


@dataclasses.dataclass
class Bundle:
    path: Path
    manifest: dict[str, Any]                 # the whole engine.json
    model_config: dict[str, Any]
    engine_config: dict[str, Any]
    quantization: dict[str, Any]
    speculative: dict[str, Any] | None
    kernels: list[dict[str, Any]]
    tokenizer_dir: Path
    _handle: Any = dataclasses.field(default=None, repr=False)

    @property
    def weights_path(self) -> Path:
        return self.path / WEIGHTS

    @property
    def draft_dir(self) -> Path | None:
        d = self.path / "draft"
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


def rebuild_hint(manifest: dict | None) -> str:
    cfg = (manifest or {}).get("config_file")
    target = f"CONFIG={cfg}" if cfg and not str(cfg).startswith("<") else "CONFIG=<its config>"
    return f"rebuild with: make build {target} BUILD_ARGS=--force"


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, streamed (bundles hold multi-GB weights). The builder writes the
    manifest's hashes with this same function, so writer and checker cannot disagree."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def load_bundle(path: str | Path, verify_hashes: bool = True) -> Bundle:
    path = Path(path)
    manifest_path = path / "engine.json"
    if not manifest_path.is_file():
        what = "does not exist" if not path.exists() else "is not an engine bundle (no engine.json)"
        raise BundleError(f"{path}: {what}; {rebuild_hint(None)}")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise BundleError(f"{manifest_path}: unreadable ({e}); {rebuild_hint(None)}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise BundleError(f"{manifest_path}: format {got!r} is not {FORMAT!r}; {rebuild_hint(None)}")
    version = manifest.get("format_version")
    if version not in SUPPORTED_VERSIONS:
        raise BundleError(f"{manifest_path}: format_version {version!r} is not supported by this runtime "
                          f"(supported: {', '.join(map(str, SUPPORTED_VERSIONS))}); {rebuild_hint(manifest)}")
    for key in ("model", "engine", "quantization", "files"):
        if not isinstance(manifest.get(key), dict):
            raise BundleError(f"{manifest_path}: section {key!r} is missing; {rebuild_hint(manifest)}")
    files: dict[str, str] = manifest["files"]
    if WEIGHTS not in files:
        raise BundleError(f"{manifest_path}: files does not list {WEIGHTS}; {rebuild_hint(manifest)}")
    for rel, digest in files.items():
        f = path / rel
        if not f.is_file():
            raise BundleError(f"{f}: missing from the bundle; {rebuild_hint(manifest)}")
        if verify_hashes and sha256_file(f) != digest:
            raise BundleError(f"{f}: changed since the build (sha256 differs from engine.json); "
                              f"{rebuild_hint(manifest)}")
    return Bundle(path=path, manifest=manifest, model_config=manifest["model"], engine_config=manifest["engine"],
                  quantization=manifest["quantization"], speculative=manifest.get("speculative"),
                  kernels=list(manifest.get("kernels") or []), tokenizer_dir=path / "tokenizer")
