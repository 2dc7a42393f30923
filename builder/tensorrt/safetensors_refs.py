"""ONNX initializers that point into a safetensors file instead of copying it (ONNX external data).

A safetensors file is an 8-byte little-endian header length, a JSON header giving each tensor's dtype,
shape and ``data_offsets`` (relative to the end of the header), then the raw little-endian bytes. Those
bytes are exactly what ONNX external data holds for the same element type (bf16, fp8 e4m3fn included),
so an initializer is the file's name, an offset and a length: the graph costs no second copy of the
weights. ONNX resolves the location against the graph file's folder and refuses anything outside it
(``..``, symlinks and hard links: onnx's path-traversal checks), which is why the graph lives beside
the weights at the bundle root.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from onnx import TensorProto

# safetensors dtype -> ONNX element type (the ones Kiln bundles hold)
ONNX_TYPES = {"BF16": TensorProto.BFLOAT16, "F16": TensorProto.FLOAT16, "F32": TensorProto.FLOAT,
              "F8_E4M3": TensorProto.FLOAT8E4M3FN, "I8": TensorProto.INT8, "U8": TensorProto.UINT8,
              "I32": TensorProto.INT32, "I64": TensorProto.INT64}


@dataclass(frozen=True)
class TensorRef:
    name: str
    dtype: str           # safetensors dtype
    shape: tuple[int, ...]
    offset: int          # from the start of the file
    length: int


def read_refs(path: Path) -> dict[str, TensorRef]:
    """Every tensor of ``path`` as (dtype, shape, absolute byte range); reads only the header."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    base = 8 + n
    refs = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        start, end = e["data_offsets"]
        refs[name] = TensorRef(name, e["dtype"], tuple(e["shape"]), base + start, end - start)
    return refs


def external_initializer(ref: TensorRef, location: str, name: str | None = None) -> TensorProto:
    """An initializer whose data is ``ref``'s bytes in ``location`` (relative to the graph's folder)."""
    if ref.dtype not in ONNX_TYPES:
        raise ValueError(f"{location}: tensor {ref.name!r} has dtype {ref.dtype}, which the ONNX export does "
                         f"not map; allowed: {', '.join(ONNX_TYPES)}")
    t = TensorProto()
    t.name = name or ref.name
    t.data_type = ONNX_TYPES[ref.dtype]
    t.dims.extend(ref.shape)
    t.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", str(ref.offset)), ("length", str(ref.length))):
        entry = t.external_data.add()
        entry.key, entry.value = key, value
    return t
