"""Quantize stage: the imported HF checkpoint -> a ModelOpt unified HF checkpoint (``quant/``).

The recipe table, calibration and export live in ``quant.quantize.quantize_checkpoint(hf_dir,
out_dir, qcfg) -> info``; this stage only decides whether there is anything to do and hands over
the config section.
"""
from __future__ import annotations

from builder.memory import MemoryEstimate
from builder.stages.base import StageContext, StageError
from quant.memory import quantize_memory
from quant.quantize import quantize_checkpoint


def skip_reason(ctx: StageContext) -> str | None:
    q = ctx.config.quantization
    imported = ctx.results["import"].info
    if imported.get("prequantized"):
        return f"the source is already quantized by ModelOpt ({imported['prequantized']['quant_algo']})"
    if q.format == "none" and q.kv_cache == "none":
        return "quantization.format and quantization.kv_cache are none"
    return None


def memory_estimate(ctx: StageContext) -> MemoryEstimate:
    import torch  # noqa: PLC0415

    try:
        m = quantize_memory(ctx.results["import"].path, ctx.config.quantization, cuda=torch.cuda.is_available())
    except ValueError as e:
        raise StageError(f"{ctx.config.file}: quantization: {e}") from None
    advice = ("fewer calibration tokens (quantization.calibration.num_samples / max_seq_len)"
              if m.path == "streamed" else
              "quantization.format fp8 or nvfp4 (calibrated layer by layer above 2 GiB of fp32 weights), "
              "fewer calibration tokens (quantization.calibration.num_samples / max_seq_len), or a GPU")
    return MemoryEstimate(m.host_bytes, m.gpu_bytes, m.detail, advice)


def run(ctx: StageContext) -> dict:
    q = ctx.config.quantization
    hf_dir = ctx.results["import"].path
    ctx.log(f"[quantize] ModelOpt {q.format} weights, {q.kv_cache} KV cache: calibrating on "
            f"{q.calibration.num_samples} samples ({q.calibration.dataset})")
    try:
        info = quantize_checkpoint(hf_dir, ctx.out_dir, q)
    except ValueError as e:  # quant/ raises ValueError subclasses with one line for user mistakes
        raise StageError(f"{ctx.config.file}: quantization: {e}") from None
    return dict(info or {})
