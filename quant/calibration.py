"""Calibration prompts: the built-in set shipped in quant/data, or a user JSONL file.

Each sample is one text tokenized on its own and truncated to `max_seq_len` tokens; the samples
are then packed (EOS between them) into full rows of `max_seq_len` tokens: no padding, so no
pad-token activations leak into the ranges ModelOpt collects, and few forward passes (AWQ's search
costs 11 fake-quantized GEMMs per linear per pass, so passes, not tokens, dominate on a CPU).
`quant/data/heldout.jsonl` holds prompts that are NOT in the calibration set, for the build's
verify stage (measuring accuracy on the calibration prompts would flatter the quantized model).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DATA_DIR = Path(__file__).resolve().parent / "data"
BUILTIN = DATA_DIR / "calibration.jsonl"
HELDOUT = DATA_DIR / "heldout.jsonl"


class CalibrationDataError(ValueError):
    """A calibration file that cannot be used (one line naming file, line and problem)."""


def read_jsonl_texts(path: str | Path) -> list[str]:
    """The non-empty "text" fields of a JSONL file, in file order.

    Raises CalibrationDataError naming the file and line for a missing file, a line that is not
    JSON, a record without a string "text" field, or a file with no texts at all.
    """
    p = Path(path)
    if not p.is_file():
        raise CalibrationDataError(f"{p}: calibration file not found (quantization.calibration.dataset); "
                                   f"allowed: builtin | path to a JSONL file with a 'text' field")
    texts = []
    with p.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise CalibrationDataError(f"{p}:{lineno}: not valid JSON ({e.msg}); "
                                           f"expected one object per line like {{\"text\": \"...\"}}") from None
            if not isinstance(rec, dict) or "text" not in rec:
                raise CalibrationDataError(f"{p}:{lineno}: record has no \"text\" field; "
                                           f"expected one object per line like {{\"text\": \"...\"}}")
            if not isinstance(rec["text"], str):
                raise CalibrationDataError(f"{p}:{lineno}: \"text\" is {type(rec['text']).__name__}, expected a string")
            if rec["text"].strip():
                texts.append(rec["text"])
    if not texts:
        raise CalibrationDataError(f"{p}: no non-empty \"text\" records; a calibration set needs at least one")
    return texts


def load_texts(dataset: str) -> tuple[Path, list[str]]:
    """(resolved path, texts) for "builtin" or a path to a JSONL file."""
    path = BUILTIN if dataset == "builtin" else Path(dataset).expanduser()
    return path, read_jsonl_texts(path)


def token_upper_bound(dataset: str, num_samples: int, max_seq_len: int) -> int:
    """At most how many tokens the calibration set holds, without a tokenizer: a byte-level BPE token
    covers at least one UTF-8 byte, plus two special tokens, each text truncated to `max_seq_len`.
    num_samples x max_seq_len when the file cannot be read (its stage reports that itself). For
    memory estimates, which must not undercount: the builtin set's texts are short, and the plain
    product counted 524k tokens for a 70B config whose 85 texts tokenize to about 2.3k."""
    try:
        _, texts = load_texts(dataset)
    except (OSError, ValueError):
        return num_samples * max_seq_len
    return sum(min(max_seq_len, len(t.encode("utf-8")) + 2) for t in texts[:num_samples])


def dataset_fingerprint(dataset: str) -> str:
    """sha256 of the calibration file's bytes, for a build stage's cache key (a changed file must
    re-run calibration). Raises CalibrationDataError when the file is missing."""
    path = BUILTIN if dataset == "builtin" else Path(dataset).expanduser()
    if not path.is_file():
        raise CalibrationDataError(f"{path}: calibration file not found (quantization.calibration.dataset); "
                                   f"allowed: builtin | path to a JSONL file with a 'text' field")
    return hashlib.sha256(path.read_bytes()).hexdigest()


def heldout_prompts(n: int | None = None) -> list[str]:
    """Prompts disjoint from the built-in calibration set, for accuracy checks (first `n`)."""
    texts = read_jsonl_texts(HELDOUT)
    return texts if n is None else texts[:n]


@dataclass(frozen=True)
class CalibrationSet:
    """Token-id samples ready for the forward loop, with what went into them."""

    samples: list[Any]  # LongTensor [1, seq] each
    source: str
    sha256: str  # of the texts actually used, so a changed file changes the build hash
    requested: int
    max_seq_len: int
    sep_id: int | None = None  # token between packed samples (the tokenizer's EOS)

    def batches(self, max_batch_tokens: int = 4096) -> list[Any]:
        """LongTensors [B, L] with L = max_seq_len: the samples concatenated (each followed by
        `sep_id` when set) and cut into full rows, B rows per batch with B * L <= max_batch_tokens.

        Packing, as AWQ/GPTQ calibration commonly does, means no padding (pad-token activations
        would widen the ranges) and few forward passes: ModelOpt's cost on a CPU is per pass (AWQ
        fake-quantizes every weight 11 times per pass), not per token. A trailing partial row is
        dropped unless it is the only row."""
        import torch  # noqa: PLC0415

        parts = []
        for s in self.samples:
            parts.append(s.reshape(-1))
            if self.sep_id is not None:
                parts.append(torch.tensor([self.sep_id], dtype=s.dtype))
        stream = torch.cat(parts)
        L = min(self.max_seq_len, stream.numel())
        rows = stream[: stream.numel() // L * L].reshape(-1, L)
        per_batch = max(1, max_batch_tokens // L)
        return [rows[i:i + per_batch] for i in range(0, rows.shape[0], per_batch)]

    def stats(self, batches: list[Any] | None = None) -> dict:
        lens = [int(s.shape[-1]) for s in self.samples]
        st = {"dataset": self.source, "sha256": self.sha256, "num_samples": len(lens),
              "requested_samples": self.requested, "max_seq_len": self.max_seq_len,
              "tokens": sum(lens), "min_len": min(lens), "max_len": max(lens)}
        if batches is not None:
            st.update(num_batches=len(batches), tokens_used=sum(b.numel() for b in batches))
        return st


def build_calibration_set(tokenizer, dataset: str = "builtin", num_samples: int = 32,
                          max_seq_len: int = 256) -> CalibrationSet:
    """Tokenize the first `num_samples` texts (fewer when the file is smaller: the stats say how
    many were used), each truncated to `max_seq_len` tokens."""
    if not isinstance(num_samples, int) or num_samples < 1:
        raise CalibrationDataError(f"quantization.calibration.num_samples: {num_samples!r}; allowed: an integer >= 1")
    if not isinstance(max_seq_len, int) or max_seq_len < 1:
        raise CalibrationDataError(f"quantization.calibration.max_seq_len: {max_seq_len!r}; allowed: an integer >= 1")
    path, texts = load_texts(dataset)
    texts = texts[:num_samples]
    samples = []
    for t in texts:
        ids = tokenizer(t, return_tensors="pt", truncation=True, max_length=max_seq_len)["input_ids"]
        if ids.shape[-1] > 0:
            samples.append(ids)
    digest = hashlib.sha256("\0".join(texts).encode("utf-8")).hexdigest()
    source = "builtin" if path == BUILTIN else str(path)
    return CalibrationSet(samples, source, digest, num_samples, max_seq_len, tokenizer.eos_token_id)
