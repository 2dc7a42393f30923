"""Streamed FP8 quantization of a random-weight Llama-3.1-8B-shaped checkpoint on the GPU.

    python -m harness.perf.quant_gpu --out F [--layers 32] [--time-limit S] [--tokenizer DIR]
                                      [--workdir DIR] [--dry-run]
    python -m harness.perf.quant_gpu --save-tokenizer DIR     (CPU machine: stage what must travel)

Two phases in one process: (1) write the checkpoint with `harness.perf.lib.models` (hidden 4096,
32 heads, 8 KV heads, intermediate 14336, SmolLM2's vocabulary; numbers drawn on the GPU, written
shard by shard); (2) the real `quant.quantize.quantize_checkpoint` on the streamed path, on cuda,
fp8 weights + fp8 KV, 8 samples x 256 tokens. The JSON has seconds per phase and per layer, the
peak host RSS of each phase (VmHWM, reset between phases through /proc/self/clear_refs), the peak
GPU memory (torch.cuda.max_memory_allocated), checkpoint sizes, quant.memory's estimate beside the
measurement, card, date, command and commit (KILN_COMMIT where the tree came without its .git).
It is rewritten after each phase, so a run killed from outside still leaves what it measured.

--time-limit S: quantization stops after the layer that ends past S seconds from the start (the
checkpoint writing counts); the JSON then says `complete: false`, how many layers were done and
their per-layer figures, which is what a full run's peak memory depends on (one layer resident).
--dry-run: the same code on the CPU at hidden 256, 2 layers (its plumbing, for tests).

The GPU machine has no venv and no network: the tokenizer (config.json for the vocabulary size and
the tokenizer files, 3.5 MB) travels in `.whl/smollm2-tokenizer`, staged here by --save-tokenizer.
"""
from __future__ import annotations

import argparse
import json
import resource
import shutil
import sys
import time
from pathlib import Path

from harness.perf.lib.results import REPO, default_output, header, write_result
from harness.perf.lib.models import LLAMA31_8B, TOKENIZER_FILES, hf_dims, write_random_llama

CARRIED_TOKENIZER = REPO / ".whl" / "smollm2-tokenizer"
# the tests' cached import of SmolLM2 (tests/conftest.py smollm2_hf_dir), then the build_memory one
LOCAL_TOKENIZERS = (REPO / "build" / "test-cache" / "smollm2-import" / "work" / "import",
                    REPO / "build" / "bench-memory" / "smollm2" / "work" / "import")
LLAMA_8B = {k: v for k, v in hf_dims(LLAMA31_8B).items() if k != "tie"}
DRY = {"hidden": 256, "heads": 4, "kv_heads": 2, "intermediate": 512, "layers": 2}
QUANT = {"format": "fp8", "kv_cache": "fp8", "exclude": ["lm_head"],
         "calibration": {"dataset": "builtin", "num_samples": 8, "max_seq_len": 256}}


class BudgetSpent(Exception):
    """Raised from the progress callback: the time limit passed with layers still to do."""


def find_tokenizer(given: str | None) -> Path:
    for d in ([Path(given)] if given else [CARRIED_TOKENIZER, *LOCAL_TOKENIZERS]):
        if (d / "config.json").is_file() and (d / "tokenizer.json").is_file():
            return d
    raise SystemExit(f"no SmolLM2 tokenizer folder (config.json + tokenizer.json) at {given or CARRIED_TOKENIZER}; "
                     f"stage one with `python -m harness.perf.quant_gpu --save-tokenizer {CARRIED_TOKENIZER}` "
                     f"on a machine with the venv")


def save_tokenizer(dst: Path) -> None:
    src = next((d for d in LOCAL_TOKENIZERS if (d / "tokenizer.json").is_file()), None)
    if src is None:  # the builder's own import of the wheel-shipped GGUF (needs the venv)
        from harness.perf.build_cost import _tokenizer_dir  # noqa: PLC0415

        src = _tokenizer_dir(REPO / "build" / "bench-memory")
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", *TOKENIZER_FILES):
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
    print(f"{src} -> {dst}: {sorted(p.name for p in dst.iterdir())}")


def _reset_peak_rss() -> bool:
    """Start a new host peak: writing 5 to clear_refs resets VmHWM (Linux >= 4.0)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _rss(field: str) -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _bytes(d: Path, pattern: str = "*.safetensors") -> int:
    return sum(f.stat().st_size for f in d.glob(pattern)) if d.is_dir() else 0


def _gpu(torch) -> dict:
    if not torch.cuda.is_available():
        return {}
    p = torch.cuda.get_device_properties(0)
    return {"name": p.name, "memory_bytes": p.total_memory, "torch": torch.__version__, "cuda": torch.version.cuda}


def run(args, result: dict, write) -> None:
    import torch  # noqa: PLC0415

    from quant.memory import quantize_memory  # noqa: PLC0415
    from quant.quantize import quantize_checkpoint  # noqa: PLC0415

    t0 = time.perf_counter()
    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device (use --dry-run on a CPU machine)")
    shape = dict(DRY if args.dry_run else LLAMA_8B)
    shape["layers"] = args.layers or shape["layers"]
    result["shape"] = shape
    result["machine"]["gpu"] = _gpu(torch)
    import modelopt  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    result["tools"] = {"modelopt": modelopt.__version__, "torch": torch.__version__,
                       "transformers": transformers.__version__}
    work = Path(args.workdir)
    ckpt, out = work / "hf", work / "quantized"
    shutil.rmtree(work, ignore_errors=True)

    # phase 1: the checkpoint (numbers drawn where the quantization will run: seconds, not minutes)
    hwm = _reset_peak_rss()
    t = time.perf_counter()
    write_random_llama(ckpt, find_tokenizer(args.tokenizer), hidden=shape["hidden"], layers=shape["layers"],
                       heads=shape["heads"], kv_heads=shape["kv_heads"], intermediate=shape["intermediate"],
                       device=device)
    result["phases"]["write_checkpoint"] = {
        "seconds": round(time.perf_counter() - t, 2), "peak_rss_bytes": _rss("VmHWM"),
        "bytes": _bytes(ckpt), "gb_per_s": round(_bytes(ckpt) / 1e9 / (time.perf_counter() - t), 2)}
    # without clear_refs every phase reports the process's peak so far (still an upper bound)
    result["rss_peak_per_phase"] = hwm
    estimate = quantize_memory(ckpt, QUANT, path="streamed", cuda=device == "cuda")
    result["estimate"] = {"host_bytes": estimate.host_bytes, "gpu_bytes": estimate.gpu_bytes,
                          "detail": estimate.detail}
    write()

    # phase 2: the streamed quantization, layer times from the progress callback
    _reset_peak_rss()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    marks: list[float] = []
    limit = args.time_limit

    def progress(phase: str, done: int, total: int) -> None:
        if phase != "quantize layers":
            return
        marks.append(time.perf_counter())
        if limit is not None and done < total and time.perf_counter() - t0 > limit:
            raise BudgetSpent(f"{done}/{total} layers after {time.perf_counter() - t0:.0f} s (limit {limit} s)")

    t = time.perf_counter()
    q: dict = {"layers_done": 0}
    try:
        info = quantize_checkpoint(ckpt, out, QUANT, progress=progress, path="streamed", device=device)
        q.update(complete=True, bytes=_bytes(out), timings=info["timings"], device=info["device"],
                 dtype=info["dtype"], tools=info["tools"], calibration=info["calibration"])
    except BudgetSpent as e:
        q.update(complete=False, stopped=str(e))
    q["seconds"] = round(time.perf_counter() - t, 2)
    q["layers_done"] = len(marks)
    q["peak_rss_bytes"] = _rss("VmHWM")
    if device == "cuda":
        q["peak_gpu_allocated_bytes"] = torch.cuda.max_memory_allocated()
        q["peak_gpu_reserved_bytes"] = torch.cuda.max_memory_reserved()
    # first "layer" includes the tokenizer, calibration set and embedding lookup before layer 0
    q["first_layer_s"] = round(marks[0] - t, 2) if marks else None
    steps = [b - a for a, b in zip(marks, marks[1:])]
    q["per_layer_s"] = [round(s, 2) for s in steps]
    if steps:
        mean = sum(steps) / len(steps)
        q["mean_layer_s"] = round(mean, 3)
        q["estimated_full_s"] = round((marks[0] - t) + mean * (shape["layers"] - 1), 1)
    result["phases"]["quantize"] = q
    result["complete"] = bool(q.get("complete"))
    result["total_s"] = round(time.perf_counter() - t0, 2)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m harness.perf.quant_gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", "--output", dest="out", help="result JSON (default build/perf/quant-gpu.json)")
    p.add_argument("--layers", type=int, help="decoder layers (default 32; 2 with --dry-run)")
    p.add_argument("--time-limit", type=float, help="seconds from the start after which no new layer begins")
    p.add_argument("--tokenizer", help=f"SmolLM2 config + tokenizer folder (default {CARRIED_TOKENIZER} or the "
                                       f"tests' cached import)")
    p.add_argument("--workdir", default="/tmp/kiln-quant-gpu", help="checkpoint and export (16 + 9 GB at 8B)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoint and export")
    p.add_argument("--dry-run", action="store_true", help="CPU, hidden 256, 2 layers")
    p.add_argument("--save-tokenizer", metavar="DIR", help="copy the tokenizer files to DIR and exit")
    args = p.parse_args(argv)
    if args.save_tokenizer:
        save_tokenizer(Path(args.save_tokenizer))
        return 0
    result = {
        **header("quant-gpu", "harness.perf.quant_gpu", argv),
        "what": "streamed fp8 (+fp8 KV) quantization of a random-weight Llama-3.1-8B-shaped checkpoint",
        "quantization": QUANT, "time_limit_s": args.time_limit,
        "complete": False, "phases": {},
    }
    out = Path(args.out) if args.out else default_output("quant-gpu.json")

    def write() -> None:   # after each phase: a run cut by its limit keeps what it did
        write_result(result, out)

    try:
        run(args, result, write)
    finally:
        write()
    q = result["phases"].get("quantize", {})
    print(json.dumps({"complete": result["complete"], "total_s": result.get("total_s"),
                      "write_s": result["phases"].get("write_checkpoint", {}).get("seconds"),
                      "quantize_s": q.get("seconds"), "layers_done": q.get("layers_done"),
                      "mean_layer_s": q.get("mean_layer_s"), "peak_rss_gib": round(q.get("peak_rss_bytes", 0) / 2**30, 2),
                      "peak_gpu_gib": round(q.get("peak_gpu_allocated_bytes", 0) / 2**30, 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
