"""Fixtures for the quantization tests.

`quantized_export(fmt)` runs the real `quantize_checkpoint` (real ModelOpt, real SmolLM2 from the
shared `smollm2_hf_dir` fixture in tests/conftest.py) with a small calibration set, and caches the
export under build/test-cache/quant/ keyed by the settings, the source checkpoint and the quant/
sources, so a rerun with nothing changed skips the slow calibration.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import random
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("KILN_TEST_CACHE", REPO / "build" / "test-cache")) / "quant"

# Small calibration: calibration cost is per forward pass (AWQ searches 11 scales per linear per
# pass), and these tests check the export's layout and error bounds, not calibration quality.
EXPORTS = {
    "fp8": {"format": "fp8", "kv_cache": "fp8", "group_size": 64, "exclude": ["lm_head"],
            "calibration": {"dataset": "builtin", "num_samples": 4, "max_seq_len": 64}},
    "nvfp4": {"format": "nvfp4", "kv_cache": "fp8", "group_size": 64, "exclude": ["lm_head"],
              "calibration": {"dataset": "builtin", "num_samples": 4, "max_seq_len": 64}},
    "int4_awq": {"format": "int4_awq", "kv_cache": "fp8", "group_size": 64, "exclude": ["lm_head"],
                 "calibration": {"dataset": "builtin", "num_samples": 2, "max_seq_len": 32}},
}


def _cache_key(settings: dict, hf_dir: Path) -> str:
    h = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    st = (hf_dir / "model.safetensors").stat()
    h.update(f"{hf_dir.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode())
    # the sources that shape an export (formats.py / pack.py only read it)
    for name in ("quantize.py", "recipes.py", "calibration.py", "data/calibration.jsonl"):
        h.update((REPO / "quant" / name).read_bytes())
    return h.hexdigest()[:16]


@pytest.fixture(scope="session")
def quantized_export(smollm2_hf_dir):
    """Factory: quantized_export("fp8") -> (export dir, info dict)."""
    from quant.quantize import INFO_FILE, quantize_checkpoint

    def get(name: str) -> tuple[Path, dict]:
        settings = EXPORTS[name]
        out = CACHE / f"export-{name}-{_cache_key(settings, smollm2_hf_dir)}"
        CACHE.mkdir(parents=True, exist_ok=True)
        # one writer per export: pytest workers (make test runs several) may ask for the same one at once
        with open(CACHE / f".{out.name}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (out / INFO_FILE).is_file():
                quantize_checkpoint(smollm2_hf_dir, out, settings, progress=lambda *a: None)
        return out, json.loads((out / INFO_FILE).read_text())

    return get


@pytest.fixture
def rng() -> "torch.Generator":
    """A generator with a fresh seed each run (printed, so a failure can be replayed)."""
    import torch

    seed = int(os.environ.get("KILN_TEST_SEED", random.SystemRandom().randrange(2**31)))
    print(f"KILN_TEST_SEED={seed}")
    return torch.Generator().manual_seed(seed)
