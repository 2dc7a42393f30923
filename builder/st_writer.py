"""A streaming safetensors writer: tensors are appended one at a time, so packing a 70B checkpoint
never holds more than one layer in memory (``safetensors.torch.save_file`` needs them all at once).

Tensor bytes go to a side file as they arrive; ``close()`` writes the header and appends the data.
The result is an ordinary safetensors file (read back with ``safetensors.safe_open``).
"""
from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import torch

_DTYPES = {
    torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


class SafetensorsWriter:
    def __init__(self, path: Path, metadata: dict[str, str] | None = None):
        self.path = Path(path)
        self._data_path = self.path.with_name(self.path.name + ".data")
        self._data = open(self._data_path, "wb")
        self._header: dict[str, dict] = {}
        self._offset = 0
        self._metadata = metadata or {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        assert name not in self._header, f"duplicate tensor name {name}"
        if tensor.dtype not in _DTYPES:
            raise TypeError(f"{name}: dtype {tensor.dtype} has no safetensors code")
        t = tensor.detach().to("cpu").contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        self._data.write(raw)
        self._header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape),
                              "data_offsets": [self._offset, self._offset + len(raw)]}
        self._offset += len(raw)

    def close(self) -> None:
        self._data.close()
        header = dict(self._header)
        if self._metadata:
            header["__metadata__"] = self._metadata
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # 8-byte alignment of the data section, as safetensors does
        with open(self.path, "wb") as out, open(self._data_path, "rb") as data:
            out.write(struct.pack("<Q", len(blob)))
            out.write(blob)
            shutil.copyfileobj(data, out, 16 << 20)
        os.unlink(self._data_path)

    def abort(self) -> None:
        self._data.close()
        for p in (self._data_path, self.path):
            if p.exists():
                p.unlink()

    def __enter__(self) -> "SafetensorsWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
