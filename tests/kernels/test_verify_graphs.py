"""EAGLE verify passes through backend.ops.cuda_graphs' padded static buffers give the same tokens,
acceptances and draft state as eager passes.

On CPU nothing can be captured, so engine.cuda_graphs=true runs the same padded static-buffer forward
eagerly, with the triton attention backend under the interpreter (see test_decode_graphs.py). On a
GPU the same test captures and replays real graphs.

A random draft is (almost) never right, so its chains are rewritten with a planned mix: the first
``a`` drafts are the target's true greedy continuation (from a plain run), the rest are wrong. That
exercises every acceptance count, chains of different lengths in one batch (sequences with fewer
rows than the step's longest query) and the aux-layer outputs the draft is fed from.
"""
from __future__ import annotations

import pytest
import torch

from harness.perf.lib import models
from backend.engine.executor import Executor
from backend.engine.sampling_params import SamplingParams
from harness.perf.step import eagle_cost as cost
from backend.speculative.grow import TreeGrower
from backend.speculative.speculator import EagleSpeculator
from backend.speculative.tree import TokenTree

TINY = dict(models.LLAMA31_8B, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
            num_kv_heads=2, head_dim=32, vocab_size=512, max_position_embeddings=512)
# max_batch_size 6: graph buckets 1, 2, 4, 6, so the five sequences run in bucket 6 (one padding sequence:
# no query rows, length 0) and three in bucket 4 (one again). It was 8: three padding sequences of 1 + k rows
# in every step's static buffers, each row a program of every interpreted kernel, and nothing the one does not
# exercise (rows past T, sequences past t, buckets changing as requests finish).
ENGINE = {"max_batch_size": 6, "max_num_tokens": 256, "max_seq_len": 256, "max_input_len": 64,
          "kv_block_size": 16, "kv_cache_dtype": "fp8_e4m3", "max_kv_tokens": 4096,
          "attention_backend": "triton", "enable_prefix_caching": False}
K = 4
# Prompt lengths: contexts of one to four KV blocks of 16 in one batch, prompts ending one token into a new
# block (17) and sequences growing across the 16, 32 and 48 boundaries while verifying. The third was 33: every
# context here fits one attention tile (decode 64/128 keys, prefill 64), so its length only added prefill
# rows (that step runs eagerly in both modes, each row a program of the interpreted norm and quantization
# kernels: 98 rows a run, now 74). 9 agrees with 33 mod 2, 3 and 4: both plans accept the same counts as
# before (7 chain and 6 tree verify steps), and padding rows given stale slots still change the tokens in
# both (checked by hand; a 25- and 4-token pair in place of 33 and 40 let the chain run miss that).
LENS = (5, 17, 9, 3, 40)
NEW = (12, 16, 8, 14, 10)
VOCAB = TINY["vocab_size"]
TREE = [[0], [1], [0, 0], [1, 0], [0, 1], [0, 0, 0]]


class PlannedSpeculator(EagleSpeculator):
    """The real speculator (draft steps, KV, verification); only the proposed tokens are replaced.
    Chains get 1..K drafts (so q differs between sequences); static trees carry the true tokens down
    the rank-0 or the rank-1 branch (accepting rank 1 moves KV entries: the compaction path)."""

    def __init__(self, *args, oracle: dict[str, list[int]], **kw) -> None:
        super().__init__(*args, **kw)
        self.oracle = oracle
        self.drafted = []     # what the draft itself proposed, step by step (before the rewrite)

    def propose(self, out, inputs, captured, finished) -> None:
        super().propose(out, inputs, captured, finished)
        self.drafted.append(sorted((r, tuple(t.tokens)) for r, t in self._trees.items()))
        shape = self.grower.shape
        chain = all(p == i - 1 for i, p in enumerate(shape.parents))
        for s in out.scheduled:
            req = s.request
            tree = self._trees.get(req.request_id)
            if tree is None:
                continue
            n = len(req.output_token_ids)
            truth = self.oracle[req.request_id][n:n + shape.depth]
            good = 3 * n + len(req.prompt_token_ids)
            if chain:
                length = min(1 + n % K, len(truth))
                good %= length + 1
                toks = [t if i < good else (t + 1) % VOCAB for i, t in enumerate(truth[:length])]
                parents = tuple(range(-1, length))
            elif len(truth) == shape.depth:
                good %= shape.depth + 1
                toks = []
                for node in range(1, shape.num_nodes):
                    path = _ranks(shape, node)
                    right = path[0] == n % 2 and not any(path[1:]) and len(path) <= good
                    toks.append(truth[len(path) - 1] if right else (truth[len(path) - 1] + node) % VOCAB)
                parents = shape.parents
            else:
                continue      # the stream's last tokens: keep the draft's own tree
            self._trees[req.request_id] = TokenTree((tree.tokens[0], *toks), parents)
            req.spec_token_ids = toks


def _ranks(shape, node: int) -> list[int]:
    path = []
    while node > 0:
        path.append(shape.ranks[node])
        node = shape.parents[node]
    return path[::-1]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    w = models.synthetic_fp8_weights(TINY, device="cpu", seed=5, std=0.2)
    path = models.manifest_bundle(TINY, ENGINE, tmp_path_factory.mktemp("v") / "engine")
    cfg, t = models.random_draft(TINY, 128, seed=1)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in LENS]
    return path, w, cfg, t, prompts


def _executor(setup, graphs: bool, device: str) -> Executor:
    path, w, *_ = setup
    return Executor(path, device=device, dtype=torch.float32, weights=w, verify_hashes=False, start=False,
                    cuda_graphs=graphs)


def _run(ex: Executor, prompts, extra: int = 0) -> dict[str, list[int]]:
    handles = [ex.submit(p, SamplingParams(max_tokens=n + extra, temperature=0.0, ignore_eos=True), request_id=f"r{i}")
               for i, (p, n) in enumerate(zip(prompts, NEW))]
    while not all(h.finished for h in handles):
        ex.step()
    return {h.request_id: h.result().token_ids for h in handles}


def _speculative(setup, graphs: bool, device: str, oracle, tree: str = "chain"):
    _, _, cfg, t, prompts = setup
    ex = _executor(setup, graphs, device)
    draft = cost.attach_draft(ex, cfg, t)
    spec = PlannedSpeculator(draft, ex.runner.kv_caches, TreeGrower.from_settings(draft, tree, K, 1, K, TREE),
                             ex.runner, oracle=oracle)
    ex.speculator = spec
    captured_rows = []
    aux_of = spec._aux

    def recorded(captured, rows):
        aux = aux_of(captured, rows)
        captured_rows.append(aux.float().cpu())
        return aux
    spec._aux = recorded
    out = _run(ex, prompts)
    chain_graphs = spec.grower.graphs
    if graphs and tree == "chain":   # the chain draft ran as its graph too, from pooled caches
        assert chain_graphs is not None and spec.pool is not None
        assert chain_graphs.commits >= 6, "decode/verify steps feed the draft inside the graph"
        assert chain_graphs.runs > chain_graphs.commits, "prompt steps feed it eagerly, then grow in the graph"
    else:
        assert chain_graphs is None and spec.pool is None
    return out, spec.stats, ex.runner.graphs, torch.cat(captured_rows), spec.drafted


@pytest.fixture(scope="module")
def oracle(setup, device):
    """The target's greedy continuations (plain decoding, eager), K tokens longer than the runs."""
    return _run(_executor(setup, False, device), setup[4], extra=K)


@pytest.mark.parametrize("tree", ["chain", "static"])
def test_graphed_verify_equals_eager(setup, device, oracle, tree):
    eager_out, eager_stats, none, eager_aux, eager_drafts = _speculative(setup, False, device, oracle, tree)
    graph_out, graph_stats, graphs, graph_aux, graph_drafts = _speculative(setup, True, device, oracle, tree)
    assert none is None and graphs is not None and graphs.failed is None
    # the plan makes verification accept every count: the test would not see a KV slip otherwise
    depth = K if tree == "chain" else 3
    assert set(eager_stats.accept_hist) == set(range(depth + 1)), eager_stats.accept_hist
    assert eager_out == {rid: toks[:n] for (rid, toks), n in zip(oracle.items(), NEW)}
    assert graphs.verify_steps >= 6, "verify passes must have taken the static-buffer path"
    assert {q for q, *_ in graphs.graphs} <= set(range(1, len(TREE) + 2))
    if tree == "chain":     # chains never need the tree-mask kernel (a static tree cut short may be a chain)
        assert not any(tr for *_, tr in graphs.graphs)
    assert bool(graphs.graphs) == (device == "cuda"), "captured on a GPU, never on CPU"
    assert graph_out == eager_out
    assert graph_stats.as_dict() == eager_stats.as_dict()
    # the aux layers fed to the draft come out of the static buffers: same rows, same values
    assert graph_aux.shape == eager_aux.shape
    torch.testing.assert_close(graph_aux, eager_aux, rtol=1e-4, atol=1e-4)
    # and the draft, fed inside its graph from the pooled cache, proposes what it proposes eagerly
    assert graph_drafts == eager_drafts
