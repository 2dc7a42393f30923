"""The EAGLE-3 draft as its own graph, ``draft.onnx`` (#21), checked without TensorRT.

The eagle tests' CI-sized bundle (the real SmolLM2 target, a draft trained by ModelOpt for 24 steps:
tests/eagle/conftest.py) built again with ``tensorrt.enabled=true``: the compile stage writes
``draft.onnx`` beside ``decoder.onnx``, its weights byte ranges of ``draft/weights.safetensors`` and of
the target's ``weights.safetensors`` (the token embedding). onnx's checker accepts it with its weights,
and onnx's ReferenceEvaluator running it (the decoder graph's two Kiln nodes by the kernels' PyTorch
references, evaluated in float32 like engine.runtime onnx-reference) gives the native draft's logits and
pre-norm outputs in float32, over a prefill-like step fed by the target's aux layers and over a
tree-masked step fed by the draft's own outputs. The draft stage is the eagle build's (copied before
the build: its stage key does not include the tensorrt section), so this costs one compile stage.
"""
from __future__ import annotations

import json
import shutil
import struct

import pytest
import torch

from tests.runtime.graph_helpers import TEXT as GRAPH_TEXT

pytestmark = pytest.mark.slow

TEXT = GRAPH_TEXT[:GRAPH_TEXT.index(" Within")]   # its first sentence
TREE = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)


@pytest.fixture(scope="module")
def draft_bundle(build_bundle):
    from builder.config import BuildConfig
    from tests.conftest import CACHE, _config_path
    from tests.eagle.conftest import eagle_overrides
    name, base = "smollm2-135m-bf16-eagle3", eagle_overrides(verify=False)
    trt = base + ["tensorrt.enabled=true"]
    cfg = BuildConfig.from_yaml(_config_path(name), trt)
    work = CACHE / f"{_config_path(name).stem}-{cfg.config_hash()[:12]}" / "work" / "draft"
    if not work.exists():   # the eagle build's trained draft: same stage key, no second training
        shutil.copytree(build_bundle(name, base).parent / "work" / "draft", work)
    return build_bundle(name, trt)


def _meta(positions, slots, ctx: int, tree=None):
    from backend.ops.attention.metadata import AttentionMetadata
    i32, n = torch.int32, len(positions)
    return AttentionMetadata(
        positions=torch.as_tensor(positions), slot_mapping=torch.as_tensor(slots),
        block_tables=torch.arange(8, dtype=i32)[None], seq_lens=torch.tensor([ctx + n], dtype=i32),
        query_start_loc=torch.tensor([0, n], dtype=i32), context_lens=torch.tensor([ctx], dtype=i32),
        num_prefills=0, num_prefill_tokens=0, num_decode_tokens=n, max_query_len=n, max_seq_len=ctx + n,
        tree_mask=tree)


def test_draft_graph_is_in_the_bundle_and_points_into_its_weights(draft_bundle):
    import onnx
    from backend import bundle as b
    from backend.runtime import graph_io
    m = b.read(draft_bundle)
    assert m.tensorrt.draft_graph == "draft.onnx" and "draft.onnx" in m.files
    assert json.loads((draft_bundle / "engine.json").read_text())["tensorrt"]["draft_graph"] == "draft.onnx"
    b.load_bundle(draft_bundle, verify_hashes=True)
    onnx.checker.check_model(str(draft_bundle / "draft.onnx"), full_check=True)
    model = onnx.load(str(draft_bundle / "draft.onnx"), load_external_data=False)
    assert [v.name for v in model.graph.input] == ([n for n, _, _ in graph_io.DRAFT_INPUTS]
                                                   + [graph_io.DRAFT_K_CACHE, graph_io.DRAFT_V_CACHE])
    assert [v.name for v in model.graph.output] == [graph_io.DRAFT_LOGITS, graph_io.DRAFT_HIDDEN_OUT,
                                                    graph_io.DRAFT_K_CACHE_OUT, graph_io.DRAFT_V_CACHE_OUT]
    assert [n.op_type for n in model.graph.node if n.domain == "kiln"] == ["kiln_rope_kv_write", "kiln_paged_prefill"]
    # the decoder graph now outputs the draft's aux layers
    decoder = onnx.load(str(draft_bundle / "decoder.onnx"), load_external_data=False)
    assert [o.name for o in decoder.graph.output if o.name.startswith("hidden.")] == ["hidden.1", "hidden.14", "hidden.26"]
    # every weight is a byte range of the file it lives in (no copies): the draft's, or the target's embedding
    files = {}
    for t in model.graph.initializer:
        if t.external_data:
            e = {x.key: x.value for x in t.external_data}
            files.setdefault(e["location"], {})[t.name] = (int(e["offset"]), int(e["length"]))
    assert set(files) == {"weights.safetensors", "draft/weights.safetensors"}
    assert set(files["weights.safetensors"]) == {"embed_tokens.weight"}
    assert {"draft.fc.weight", "draft.lm_head.weight", "draft.layers.0.self_attn.q_proj.weight"} <= set(files["draft/weights.safetensors"])
    assert "draft.d2t" not in files["draft/weights.safetensors"]    # the id map is the host's
    for location, refs in files.items():
        raw = (draft_bundle / location).read_bytes()
        n = struct.unpack("<Q", raw[:8])[0]
        header = json.loads(raw[8:8 + n])
        for name, got in refs.items():
            start, end = header[name.removeprefix("draft.")]["data_offsets"]
            assert got == (8 + n + start, end - start), name
    assert (draft_bundle / "draft.onnx").stat().st_size < 2 << 20


def test_draft_graph_equals_the_native_draft(draft_bundle):
    """fp32 both: a prefill-like step (the prompt's entries, fed through fc from the target's captured aux
    layers) and a tree-masked step of 4 entries fed by the draft's own outputs, each against
    ``Eagle3Draft`` on the same cache contents."""
    from backend.runtime.native import ModelRunner, prefill_meta
    from backend.runtime.spec import load_engine_spec
    from backend.serving.conversion.tokenizer import load_tokenizer
    from backend.speculative.checkpoint import read_bundle_draft
    from backend.speculative.draft_model import Eagle3Draft
    from backend.speculative.draft_onnx import OnnxDraftGraph
    spec = load_engine_spec(draft_bundle, dict(max_kv_tokens=512))
    target = ModelRunner(spec, dtype=torch.float32)
    cfg, tensors = read_bundle_draft(draft_bundle / "draft")
    native = Eagle3Draft(cfg, tensors, target.model.embed_tokens, None, 4096, "cpu", torch.float32)
    graph = OnnxDraftGraph(draft_bundle, num_blocks=8)
    assert graph.k_cache.dtype == torch.float32 and graph.block_size == 16

    ids = load_tokenizer(draft_bundle / "tokenizer").encode(TEXT)
    t = len(ids)
    _, captured = target.execute(torch.tensor(ids), prefill_meta(t, 16, torch.device("cpu")), torch.arange(t),
                                 tuple(cfg.aux_layers))
    aux = torch.cat([captured[i] for i in cfg.aux_layers], -1)[:t - 1]   # entry p: hidden at p, token p + 1
    tokens, n = torch.tensor(ids[1:]), t - 1
    cache = native.new_cache(64)
    want_h = native.step(native.fuse(aux), tokens, torch.arange(n), cache, 0)
    want = native.logits(want_h)
    got, got_h = graph.run(tokens, aux, None, _meta(torch.arange(n), torch.arange(n), 0), torch.arange(n))
    assert got.shape == (n, cfg.draft_vocab_size) and got_h.shape == (n, cfg.hidden_size)
    assert (got - want).abs().max() < 2e-3 and (got_h - want_h).abs().max() < 2e-3
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    # the graph wrote the draft's keys and values into its pool, as the native draft into its cache
    assert (graph.k_cache.view(-1, *graph.k_cache.shape[2:])[:n] - cache.k[:n]).abs().max() < 1e-3
    cache.length = n

    # a tree of 4 entries past the committed rows: root, two children, a grandchild under the first
    feats = want_h[[-1, -4, -8, -12]]
    draft_tokens = torch.tensor(ids[1:5])
    pos = n + torch.tensor([0, 1, 1, 2])
    slots = torch.arange(n, n + 4)
    want_t = native.logits(native.step(feats, draft_tokens, pos, cache, n, TREE))
    got_t, _ = graph.run(draft_tokens, None, feats, _meta(pos, slots, n, TREE), torch.arange(4))
    assert (got_t - want_t).abs().max() < 2e-3
    # the same entries without the mask (causal among them): the graph follows the native draft there
    # too, and the two answers differ by well over the tolerance, so a mask ignored fails the check above
    want_c = native.logits(native.step(feats, draft_tokens, pos, cache, n))
    got_c, _ = graph.run(draft_tokens, None, feats, _meta(pos, slots, n), torch.arange(4))
    assert (got_c - want_c).abs().max() < 2e-3
    assert (want_c[2:] - want_t[2:]).abs().max() > 1e-2, "the tree mask changed nothing"


def test_speculation_through_the_graphs_gives_the_native_tokens(draft_bundle):
    """engine.runtime onnx-reference with the bundle's draft attached: the target's verify steps through
    decoder.onnx, the draft's steps through draft.onnx (backend/speculative/draft_onnx.py GraphDraft).
    Greedy, fp32: the tokens equal native speculation's and plain decoding's, and the draft proposed and
    got accepted exactly what the native draft did (so the graphs really drafted, and drafted the same)."""
    from backend.engine.executor import Executor
    from backend.engine.sampling_params import SamplingParams
    from backend.speculative.draft_onnx import GraphDraft
    prompts = [[1, 504, 3458, 282, 4600, 314], [1, 9690, 1345, 28]]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    runs = {}
    for runtime, dtype in (("native", torch.float32), ("onnx-reference", None)):
        ex = Executor(draft_bundle, start=False, dtype=dtype, runtime=runtime, max_kv_tokens=2048)
        try:
            assert ex.speculator is not None
            assert isinstance(ex.speculator.draft, GraphDraft) == (runtime == "onnx-reference")
            res = ex.generate(prompts, params)
            runs[runtime] = [r.token_ids for r in res], [ex.speculator.request_stats(r.request_id) for r in res]
            if runtime == "native":   # plain decoding (the graph runtime's equals it: test_onnx_graph.py)
                plain = [r.token_ids for r in ex.generate(prompts, params.replace(speculative=False))]
        finally:
            ex.shutdown()
    (tok_n, stats_n), (tok_g, stats_g) = runs["native"], runs["onnx-reference"]
    assert tok_g == tok_n == plain and all(len(t) == 8 for t in tok_g)
    assert stats_g == stats_n and sum(s["draft_tokens_accepted"] for s in stats_g) > 0, stats_g
