"""The samples of one benchmark run: the dataset's, with the reference outputs they are scored against.

Its own module because both the run (``run.py``) and the accuracy check run on its own
(``accuracy.py``) load them, and the run imports the accuracy check.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

from harness.mlperf import settings
from harness.mlperf.datasets import REPO_ROOT, Sample, load_dataset

log = logging.getLogger(__name__)
REFERENCE_FILE = "reference.json"


def engine_config(config: Path, overrides: tuple[str, ...] = ()):
    from builder.config import BuildConfig

    return BuildConfig.from_yaml(config, list(overrides))


def engine_paths(config: Path, output: Path | None, overrides: tuple[str, ...] = ()) -> tuple[Path, str, int]:
    cfg = engine_config(config, overrides)
    return cfg.output_dir(output), cfg.stem, cfg.serving.grpc_port


def reference_path(benchmark: settings.Benchmark, out_dir: Path) -> Path | None:
    """Where the unquantized engine's outputs for `benchmark` are stored (None: dataset has them)."""
    if benchmark.dataset_kind != "mtbench":
        return None
    if benchmark.reference_engine_config:
        ref_out, _, _ = engine_paths(REPO_ROOT / benchmark.reference_engine_config, None)
        return (ref_out if ref_out.is_absolute() else REPO_ROOT / ref_out) / "mlperf" / REFERENCE_FILE
    return out_dir / "mlperf" / REFERENCE_FILE


def load_samples(benchmark: settings.Benchmark, out_dir: Path, dataset_path: Path | None,
                 reference: Path | None = None, trust_pickle: bool = False) -> list[Sample]:
    refs = None
    ref_file = Path(reference) if reference else reference_path(benchmark, out_dir)
    if ref_file is not None and ref_file.is_file():
        data = json.loads(ref_file.read_text())
        if data.get("max_output_tokens") == benchmark.max_output_tokens:
            refs = {int(k): v for k, v in data["outputs"].items()}
        else:
            log.warning("%s was made with max_output_tokens=%s, not %s: ignored", ref_file,
                        data.get("max_output_tokens"), benchmark.max_output_tokens)
    return load_dataset(benchmark.dataset_kind, dataset_path or benchmark.dataset_path,
                        tokenizer_dir=out_dir / "engine" / "tokenizer",
                        cache_dir=REPO_ROOT / "build" / "cache" / "mlperf", references=refs,
                        trust_pickle=trust_pickle)
