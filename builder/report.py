"""What the CLI shows: progress on long work, and the end-of-build summary (bundle location,
contents with sizes and formats, per-stage timing)."""
from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from backend.bundle import MANIFEST, as_dict, read as read_manifest
from builder.stages.base import StageResult


def progress_factory(console: Console):
    """ctx.progress(description, total) backed by rich: a bar when total is known, else a spinner."""
    @contextmanager
    def factory(description: str, total: int | None) -> Iterator:
        columns = [SpinnerColumn(), TextColumn("{task.description}", markup=False), BarColumn(), TimeElapsedColumn()]
        with Progress(*columns, console=console, transient=True) as bar:
            task = bar.add_task(description, total=total)
            t0 = time.perf_counter()
            yield lambda n=1: bar.advance(task, n)
        console.print(f"  {description}: {time.perf_counter() - t0:.1f} s")
    return factory


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def stage_line(result: StageResult) -> str:
    if result.status == "built":
        return f"[{result.name}] built in {result.seconds:.1f} s"
    if result.status == "cached":
        return f"[{result.name}] up to date (cached)"
    return f"[{result.name}] {result.status}: {result.reason}"


def _tensor_formats(weights: Path) -> str:
    from safetensors import safe_open

    counts: dict[str, int] = {}
    with safe_open(str(weights), "pt") as f:
        for name in f.keys():
            if name.endswith(".weight"):
                dt = str(f.get_slice(name).get_dtype())
                counts[dt] = counts.get(dt, 0) + 1
    return ", ".join(f"{n} x {dt}" for dt, n in sorted(counts.items()))


_KV_BYTES = {"fp8_e4m3": 1, "bfloat16": 2, "float16": 2, "float32": 4}


def rank_memory_line(engine, root: Path) -> str:
    """What each rank holds: its weights file and its KV cache per token (KV heads / tp_size, or one
    replicated when there are fewer). The KV pool's size is decided at load from the device's free
    memory, so per token is what the build knows."""
    from backend.runtime.tp_rules import kv_heads_per_rank  # noqa: PLC0415
    m, tp = engine.model, engine.engine.tp_size
    sizes = [(root / w).stat().st_size for w in engine.weights]
    heads = kv_heads_per_rank(m.num_kv_heads, tp)
    kv = m.num_layers * 2 * heads * m.head_dim * _KV_BYTES.get(engine.engine.kv_cache_dtype, 2)
    if len(sizes) == 1:
        return f"memory: weights {human_bytes(sizes[0])}, KV cache {human_bytes(kv)} per token"
    return (f"memory per rank (tp_size {tp}): weights {human_bytes(max(sizes))} "
            f"({', '.join(human_bytes(n) for n in sizes)}; {human_bytes(sum(sizes))} in all), "
            f"KV cache {human_bytes(kv)} per token ({heads} of {m.num_kv_heads} KV heads"
            f"{f', each on {tp // m.num_kv_heads} ranks' if tp > m.num_kv_heads else ''})")


def verify_line(v: dict) -> str:
    """The verify stage's figures in one line: accuracy against the unquantized model and, with an
    EAGLE-3 draft, its acceptance length on the held-out prompts."""
    parts = []
    if "top1_agreement" in v:
        parts.append(f"top-1 agreement {v['top1_agreement']:.3f}, mean KL {v['mean_kl']:.4f} vs the "
                     f"unquantized model ({'passed' if v.get('passed') else 'FAILED'})")
    spec = v.get("speculative") or {}
    if "mean_acceptance_length" in spec:
        per_pass = spec.get("tokens_per_target_pass", spec["mean_acceptance_length"])
        parts.append(f"draft: {per_pass:.2f} tokens per target pass ({spec.get('tree', 'chain')}, "
                     f"acceptance length {spec['mean_acceptance_length']:.2f} per verifying step)")
    return "verify: " + "; ".join(parts) if parts else ""


def print_summary(console: Console, root: Path, results: dict[str, StageResult], total_seconds: float) -> None:
    bundle = results.get("compile")
    if bundle is not None and bundle.path is not None:
        engine = read_manifest(bundle.path)
        q, m = engine.quantization, engine.model
        console.print(f"\nEngine bundle: {bundle.path}")
        console.print(f"  model {m.architecture} {m.num_layers} layers, hidden {m.hidden_size}, "
                      f"{m.num_heads}/{m.num_kv_heads} heads; weights {q.format}, KV cache "
                      f"{engine.engine.kv_cache_dtype}; targets sm {list(engine.targets.sms)}; "
                      f"{len(engine.kernels)} AOT kernels")
        console.print(f"  {rank_memory_line(engine, bundle.path)}")
        line = verify_line(as_dict(engine.verify) or {})
        if line:
            console.print(f"  {line}")
        files = Table("file", "size", "contents", box=None, pad_edge=False)
        groups: dict[str, list[Path]] = {}  # kernels/<sm>/ hold dozens of files: one line per folder
        for rel in [MANIFEST] + sorted(engine.files):
            p = bundle.path / rel
            if rel.startswith("kernels/"):
                groups.setdefault(str(Path(rel).parent) + "/", []).append(p)
                continue
            what = {MANIFEST: f"manifest, format_version {engine.format_version}",
                    **({rel: _tensor_formats(p)} if rel in engine.weights else {})}.get(rel, "")
            files.add_row(rel, human_bytes(p.stat().st_size), what)
        for folder, paths in sorted(groups.items()):
            kinds = sorted({q.suffix.lstrip(".") for q in paths})
            files.add_row(folder, human_bytes(sum(q.stat().st_size for q in paths)),
                          f"{len(paths)} files ({', '.join(kinds)})")
        console.print(files)
    repo = results.get("package")
    if repo is not None and repo.path is not None:
        console.print(f"Triton model repository: {repo.path}")
    timing = Table("stage", "status", "seconds", "note", title="Stages", box=None, pad_edge=False)
    for r in results.values():
        secs = f"{r.seconds:.1f}" if r.status == "built" else (f"({r.seconds:.1f})" if r.status == "cached" else "-")
        timing.add_row(r.name, r.status, secs, r.reason)
    timing.add_row("total", "", f"{total_seconds:.1f}", "wall time of this run")
    console.print(timing)
