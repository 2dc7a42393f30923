"""Time estimates per build stage, printed beside the memory estimate before a stage runs.

    stage_time(name, ctx, cuda=None) -> TimeEstimate | None      (what the pipeline prints)
    import_seconds / quantize_time / compile_time / verify_time   (the formulas, also used offline
                                                                   by ``python -m builder.estimate``)

A guide, never a refusal: a 70B build should say "about half an hour" before it starts, not be
stopped by a formula. Each stage's time is a fixed part plus seconds per parameter (or per byte)
plus, where a model runs forward over tokens, 2 x tokens x parameters FLOPs at the device's
throughput. The constants are fitted to measurements already committed under docs/perf (this 2-core
AMD EPYC for the CPU; one H100 for the GPU); a stage that runs on the host of a GPU machine (import,
compile, verify) uses the CPU constants, an upper bound on a host with more cores.

Measurements -> constants (layer = 45.09 M parameters at hidden 2048 / intermediate 5632; the
random-weight Llamas of docs/perf/build-memory-verify.json, the run with load average 0.4; tokens
are estimated as below: 303 for 8 x 256 builtin samples, 161 for the 8 held-out prompts):
* CPU_FLOPS: docs/perf/cpu_linear.json, SmolLM2's 30 layers of linears (106.2 M parameters) at 512
  rows in 0.619 s: 2 x 512 x 106.2 M / 0.619 = 176 GFLOP/s (fp32, oneDNN).
* GPU_FLOPS: NOT measured for GEMMs here: 300 TFLOP/s assumed for bf16 (a third of an H100's dense
  peak; docs/perf/kernels-h100.json measured 188-471 TFLOP/s for attention). It hardly matters:
  ModelOpt's max calibration is one forward, and on the H100 the forward of 244 tokens was under
  1 ms of a 1.07 s layer.
* import: sha256 of every source file (HF files are hard-linked): 2.1 s for 1.48 GB and 3.7 s for
  2.57 GB -> 1.45 s/GB. GGUF (dequantized by transformers): 8.6 s for SmolLM2's 98 MB Q4_1 file
  (docs/perf/build-time.json, fixed costs included) -> 87 ns/byte.
* quantize, streamed, CPU: 16.5 s at 12 layers, 28.6 s at 24 -> 1.008 s/layer, of which 0.156 s is
  the forward over 303 tokens: 18.9 ns/parameter of a layer; fixed part 4.4 s (start-up, the
  calibration set, the embedding phase).
* quantize, streamed, GPU: docs/perf/quant-gpu-h100.json (Llama-3.1-8B shape, 218.1 M parameters a
  layer, 32 layers): 1.071 s/layer -> 4.91 ns/parameter; 45.98 s in all -> fixed part 11.7 s.
  The H200 is estimated with the H100's constants: the time goes to reading the layer from the
  shards, ModelOpt's per-layer work and the export, not to GPU memory bandwidth.
* quantize, whole model, CPU: SmolLM2-135M (134.5 M parameters, 977 tokens) in 10.87 s
  (docs/perf/build-time.json) -> 37 ns/parameter after the fixed 4.4 s and the forward.
  Whole model on a GPU: not measured; the streamed GPU constants are used.
* compile (pack weights tensor by tensor + AOT kernels): 7.1 s at 742 M parameters, 10.9 s at
  1284 M -> 7.0 ns/parameter + 1.9 s (the kernels: their count depends on the engine's shapes, not
  on depth).
* verify, streamed (host CPU, both models forward): 18.4 s at 742 M parameters, 31.3 s at 1284 M
  -> 23.8 ns/parameter, of which the two forwards over 161 tokens are 3.7: 20.2 ns/parameter +
  0.7 s. Whole (both models loaded): 40.3 s / 81.4 s at the same sizes (git show
  eb7dada:docs/perf/build-memory-verify.json) -> 63 ns/parameter, the deeper model's rate.
* package: 0.003 s (docs/perf/build-time.json): 0.1 s.
Tokens: ModelOpt's calibration set and verify's prompts are truncated token sequences of known
texts, so the count is estimated without a tokenizer as ceil(characters / 4) per text, capped at
the sequence limit (the builtin set's first 8 texts: 303 estimated for 236 tokenized by SmolLM2's
tokenizer; the held-out 8: 161 for 146). The draft stage (EAGLE-3 training) has no formula.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

CPU_FLOPS = 1.76e11
GPU_FLOPS = 3.0e14
CHARS_PER_TOKEN = 4
IMPORT_HASH_S_PER_BYTE = 1.45e-9
IMPORT_GGUF_S_PER_BYTE = 8.6 / 98_362_432
# (fixed seconds, seconds per parameter of the layers) of the streamed quantize, per device kind
QUANT_STREAMED = {"cpu": (4.4, 18.9e-9), "cuda": (11.7, 4.91e-9)}
QUANT_WHOLE_CPU_S_PER_PARAM = 37e-9
COMPILE_BASE_S, COMPILE_S_PER_PARAM = 1.9, 7.0e-9
VERIFY_STREAMED_BASE_S, VERIFY_STREAMED_S_PER_PARAM = 0.7, 20.2e-9
VERIFY_WHOLE_S_PER_PARAM = 63e-9
PACKAGE_S = 0.1
GPU_CONSTANTS = "constants from one H100"


@dataclasses.dataclass(frozen=True)
class TimeEstimate:
    seconds: float
    device: str         # where it runs: "cpu" (this or the host's CPU) or "cuda"
    detail: str         # what the figure is made of, for the log line


def duration(seconds: float) -> str:
    """A rounded duration for a log line: '~40 s', '~6 min', '~2.3 h'."""
    if seconds < 90:
        return f"~{max(1, round(seconds))} s"
    if seconds < 90 * 60:
        return f"~{round(seconds / 60)} min"
    return f"~{seconds / 3600:.1f} h"


def describe(est: TimeEstimate) -> str:
    where = f"cuda, {GPU_CONSTANTS}" if est.device == "cuda" else "cpu"
    return f"time {duration(est.seconds)} on {where} ({est.detail})"


def text_tokens(texts: list[str], limit: int) -> int:
    """Estimated tokens of `texts` each truncated to `limit` tokens (no tokenizer needed)."""
    return sum(min(limit, -(-len(t) // CHARS_PER_TOKEN)) for t in texts)


def calibration_tokens(qcfg) -> int:
    """Estimated tokens of the calibration set; num_samples x max_seq_len when its file is unreadable
    (the quantize stage reports that file itself)."""
    from quant.calibration import load_texts  # noqa: PLC0415 (reads a JSONL; no torch)
    from quant.quantize import QuantSettings  # noqa: PLC0415

    s = QuantSettings.from_config(qcfg)
    try:
        _, texts = load_texts(s.dataset)
    except (OSError, ValueError):
        return s.num_samples * s.max_seq_len
    return text_tokens(texts[:s.num_samples], s.max_seq_len)


def _shape(hf_dir: Path) -> tuple[int, int, int]:
    """(parameters, parameters of decoder layer 0, layers) from config.json and the shard headers."""
    from quant.stream import LAYER_PREFIX, Shards  # noqa: PLC0415

    shards = Shards(Path(hf_dir))
    layers = json.loads((Path(hf_dir) / "config.json").read_text())["num_hidden_layers"]
    return shards.numel(), shards.numel(f"{LAYER_PREFIX}0."), layers


def import_seconds(nbytes: int, kind: str) -> TimeEstimate:
    if kind == "gguf":
        return TimeEstimate(nbytes * IMPORT_GGUF_S_PER_BYTE, "cpu", f"dequantize {nbytes / 1e9:.2f} GB of GGUF")
    if kind == "hf-text-part":   # read twice (hashed, then the language model rewritten); the write not timed
        return TimeEstimate(2 * nbytes * IMPORT_HASH_S_PER_BYTE, "cpu",
                            f"sha256 of {nbytes / 1e9:.1f} GB, the language model's tensors rewritten")
    return TimeEstimate(nbytes * IMPORT_HASH_S_PER_BYTE, "cpu", f"sha256 of {nbytes / 1e9:.1f} GB, files linked")


def quantize_time(hf_dir: Path, qcfg, cuda: bool) -> TimeEstimate:
    from quant.quantize import QuantSettings, choose_path  # noqa: PLC0415

    params, layer, layers = _shape(hf_dir)
    path = choose_path(QuantSettings.from_config(qcfg).format, Path(hf_dir))
    tokens = calibration_tokens(qcfg)
    device = "cuda" if cuda else "cpu"
    forward = 2 * tokens * params / (GPU_FLOPS if cuda else CPU_FLOPS)
    fixed, per_param = QUANT_STREAMED[device]
    if path == "streamed":
        seconds = fixed + layers * layer * per_param + forward
        detail = f"streamed: {layers} layers x {layer / 1e6:.0f} M parameters, ~{tokens} calibration tokens"
    else:
        per_param = per_param if cuda else QUANT_WHOLE_CPU_S_PER_PARAM
        seconds = fixed + params * per_param + forward
        detail = f"whole model: {params / 1e9:.2f} B parameters, ~{tokens} calibration tokens"
    return TimeEstimate(seconds, device, detail)


def compile_time(ckpt_dir: Path) -> TimeEstimate:
    params, _, _ = _shape(ckpt_dir)
    return TimeEstimate(COMPILE_BASE_S + params * COMPILE_S_PER_PARAM, "cpu",
                        f"pack {params / 1e9:.2f} B parameters + AOT kernels")


def verify_time(hf_dir: Path, path: str, num_prompts: int) -> TimeEstimate:
    """``path``: whole | streamed (the verify stage's choice); both run on the host CPU."""
    from builder.stages.verify import MAX_PROMPT_TOKENS, load_prompts  # noqa: PLC0415

    params, _, _ = _shape(hf_dir)
    if path == "whole":
        return TimeEstimate(params * VERIFY_WHOLE_S_PER_PARAM, "cpu",
                            f"whole: both models of {params / 1e9:.2f} B parameters")
    tokens = text_tokens(load_prompts(num_prompts), MAX_PROMPT_TOKENS)
    seconds = VERIFY_STREAMED_BASE_S + params * VERIFY_STREAMED_S_PER_PARAM + 4 * tokens * params / CPU_FLOPS
    return TimeEstimate(seconds, "cpu", f"streamed: {params / 1e9:.2f} B parameters, ~{tokens} prompt tokens")


def stage_time(name: str, ctx, cuda: bool | None = None) -> TimeEstimate | None:
    """The estimate for stage `name` about to run in `ctx` (builder.stages.base.StageContext);
    None when the stage has no formula (draft). `cuda`: None = whether torch sees a GPU (quantize
    is the one stage that runs there)."""
    cfg = ctx.config
    if name == "import":
        from builder import sources  # noqa: PLC0415

        src = sources.resolve(cfg.model.source, cfg.file)
        return import_seconds(sum(f.stat().st_size for f in src.files()), src.kind)
    if name == "quantize":
        if cuda is None:
            import torch  # noqa: PLC0415

            cuda = torch.cuda.is_available()
        return quantize_time(ctx.results["import"].path, cfg.quantization, cuda)
    if name == "compile":
        return compile_time(ctx.checkpoint_dir())
    if name == "verify":
        from builder.stages.verify import choose_path  # noqa: PLC0415

        return verify_time(ctx.results["import"].path, choose_path(ctx), cfg.verify.num_prompts)
    if name == "package":
        return TimeEstimate(PACKAGE_S, "cpu", "render templates")
    return None
