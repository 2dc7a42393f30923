"""The bundle's ``draft.onnx`` (the EAGLE-3 head as its own graph) run by onnx's ReferenceEvaluator.

The draft's counterpart of backend/runtime/onnx_runner.py, and built from its parts: the graph loaded
with its external data and its compute-dtype casts retargeted (float32 by default, for parity with the
native draft in float32), the weight conversions folded once, the two Kiln nodes backed by the kernels'
PyTorch references (backend/runtime/onnx_ops.py). It owns the draft's paged KV pool and hands it to the
graph as inputs, as a TensorRT runner would bind it. CPU only, slow: it proves the graph.

Inputs and outputs: backend/runtime/graph_io.py ``DRAFT_*``. The graph returns logits over the DRAFT
vocabulary; mapping the ids the caller picks to target ids (``d2t``) stays the caller's, as with the
native draft (``Eagle3Draft.to_target_ids``).

``GraphDraft`` puts the graph behind the part of ``Eagle3Draft``'s interface the speculator and the
growers call (``fuse``, ``step_many``, ``logits``, ``to_target_ids``, ``new_cache``), so speculation runs
unchanged with ``engine.runtime: onnx-reference``. Two differences the adapter absorbs: the graph's fc
runs inside the step (``fuse`` only marks its rows), and the graph's logits come out of the step that
made the pre-norm outputs (``logits`` looks them up by the rows' values: a pure function of them).
The paged attention node sees all of a sequence's context rows, so an entry may not skip an earlier
tentative row: chains only (every earlier entry is an ancestor); other tree shapes are refused.
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch

from backend.runtime import graph_io
from backend.runtime.onnx_runner import fold_constants, load_graph
from backend.speculative.checkpoint import DraftConfig
from backend.speculative.draft_model import DraftKV, DraftKVPool, DraftSlice


class OnnxDraftGraph:
    def __init__(self, bundle_dir: Path, num_blocks: int, graph: Path | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        from onnx.reference import ReferenceEvaluator
        from backend.runtime.onnx_ops import CUSTOM_OPS
        self.path = graph or Path(bundle_dir) / graph_io.DRAFT_GRAPH
        if not self.path.is_file():
            raise FileNotFoundError(f"{self.path}: the bundle has no draft graph; rebuild it with "
                                    f"OVERRIDES=\"tensorrt.enabled=true\" (speculative.method=eagle3)")
        self.dtype = dtype
        model = load_graph(self.path, Path(bundle_dir), dtype)
        dims = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in model.graph.input}
        _, self.block_size, kv_heads, head_dim = dims[graph_io.DRAFT_K_CACHE]
        self.hidden_size = dims["draft_hidden"][1]
        self.aux_width = dims["aux_hidden"][1]
        self.constants = fold_constants(model)
        self.session = ReferenceEvaluator(model, new_ops=CUSTOM_OPS)
        shape = (num_blocks, self.block_size, kv_heads, head_dim)
        self.k_cache, self.v_cache = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, aux_hidden: torch.Tensor | None, draft_hidden: torch.Tensor | None,
            meta, logits_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step: ``input_ids [T]``; features ``aux_hidden [A, aux_width]`` (rows ``[0, A)``,
        through fc) then ``draft_hidden [T - A, hidden]`` (either may be None: no rows); ``meta`` the
        step's positions, slots, block tables and tree mask in the draft's pool (an AttentionMetadata).
        -> (fp32 draft-vocabulary logits ``[rows, Vd]``, pre-norm outputs ``[T, hidden]``)."""
        from backend.runtime.onnx_ops import to_numpy, to_torch
        if aux_hidden is None:
            aux_hidden = torch.zeros((0, self.aux_width), dtype=self.dtype)
        if draft_hidden is None:
            draft_hidden = torch.zeros((0, self.hidden_size), dtype=self.dtype)
        assert aux_hidden.shape[0] + draft_hidden.shape[0] == input_ids.shape[0], (aux_hidden.shape, draft_hidden.shape)
        feeds = dict(self.constants)
        feeds |= {k: to_numpy(v.contiguous()) for k, v in graph_io.step_feeds(input_ids, meta, logits_indices).items()}
        feeds["aux_hidden"] = to_numpy(aux_hidden.to(self.dtype).contiguous())
        feeds["draft_hidden"] = to_numpy(draft_hidden.to(self.dtype).contiguous())
        feeds[graph_io.DRAFT_K_CACHE], feeds[graph_io.DRAFT_V_CACHE] = to_numpy(self.k_cache), to_numpy(self.v_cache)
        logits, hidden = self.session.run([graph_io.DRAFT_LOGITS, graph_io.DRAFT_HIDDEN_OUT], feeds)
        return to_torch(logits).float(), to_torch(hidden)


class _AuxRows:
    """``GraphDraft.fuse``'s result: the target's aux rows, through fc inside the next step."""

    def __init__(self, aux: torch.Tensor) -> None:
        self.aux = aux

    @property
    def shape(self):
        return self.aux.shape

    def index_select(self, dim: int, index: torch.Tensor) -> "_AuxRows":
        return _AuxRows(self.aux.index_select(dim, index))


class GraphDraft:
    """The EAGLE-3 draft through ``draft.onnx``, for the speculator (see the module docstring)."""

    _KEEP = 4096   # remembered logits rows (a step's committed rows and trees hold far fewer)

    def __init__(self, bundle_dir: Path, cfg: DraftConfig, d2t: torch.Tensor | None, slots: int,
                 max_seq_len: int, dtype: torch.dtype = torch.float32) -> None:
        self.cfg, self.device, self.dtype = cfg, torch.device("cpu"), dtype
        # one slot per running sequence; entries reach max_seq_len + a tree's depth
        self.pool = DraftKVPool(slots, max_seq_len + 64, cfg.num_kv_heads, cfg.head_dim, dtype, self.device)
        self.graph = OnnxDraftGraph(bundle_dir, 1, dtype=dtype)
        assert self.graph.block_size == self.pool.block_size, (self.graph.block_size, self.pool.block_size)
        self.graph.k_cache, self.graph.v_cache = self.pool.paged()   # the graph writes the pool itself
        self.d2t_ids = None
        if d2t is not None and cfg.draft_vocab_size < cfg.vocab_size:
            self.d2t_ids = torch.arange(cfg.draft_vocab_size) + d2t.long()
        self._logits: dict[bytes, torch.Tensor] = {}

    def new_cache(self, capacity: int = 0) -> DraftKV:
        cache = self.pool.acquire()
        if cache is None:
            raise RuntimeError(f"draft.onnx: all {self.pool.scratch} draft cache slots are taken "
                               f"(engine.max_batch_size running sequences)")
        return cache

    def fuse(self, aux: torch.Tensor) -> _AuxRows:
        return _AuxRows(aux)

    def step_many(self, feats, tokens: torch.Tensor, positions: torch.Tensor, slices: list[DraftSlice]) -> torch.Tensor:
        n = tokens.shape[0]
        assert sum(sl.n for sl in slices) == n and all(sl.cache.slot >= 0 for sl in slices)
        cap = self.pool.capacity
        slot_mapping, tree, qsl, r = [], None, [0], 0
        for sl in slices:
            slot_mapping.append(sl.cache.slot * cap + torch.arange(sl.write_at, sl.write_at + sl.n))
            if sl.mask is not None:
                past = sl.write_at - sl.cache.length
                if not bool(sl.mask[:, :past].all()):
                    raise NotImplementedError("draft.onnx: a tree entry that skips an earlier tentative row; "
                                              "allowed with engine.runtime onnx-reference: speculative.tree chain")
                if tree is None:
                    tree = torch.ones(n, max(s.n for s in slices), dtype=torch.bool)
                tree[r:r + sl.n, :sl.n] = sl.mask[:, past:].to(torch.bool)
            r += sl.n
            qsl.append(r)
        meta = SimpleNamespace(
            positions=positions.to(torch.int64), slot_mapping=torch.cat(slot_mapping),
            block_tables=self.pool.block_tables(torch.tensor([sl.cache.slot for sl in slices])),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            context_lens=torch.tensor([sl.write_at for sl in slices], dtype=torch.int32), tree_mask=tree)
        aux = feats.aux if isinstance(feats, _AuxRows) else None
        logits, h = self.graph.run(tokens.to(torch.int64), aux, None if aux is not None else feats, meta,
                                   torch.arange(n))
        if len(self._logits) + n > self._KEEP:
            self._logits.clear()
        for row, lg in zip(h, logits):
            self._logits[_key(row)] = lg
        return h

    def logits(self, prenorm: torch.Tensor) -> torch.Tensor:
        """The logits the graph gave with these pre-norm outputs (rows of earlier ``step_many`` results)."""
        try:
            return torch.stack([self._logits[_key(row)] for row in prenorm])
        except KeyError:
            raise AssertionError("draft.onnx: logits asked for rows no recent step produced") from None

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.d2t_ids is None else self.d2t_ids[draft_ids]


def _key(row: torch.Tensor) -> bytes:
    return row.detach().contiguous().numpy().tobytes()


__all__ = ["GraphDraft", "OnnxDraftGraph"]
