"""Decode steps through backend.ops.cuda_graphs' padded static buffers give the same tokens as eager steps.

On CPU nothing can be captured (CUDA graphs need a GPU), so engine.cuda_graphs=true runs the same
padded static-buffer forward eagerly, with the triton backend under the interpreter: padding rows
(KV slot -1, length 0), bucket changes as requests finish, block tables wider than the step's and the
engine-wide max_seq_len bound of the decode kernel are all exercised. On a GPU (make bench-kernels)
the same test captures and replays real CUDA graphs."""
from __future__ import annotations

import pytest
import torch

from harness.perf.lib import models
from backend.ops.cuda_graphs import buckets
from backend.engine.executor import Executor
from backend.runtime.spec import EngineError
from backend.engine.sampling_params import SamplingParams

TINY = dict(models.LLAMA31_8B, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
            num_kv_heads=2, head_dim=32, vocab_size=512, max_position_embeddings=512)
ENGINE = {"max_batch_size": 16, "max_num_tokens": 256, "max_seq_len": 256, "max_input_len": 64,
          "kv_block_size": 16, "kv_cache_dtype": "fp8_e4m3", "max_kv_tokens": 4096,
          "attention_backend": "triton"}


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    # large weights: every output token depends on the whole context, so a KV slip changes tokens
    w = models.synthetic_fp8_weights(TINY, device="cpu", seed=3, std=0.2)
    return models.manifest_bundle(TINY, ENGINE, tmp_path_factory.mktemp("g") / "engine"), w


def _run(bundle, graphs: bool, device: str):
    path, w = bundle
    ex = Executor(path, device=device, dtype=torch.float32, weights=w, verify_hashes=False, start=False,
                  cuda_graphs=graphs)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (5, 17, 33, 3, 40)]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (6, 14, 9, 3, 11)]
    outs = [r.token_ids for r in ex.generate(prompts, params)]
    return outs, ex.runner.graphs


def test_padded_static_decode_equals_eager(bundle, device):
    eager, none = _run(bundle, False, device)
    padded, graphs = _run(bundle, True, device)
    assert none is None and graphs is not None and graphs.failed is None
    assert graphs.steps >= 10, "decode steps must have taken the static-buffer path"
    assert bool(graphs.graphs) == (device == "cuda"), "captured on a GPU, never on CPU"
    assert padded == eager


def test_buckets_cover_every_batch_size():
    sizes = buckets(256)
    assert sizes[0] == 1 and sizes[-1] == 256 and sizes == sorted(set(sizes))
    assert buckets(12)[-1] == 12 and all(s <= 12 for s in buckets(12))


def test_buckets_are_captured_up_to_the_largest_batch_that_ran():
    """max_batch_size may be far above what the KV cache lets run: a step captures its own bucket and
    the smaller ones still missing, never the buckets above it."""
    from backend.ops.cuda_graphs import DecodeGraphs
    g = DecodeGraphs(None, [], 4096, 8, 128, torch.device("cpu"), capture=False)
    first = g.decode_keys_to_capture(4, ())   # a step of 3 sequences: bucket 4
    assert [k[1] for k in first] == [1, 2, 4]
    g.graphs.update({k: None for k in first})
    assert g.captured_batch == 4
    assert [k[1] for k in g.decode_keys_to_capture(24, ())] == [8, 16, 24]
    assert [k[1] for k in g.decode_keys_to_capture(2, ())] == []
    assert [k[1] for k in g.decode_keys_to_capture(2, (5,))] == [1, 2]     # other captured layers: other graphs
    assert g.sizes[-1] == 4096 and len(g.decode_keys_to_capture(544, ())) == len(buckets(544)) - 3


def test_cuda_graphs_need_the_triton_backend(bundle, device):
    path, w = bundle
    with pytest.raises(EngineError, match="cuda_graphs: true needs engine.attention_backend triton"):
        Executor(path, device=device, weights=w, verify_hashes=False, start=False, cuda_graphs=True,
                 attention_backend="torch")
    with pytest.raises(EngineError, match="cuda_graphs: 'yes'; allowed: auto, true, false"):
        Executor(path, device=device, weights=w, verify_hashes=False, start=False, cuda_graphs="yes")


def test_the_bundles_cuda_graphs_setting_is_honoured(tmp_path):
    """engine.cuda_graphs comes from the bundle (the build writes the config key), no override needed:
    true with the torch backend is refused, so the runner must have read it."""
    path = models.manifest_bundle(TINY, {**ENGINE, "cuda_graphs": True, "attention_backend": "torch"},
                                     tmp_path / "engine")
    w = models.synthetic_fp8_weights(TINY, device="cpu", seed=3, std=0.2)
    with pytest.raises(EngineError, match="cuda_graphs: true needs engine.attention_backend triton"):
        Executor(path, device="cpu", weights=w, verify_hashes=False, start=False)
