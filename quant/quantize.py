"""Quantize an HF checkpoint with NVIDIA ModelOpt and export the unified HF checkpoint.

    info = quantize_checkpoint(hf_dir, out_dir, qcfg, progress=None)

`qcfg` is the `quantization` section of the build config (docs/contracts.md section 1): any object
or mapping with `format`, `kv_cache`, `group_size`, `exclude` and `calibration.{dataset,
num_samples, max_seq_len}`. The model is loaded in bf16, calibrated on the GPU when there is one
(CPU otherwise), and exported with `export_hf_checkpoint` into a temporary folder that replaces
`out_dir` only when complete. What the exported tensors look like per format: quant/README.md.
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from quant.calibration import build_calibration_set, load_texts
from quant.recipes import (KV_RECIPES, RECIPES, QuantConfigError, check_exclude, check_group_size,
                           check_kv_cache, get_recipe, modelopt_config)

# progress(phase, done, total): called as calibration batches and export steps complete
Progress = Callable[[str, int, int], None]

INFO_FILE = "kiln_quant.json"
# Files of the source checkpoint that the export does not write but a self-contained checkpoint needs
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "tokenizer.model", "vocab.json", "merges.txt", "generation_config.json")


def _field(obj: Any, name: str, default: Any = None) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(name, default)
    return getattr(obj, name, default)


@dataclass(frozen=True)
class QuantSettings:
    """The `quantization` section, checked; accepts builder's typed config or a plain dict."""

    format: str = "fp8"
    kv_cache: str = "fp8"
    group_size: int | None = 64
    exclude: tuple[str, ...] = ("lm_head",)
    dataset: str = "builtin"
    num_samples: int = 32
    max_seq_len: int = 256
    max_batch_tokens: int = 4096  # calibration batch size in tokens (not a config key: memory vs passes)

    def __post_init__(self) -> None:
        get_recipe(self.format)
        check_kv_cache(self.kv_cache)
        for key, v in (("num_samples", self.num_samples), ("max_seq_len", self.max_seq_len),
                       ("max_batch_tokens", self.max_batch_tokens)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise QuantConfigError(f"quantization.calibration.{key}: {v!r}; allowed: an integer >= 1")
        if isinstance(self.exclude, str) or not all(isinstance(p, str) for p in self.exclude):
            raise QuantConfigError(f"quantization.exclude: {self.exclude!r} is not a list of module-name patterns; "
                                   f"allowed: e.g. [\"lm_head\"]")

    @classmethod
    def from_config(cls, qcfg: Any) -> "QuantSettings":
        if isinstance(qcfg, QuantSettings):
            return qcfg
        calib = _field(qcfg, "calibration", {}) or {}
        d = cls()
        exclude = _field(qcfg, "exclude", d.exclude)
        return cls(format=_field(qcfg, "format", d.format), kv_cache=_field(qcfg, "kv_cache", d.kv_cache),
                   group_size=_field(qcfg, "group_size", d.group_size),
                   exclude=tuple(exclude) if isinstance(exclude, (list, tuple)) else exclude,
                   dataset=str(_field(calib, "dataset", d.dataset)),
                   num_samples=_field(calib, "num_samples", d.num_samples),
                   max_seq_len=_field(calib, "max_seq_len", d.max_seq_len))


def _tqdm_progress() -> Progress:
    """Default display: one tqdm bar per phase on stderr (tqdm hides itself when not a terminal)."""
    from tqdm import tqdm  # noqa: PLC0415

    bars: dict[str, Any] = {}

    def update(phase: str, done: int, total: int) -> None:
        bar = bars.get(phase)
        if bar is None:
            bar = bars[phase] = tqdm(total=total, desc=phase, file=sys.stderr, disable=None, leave=False)
        bar.total = max(total, done)
        bar.n = done
        bar.refresh()
        if done >= total:
            bar.close()

    return update


def _quantized_linears(model, exclude: tuple[str, ...]) -> dict[str, int]:
    """name -> in_features of the nn.Linear modules the recipe will quantize."""
    import torch  # noqa: PLC0415

    skip = tuple(exclude) + ("lm_head", "*lm_head*")  # every ModelOpt recipe leaves lm_head alone
    return {n: m.in_features for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and not any(fnmatch.fnmatchcase(n, p) for p in skip)}


def _skeleton(hf_dir: Path):
    """The model's module tree on the meta device (no weights read): enough to check the config."""
    import torch  # noqa: PLC0415
    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: PLC0415

    if not (hf_dir / "config.json").is_file():
        raise FileNotFoundError(f"{hf_dir}: not an HF checkpoint (no config.json)")
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(hf_dir)))


def _compute_dtype(device: str):
    """Calibrate in bf16 on a GPU (the checkpoint's own dtype: half the memory, tensor-core
    speed); on a CPU in fp32, which upcasts the bf16 weights exactly and runs ModelOpt's
    fake-quantization about twice as fast (CPUs lack fast bf16 elementwise kernels). Both paths
    use it, so the streamed export matches the whole-model one on the same device. The export is
    written in bf16 either way."""
    import torch  # noqa: PLC0415

    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def _load_model(hf_dir: Path, device: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    dtype = _compute_dtype(device)
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=dtype).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    # export_hf_checkpoint iterates config.architectures; a checkpoint converted from GGUF has None
    if not model.config.architectures:
        model.config.architectures = [type(model).__name__]
    return model, tokenizer


def _calibrate(model, cfg: dict, batches: list, device: str, progress: Progress):
    import modelopt.torch.quantization as mtq  # noqa: PLC0415
    import torch  # noqa: PLC0415

    passes = [0]

    def forward_loop(m) -> None:
        # ModelOpt may call this more than once (AWQ and SmoothQuant search per pass): count passes
        passes[0] += 1
        phase = f"calibrate (pass {passes[0]})"
        with torch.no_grad():
            for i, ids in enumerate(batches, 1):
                m(input_ids=ids.to(device))
                progress(phase, i, len(batches))

    model = mtq.quantize(model, cfg, forward_loop)
    return model, passes[0]


# Tensors ModelOpt writes in fp32 whatever the model dtype; everything else follows the model dtype
FP32_SUFFIXES = (".weight_scale", ".weight_scale_2", ".input_scale", ".k_scale", ".v_scale")


def _bf16_export(export_dir: Path) -> None:
    """After an fp32 CPU calibration, store what a bf16 calibration would have stored: unquantized
    weights, norms (with any AWQ smoothing folded in) and pre_quant_scale in bf16. The export's
    `dtype` argument covers only the quantized linears, and casting the model before exporting
    breaks ModelOpt's AWQ re-smoothing forward (fp32 scales meet bf16 weights)."""
    import torch  # noqa: PLC0415
    from safetensors.torch import load_file, save_file  # noqa: PLC0415

    for shard in sorted(export_dir.glob("*.safetensors")):
        tensors = load_file(str(shard))
        changed = {n: t.to(torch.bfloat16) for n, t in tensors.items()
                   if t.dtype == torch.float32 and not n.endswith(FP32_SUFFIXES)}
        if changed:
            tensors.update(changed)
            save_file(tensors, str(shard), metadata={"format": "pt"})
    # config.json keeps the dtype the model was loaded in; the checkpoint is bf16 now
    cfg_path = export_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    for key in ("dtype", "torch_dtype"):
        if key in cfg:
            cfg[key] = "bfloat16"
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")


def _copy_side_files(src: Path, dst: Path) -> None:
    for name in TOKENIZER_FILES:
        if (src / name).is_file() and not (dst / name).exists():
            shutil.copy2(src / name, dst / name)


# Above this many bytes of fp32 weights (what the whole-model path holds on a CPU) the stream is
# chosen: it costs ~1 s of ModelOpt set-up per layer, more than loading a small model whole.
STREAM_ABOVE_BYTES = 2 << 30
PATHS = ("auto", "whole", "streamed")


def choose_path(fmt: str, hf_dir: Path, path: str = "auto") -> str:
    """"whole" or "streamed" for `fmt` (the recipe table says which formats can stream)."""
    recipe = get_recipe(fmt)
    if path not in PATHS:
        raise QuantConfigError(f"quantize path: {path!r}; allowed: {' | '.join(PATHS)}")
    if path == "streamed" and not recipe.streamable:
        raise QuantConfigError(f"quantization.format: {fmt} cannot be calibrated layer by layer (its ModelOpt "
                               f"algorithm searches over quantized forwards of the whole model); allowed for "
                               f"streaming: {' | '.join(n for n, r in RECIPES.items() if r.streamable)}")
    if path != "auto":
        return path
    if not recipe.streamable:
        return "whole"
    return "streamed" if fp32_weight_bytes(hf_dir) > STREAM_ABOVE_BYTES else "whole"


def fp32_weight_bytes(hf_dir: Path) -> int:
    """The checkpoint's weights in fp32 (from the shard headers: nothing is read)."""
    from quant.stream import Shards  # noqa: PLC0415

    return Shards(hf_dir).numel() * 4


def _whole_model(hf_dir: Path, tmp: Path, settings: QuantSettings, cfg: dict, device: str,
                 progress: Progress, timings: dict) -> tuple[dict, Any, list, int]:
    import torch  # noqa: PLC0415
    from modelopt.torch.export import export_hf_checkpoint  # noqa: PLC0415

    t = time.perf_counter()
    model, tokenizer = _load_model(hf_dir, device)
    timings["load_s"] = time.perf_counter() - t
    t = time.perf_counter()
    calib = build_calibration_set(tokenizer, settings.dataset, settings.num_samples, settings.max_seq_len)
    batches = calib.batches(settings.max_batch_tokens)
    model, passes = _calibrate(model, cfg, batches, device, progress)
    timings["calibrate_s"] = time.perf_counter() - t
    t = time.perf_counter()
    progress("export", 0, 1)
    export_hf_checkpoint(model, dtype=torch.bfloat16, export_dir=str(tmp))
    _bf16_export(tmp)
    progress("export", 1, 1)
    timings["export_s"] = time.perf_counter() - t
    hf_quant = json.loads((tmp / "hf_quant_config.json").read_text())["quantization"]
    return hf_quant, calib, batches, passes


def _streamed(hf_dir: Path, tmp: Path, settings: QuantSettings, cfg: dict, device: str,
              progress: Progress, timings: dict) -> tuple[dict, Any, list, int]:
    from transformers import AutoTokenizer  # noqa: PLC0415

    from quant.stream import streamed_export  # noqa: PLC0415

    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    calib = build_calibration_set(tokenizer, settings.dataset, settings.num_samples, settings.max_seq_len)
    batches = calib.batches(settings.max_batch_tokens)
    t = time.perf_counter()
    # calibration and export interleave (layer by layer): one figure for both
    hf_quant, passes = streamed_export(hf_dir, tmp, cfg, batches, progress, FP32_SUFFIXES, device=device,
                                       dtype=_compute_dtype(device))
    timings["calibrate_export_s"] = time.perf_counter() - t
    return hf_quant, calib, batches, passes


# "whole": the model loaded at once, ModelOpt's own calibration and export (every format).
# "streamed": one decoder layer at a time (quant/stream.py), for formats whose recipe allows it.
RUNNERS = {"whole": _whole_model, "streamed": _streamed}


def quantize_checkpoint(hf_dir: str | Path, out_dir: str | Path, qcfg: Any,
                        progress: Progress | None = None, path: str = "auto", device: str | None = None) -> dict:
    """Quantize `hf_dir` per `qcfg` and write the ModelOpt unified HF checkpoint to `out_dir`.

    `path` picks the whole-model or the streamed (layer by layer, bounded memory) calibration;
    "auto" streams formats that allow it when the fp32 weights exceed STREAM_ABOVE_BYTES. Both
    write the same tensors (docs/contracts.md); the streamed export is sharded per layer.
    `device` ("cuda", "cpu"; None: the GPU when there is one) is where either path calibrates.
    Returns (and writes to `out_dir/kiln_quant.json`) the format, kv_cache, group_size, exclude
    patterns, ModelOpt's `quant_algo`/`exclude_modules`, tool versions, device, path, calibration
    stats and the seconds per phase. Raises QuantConfigError / CalibrationDataError (ValueError)
    with one line on a user mistake; `out_dir` is untouched unless the export completed.
    """
    import torch  # noqa: PLC0415

    settings = QuantSettings.from_config(qcfg)
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    progress = progress or _tqdm_progress()
    recipe = get_recipe(settings.format)
    timings: dict[str, float] = {}

    # Every check a user can fail runs before the weights are read or anything is written
    load_texts(settings.dataset)
    skeleton = _skeleton(hf_dir)
    exclude = check_exclude(settings.exclude, [n for n, _ in skeleton.named_modules() if n])
    group_size = check_group_size(settings.format, settings.group_size, _quantized_linears(skeleton, exclude))
    del skeleton
    chosen = choose_path(settings.format, hf_dir, path)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    cfg = modelopt_config(settings.format, settings.kv_cache, group_size, exclude)

    tmp = out_dir.parent / f"{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        hf_quant, calib, batches, passes = RUNNERS[chosen](hf_dir, tmp, settings, cfg, device, progress, timings)
        _copy_side_files(hf_dir, tmp)
        # The compile stage picks the packing from quant_algo: a mismatch here would mis-pack silently
        assert hf_quant.get("quant_algo") == recipe.export_algo, (hf_quant.get("quant_algo"), recipe.export_algo)
        info = _info(settings, group_size, exclude, hf_quant, calib.stats(batches), passes, device, timings)
        info["path"] = chosen
        (tmp / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return info


def _info(settings: QuantSettings, group_size, exclude, hf_quant: dict, calib: dict, passes: int,
          device: str, timings: dict) -> dict:
    import modelopt  # noqa: PLC0415
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    return {
        "format": settings.format,
        "kv_cache": settings.kv_cache,
        "kv_cache_dtype": "fp8_e4m3" if KV_RECIPES[settings.kv_cache] else None,
        "group_size": group_size,
        "exclude": list(exclude),
        "quant_algo": hf_quant.get("quant_algo"),
        "kv_cache_quant_algo": hf_quant.get("kv_cache_quant_algo"),
        "exclude_modules": hf_quant.get("exclude_modules", []),
        "source": f"modelopt {modelopt.__version__}",
        "tools": {"modelopt": modelopt.__version__, "torch": torch.__version__,
                  "transformers": transformers.__version__},
        "device": device,
        "dtype": str(_compute_dtype(device)).removeprefix("torch."),
        "calibration": dict(calib, passes=passes),
        "timings": {k: round(v, 3) for k, v in timings.items()},
    }
