"""Tensor-parallel Llama on ``torch.distributed``: one process per rank (gloo on CPU, NCCL on GPUs).

Each rank runs ``backend.model.llama``'s own layer code on the model ``tp_shard.shard_config`` gives
(heads/tp, KV heads/tp, intermediate/tp) over its shard of the weights (its ``rank<r>.safetensors``
in a bundle built with engine.tp_size, else ``tp_shard.shard_weights`` of the single file);
only the seams where partial results meet differ, Megatron-LM style:

- embedding: each rank looks up the ids in its vocab range (zeros elsewhere), then one all-reduce;
- ``o`` and ``down`` are row-parallel: partial sums all-reduced, the bias added once after the reduce
  (``TPLlamaModel.row_linear``, the hook both of llama.py's layer paths compute those products in);
- logits: each rank computes its vocab slice for the rows asked; rank 0 gathers them (the sampler
  lives there), the other ranks get None.

Ranks hold their own KV cache (``[blocks, block_size, kv_heads/tp, head_dim]``, or one KV head where
there are fewer than ranks: the one the rank's query heads read, replicated) with the same block ids,
so rank 0's scheduler decides for all. The attention backend is chosen as for one device
(``runner.attention_backend``: the fused Triton layer on GPUs), and decode steps go through CUDA
graphs there (``runner.decode_graphs``) with the all-reduces captured inside: every rank captures and
replays the same graphs in the same order, since each gets the same step inputs (see ``DecodeGraphs``).
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from backend.bundle_schema import ModelConfig
from backend.model.llama import LlamaModel
from backend.runtime.kv_plan import kv_cache_dtypes, plan_kv_blocks, zeroed
from backend.runtime.native import attention_backend, decode_graphs, load_weights, step_hidden
from backend.runtime.spec import EngineError, EngineSpec
from backend.runtime.runtimes import StepRunner
from backend.runtime.tp_shard import shard_config, shard_weights
from backend.ops import cpu_matmul
from backend.ops.linear import QuantLinear


class TPLlamaModel(LlamaModel):
    """``LlamaModel`` for one rank: built from its shard, same ``forward``/``compute_logits`` seam."""

    def __init__(self, config: ModelConfig, shard: dict[str, torch.Tensor], quant_format: str,
                 attention, device: torch.device | str = "cpu", dtype: torch.dtype | None = None, *,
                 tp_size: int, rank: int, group: dist.ProcessGroup | None = None) -> None:
        super().__init__(shard_config(config, tp_size), shard, quant_format, attention, device,
                         dtype or config.torch_dtype)
        self.full_config = config
        self.tp_size, self.rank, self.group = tp_size, rank, group
        self.vocab_start = rank * self.config.vocab_size
        # The row-parallel linears' biases, taken off them (by the linear's id) and added once, after
        # the all-reduce: left on, every rank's partial sum would carry one and the sum tp of them.
        self._row_bias: dict[int, torch.Tensor] = {}
        for layer in self.layers:
            for lin in (layer.o, layer.down):
                if lin.bias is not None:
                    self._row_bias[id(lin)], lin.bias = lin.bias, None

    def row_linear(self, linear: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        """``o``/``down`` on this rank's input columns (``x [T, in/tp]``, fp8 codes when a fused kernel
        quantized it) -> the whole product ``[T, out]``: partial sums all-reduced, then the bias. The
        one place both layer paths (plain and fused) meet the other ranks inside a layer; under a
        CUDA graph the all-reduce is captured with the kernels around it."""
        y = super().row_linear(linear, x).contiguous()
        dist.all_reduce(y, group=self.group)
        bias = self._row_bias.get(id(linear))
        return y if bias is None else y + bias

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """LlamaModel.forward's embedding, vocab-parallel: exact, since every id is found on one rank and zeros elsewhere."""
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.config.vocab_size)
        hidden = F.embedding(torch.where(mine, local, torch.zeros_like(local)), self.embed_tokens)
        hidden = hidden.masked_fill(~mine.unsqueeze(-1), 0).contiguous()
        dist.all_reduce(hidden, group=self.group)
        return hidden

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """``hidden [N, H]`` (same on every rank) -> fp32 ``[N, vocab]`` on rank 0, None elsewhere:
        only the sampler's rank needs the whole rows, so a gather, not an all-gather."""
        local = cpu_matmul.linear(hidden, self.lm_head).float().contiguous()
        dst = 0 if self.group is None else dist.get_global_rank(self.group, 0)
        if self.rank != 0:
            dist.gather(local, None, dst=dst, group=self.group)
            return None
        parts = [torch.empty_like(local) for _ in range(self.tp_size)]
        dist.gather(local, parts, dst=dst, group=self.group)
        return torch.cat(parts, dim=-1)


class TPRunner(StepRunner):
    """One rank's model and KV cache; ``execute`` has ``ModelRunner.execute``'s signature and returns
    the logits on rank 0 (None on the others). Every rank must call it with the same inputs."""

    def __init__(self, spec: EngineSpec, tp_size: int, rank: int, num_blocks: int | None,
                 group: dist.ProcessGroup | None = None, dtype: torch.dtype | None = None,
                 weights: dict[str, torch.Tensor] | None = None, shard: dict[str, torch.Tensor] | None = None,
                 device: str | torch.device = "cpu") -> None:
        """``device``: this rank's (one GPU per rank, or the CPU). ``num_blocks`` None: planned here from
        the GPU's free memory once the weights are in, the smallest over the ranks (collective)."""
        self.spec, self.device = spec, torch.device(device)
        # as ModelRunner picks it: auto = the triton backend (fused layer, AOT cubins) on a GPU
        backend_name, self.attention = attention_backend(spec, self.device)
        if shard is None:
            shard = _rank_weights(spec, tp_size, rank, weights)
        self.model = TPLlamaModel(spec.model, shard, spec.quant_format, self.attention, self.device, dtype,
                                  tp_size=tp_size, rank=rank, group=group)
        del shard   # the model holds its own (device, dtype) copies
        recorded, held = spec.engine.kv_heads_per_rank, self.model.config.num_kv_heads
        if recorded is not None and recorded != held:
            raise EngineError(f"engine.kv_heads_per_rank: {recorded} in engine.json, but tp_size={tp_size} gives each "
                              f"rank {held} of the model's {spec.model.num_kv_heads} KV heads; rebuild the bundle")
        if self.model.bound_windows(spec.engine.max_seq_len) and not self.attention.sliding_window:
            raise EngineError(f"engine.max_seq_len: {spec.engine.max_seq_len} exceeds the model's sliding window, "
                              f"which the {backend_name} attention backend does not implement yet; allowed: "
                              f"engine.attention_backend=torch")
        self.dtype = self.model.dtype
        self.kv_dtype, storage = kv_cache_dtypes(spec, self.dtype, self.device, self.attention)
        c = self.model.config
        self.block_size = spec.engine.kv_block_size
        if num_blocks is None:
            num_blocks = self._agreed_blocks(storage, group)
        self.num_blocks = num_blocks
        shape = (num_blocks, self.block_size, c.num_kv_heads, c.head_dim)
        self.kv_caches = [(zeroed(shape, storage, self.device), zeroed(shape, storage, self.device))
                          for _ in range(c.num_layers)]
        # engine.cuda_graphs as on one device; a capture that fails on any rank sends every rank eager
        self.graphs = decode_graphs(spec, self.model, self.kv_caches, backend_name, self.device,
                                    agree=lambda failure: _agree_failure(failure, self.device, group))

    def _agreed_blocks(self, storage: torch.dtype, group: dist.ProcessGroup | None) -> int:
        """Each rank's KV plan from its own device's free memory, then the smallest of them: rank 0's
        block ids must exist on every rank, and GPUs may hold other things."""
        if self.device.type != "cuda":
            raise EngineError("TPRunner: num_blocks must be given on CPU (tp_driver.plan_kv_blocks)")
        free = torch.cuda.mem_get_info(self.device)[0]
        mine = plan_kv_blocks(self.spec, storage, self.model.config.num_kv_heads, free)
        agreed = torch.tensor([mine], dtype=torch.int64, device=self.device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
        return int(agreed.item())

    @torch.inference_mode()
    def execute(self, input_ids: torch.Tensor, meta, logits_indices: torch.Tensor,
                capture_hidden_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor | None, dict[int, torch.Tensor]]:
        hidden, captured = step_hidden(self.graphs, self.model, self.kv_caches, input_ids, meta,
                                       capture_hidden_layers)
        return self.model.compute_logits(hidden.index_select(0, logits_indices)), captured


def _agree_failure(failure: str | None, device: torch.device, group: dist.ProcessGroup | None) -> str | None:
    """A CUDA graph capture's outcome agreed over the group (``DecodeGraphs``' ``agree``), so that no
    rank replays graphs while another runs the step eagerly: whether NCCL pairs a replayed collective
    with an eager one is nothing this code should depend on; all ranks eager together is plainly right.
    (A rank whose warm-up itself raises is not covered: its peers wait in that step's collectives, as
    they would for any step that raises on one rank.)"""
    flag = torch.tensor([failure is not None], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if failure is None and int(flag.item()):
        return "CUDA graph capture failed on another tensor-parallel rank"
    return failure


def _rank_weights(spec: EngineSpec, tp_size: int, rank: int,
                  weights: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s tensors. A bundle built with engine.tp_size has them in rank<rank>.safetensors:
    only that file is read. A single-file bundle run with an engine.tp_size override (or ``weights``
    given) is read whole and split here, its share kept."""
    files = spec.manifest.weights
    if weights is None and len(files) > 1:
        if len(files) != tp_size:
            raise EngineError(f"{spec.path}: its weights are split for tp_size={len(files)} "
                              f"({files[0]} ..); tp_size={tp_size} cannot load them; allowed: engine.tp_size "
                              f"{len(files)}, or rebuild with engine.tp_size={tp_size}")
        from safetensors.torch import load_file
        return load_file(str(Path(spec.path) / files[rank]), device="cpu")
    full = weights if weights is not None else load_weights(Path(spec.path), torch.device("cpu"))
    return shard_weights(full, spec.model, spec.quant_format, tp_size, rank)


def _entry(rank: int, fn: Callable[..., Any], tp_size: int, store: str, args: tuple) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=tp_size)
    # tp processes share the host's cores: without this each would start one thread per core
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp_size))
    try:
        fn(rank, tp_size, *args)
    finally:
        dist.destroy_process_group()


def spawn(fn: Callable[..., Any], tp_size: int, args: tuple = ()) -> None:
    """Run ``fn(rank, tp_size, *args)`` in ``tp_size`` fresh processes joined in one gloo group (a file
    store in a private temporary folder: no port to find, nothing left behind). ``fn`` must be
    importable by name (a module-level function); a rank that raises makes this raise."""
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory(prefix="kiln-tp-") as tmp:
        mp.spawn(_entry, args=(fn, tp_size, str(Path(tmp) / "store"), args), nprocs=tp_size, join=True)
