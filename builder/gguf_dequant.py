"""GGUF tensor data -> float32 arrays, through the ``gguf`` package's reference numpy dequantizers.

Every GGML type gguf implements goes through ``gguf.quants.dequantize``: F32, F16, BF16, Q4_0/1,
Q5_0/1, Q8_0, the K-quants (Q2_K..Q6_K), the I-quants, TQ and MXFP4. A type it does not implement
(F64 and the integer types) is refused by name before any tensor is decoded.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from builder.stages.base import StageError

# (name, torch shape (outermost first), ggml type, offset from the data start), as read_header lists them
TensorInfo = tuple[str, list[int], int, int]


def _layout(qtype: int) -> tuple[int, int]:
    import gguf

    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]


def check_tensors(path: Path, infos: list[TensorInfo], data_start: int) -> None:
    """Refuse unknown types, partial blocks and data past the end of the file before decoding any."""
    import gguf

    size = path.stat().st_size
    for name, shape, qtype, offset in infos:
        try:
            kind = gguf.GGMLQuantizationType(qtype)
            block, type_size = _layout(qtype)
        except (ValueError, KeyError):
            raise StageError(f"{path}: tensor {name} has unknown GGML type {qtype}; the file may be "
                             f"corrupted") from None
        if kind not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16) \
                and kind not in gguf.quants._type_traits:
            raise StageError(f"{path}: tensor {name} is stored as {kind.name}, which the gguf package cannot "
                             f"dequantize; allowed: float and quantized GGML types (F32, F16, BF16, Q*_0/1, "
                             f"Q*_K, IQ*)")
        if not shape or shape[-1] % block:
            raise StageError(f"{path}: tensor {name} has shape {shape}, whose rows are not whole "
                             f"{block}-value blocks; the file may be corrupted")
        end = data_start + offset + math.prod(shape) // block * type_size  # Python ints: no wraparound
        if end > size:
            raise StageError(f"{path}: tensor {name} ends at byte {end} but the file has {size}; "
                             f"the file is truncated")


def dequantize(mm: np.ndarray, info: TensorInfo, data_start: int, path: Path) -> np.ndarray:
    """One tensor as a writable float32 array of its torch shape; mm is the whole file as uint8."""
    import gguf

    name, shape, qtype, offset = info
    block, type_size = _layout(qtype)
    start = data_start + offset
    nbytes = math.prod(shape) // block * type_size
    if start + nbytes > mm.size:   # check_tensors ran on the same file; a file that shrank since lands here
        raise StageError(f"{path}: tensor {name} ends at byte {start + nbytes} but the file has {mm.size}; "
                         f"the file is truncated")
    raw = np.asarray(mm[start:start + nbytes]).reshape(-1, shape[-1] // block * type_size)
    values = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(qtype)).reshape(shape)
    return np.array(values, dtype=np.float32)   # a copy: views of the memmap are read-only
