"""Shared by the decoder-graph tests (test_onnx_graph.py, test_onnx_w4a16.py, test_onnx_draft.py) and the tests that build a
second config of a quantized bundle on one calibration (test_tensor_parallel.py)."""
from __future__ import annotations

from pathlib import Path

import torch

# Light calibration, as tests/builder/test_quantized_bundles.py: these builds share its cache
LIGHT = ["quantization.calibration.num_samples=4", "quantization.calibration.max_seq_len=64", "verify.enabled=false"]
TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
        "combined movable metal type, oil-based ink and a screw press. Within fifty years, presses were "
        "working in more than two hundred cities across Europe, and the price of books fell sharply. Scholars "
        "could compare editions, merchants printed price lists, and governments issued proclamations to be "
        "read aloud in every market square. The spread of literacy that followed changed how people learned")


def runners(bundle: Path, graph: Path | None = None, weights: dict | None = None, **overrides):
    """(the native runner in float32, the onnx-reference runner) over one bundle; ``graph``: a decoder
    graph exported elsewhere; ``weights``: the native runner's tensors (default: the bundle's)."""
    from backend.runtime.onnx_runner import OnnxReferenceRunner
    from backend.runtime.native import ModelRunner
    from backend.runtime.spec import load_engine_spec
    spec = load_engine_spec(bundle, dict(max_kv_tokens=2048, **overrides))
    return ModelRunner(spec, dtype=torch.float32, weights=weights), OnnxReferenceRunner(spec, graph=graph)


def prefill_parity(native, graph, ids: list[int]) -> torch.Tensor:
    """One prefill of ``ids`` through both runners: logits within 2e-3 with the same argmax, and the
    graph wrote the runner's own pool (its blocks within 1e-3 of the native ones). Returns the native logits."""
    from backend.runtime.native import prefill_meta
    meta = prefill_meta(len(ids), native.block_size, torch.device("cpu"))
    want, _ = native.execute(torch.tensor(ids), meta, torch.arange(len(ids)))
    got, _ = graph.execute(torch.tensor(ids), meta, torch.arange(len(ids)))
    assert (got - want).abs().max() < 2e-3 and torch.equal(got.argmax(-1), want.argmax(-1))
    blocks = -(-len(ids) // native.block_size)
    for (kn, vn), (kg, vg) in zip(native.kv_caches, graph.kv_caches):
        assert (kn[:blocks] - kg[:blocks]).abs().max() < 1e-3 and (vn[:blocks] - vg[:blocks]).abs().max() < 1e-3
    return want


def decode_meta(ctx: int, block_size: int):
    """The AttentionMetadata of one sequence's decode step after ``ctx`` cached tokens (blocks 0..)."""
    from backend.ops.attention.metadata import AttentionMetadata
    i32 = torch.int32
    return AttentionMetadata(
        positions=torch.tensor([ctx]), slot_mapping=torch.tensor([ctx]),
        block_tables=torch.arange(ctx // block_size + 1, dtype=i32)[None], seq_lens=torch.tensor([ctx + 1], dtype=i32),
        query_start_loc=torch.tensor([0, 1], dtype=i32), context_lens=torch.tensor([ctx], dtype=i32),
        num_prefills=0, num_prefill_tokens=0, num_decode_tokens=1, max_query_len=1, max_seq_len=ctx + 1)


def share_quantize(one: Path, config: str, overrides: list[str]) -> None:
    """Point the build of ``config`` + ``overrides`` at bundle ``one``'s quantize stage, as conftest shares
    the import: its key covers only the model and quantization sections, so when those are the same the
    calibration (about a minute per format on 2 cores) runs once. Build folders as conftest names them."""
    from builder.config import BuildConfig
    done = one.parent / "work" / "quantize"
    cfg = BuildConfig.from_yaml(Path(__file__).resolve().parents[2] / "configs" / f"{config}.yaml", overrides)
    target = one.parent.parent / f"{config}-{cfg.config_hash()[:12]}" / "work" / "quantize"
    if not done.is_dir() or target.exists() or target.is_symlink():
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    target.symlink_to(done, target_is_directory=True)
