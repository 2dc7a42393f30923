"""A bundle's decoder run one layer at a time over a fixed set of prompts (teacher-forced prefills).

    lw = LayerwiseRunner(spec)                  # reads no weights yet
    hidden = lw.embed(prompts)                  # [T_p, H] per prompt
    for i in range(spec.model.num_layers):
        lw.run_layer(i, hidden)                 # layer i's tensors read, run on every prompt, dropped
    for logits in lw.logits(hidden): ...        # fp32 [T_p, vocab] per prompt

What the verify stage runs at scale: ``ModelRunner`` holds every layer, this holds one (plus the
prompts' hidden states), so its memory does not grow with depth. The arithmetic is ModelRunner's on
the torch attention backend, shape for shape: each prompt is one prefill of its own (the layer's
``build_layer`` and ``decoder_layer``, the KV storage of ``kv_cache_dtypes``, the same rope tables,
embedding, final norm and ``compute_logits`` head), so the logits equal ``prefill_logits``' of a
runner in the same dtype, bit for bit.

Each read opens ``weights.safetensors`` (or every rank file of a tensor-parallel bundle), copies the tensors it needs and closes it: a handle kept
open keeps every page read through its memory map resident (see builder/weights.py's Checkpoint).
"""
from __future__ import annotations

import math
from typing import Iterator

import torch
import torch.nn.functional as F

from backend.model import decoder_parts
from backend.model.layers import RotaryEmbedding, rms_norm
from backend.model import spec_layer
from backend.model.llama import build_layer, decoder_layer
from backend.runtime.kv_plan import FP8_KV_NEEDS_SCALES, kv_cache_dtypes
from backend.runtime.native import prefill_meta
from backend.runtime.spec import EngineError, EngineSpec
from backend.ops import cpu_matmul
from backend.ops.attention import get_backend, resolve_backend_name


class LayerwiseRunner:
    def __init__(self, spec: EngineSpec, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, attention: str | None = None) -> None:
        """``attention``: the backend's name, else the bundle's engine.attention_backend (resolved for
        ``device``); only the torch backend runs layer by layer."""
        self.spec, self.config = spec, spec.model
        self.device, self.dtype = torch.device(device), dtype
        backend = resolve_backend_name(attention or spec.engine.attention_backend, str(self.device))
        if backend != "torch":
            # the fused path (triton backend) runs other kernels per layer: not what decoder_layer runs
            raise EngineError(f"engine.attention_backend: {backend} resolves to fused kernels, which the "
                              f"layer-by-layer runner does not run; allowed here: auto (on a CPU) or torch")
        plan = spec_layer.plan_of(self.config.arch_spec, self.config)
        if not plan.plain or len(set(plan.rope_of)) > 1:
            # it runs llama.py's decoder_layer with one rope table: not the spec layer's norms and ropes
            raise EngineError("engine.json: model.arch: this architecture's layer (its norms, activation or "
                              "per-kind ropes) is not run layer by layer yet; allowed: the Llama layer")
        self.attention = get_backend("torch", str(self.device))
        self.kv_dtype, self.kv_storage_dtype = kv_cache_dtypes(spec, dtype, self.device, self.attention)
        self.scale = 1.0 / math.sqrt(self.config.head_dim)
        # a tensor-parallel bundle's rank files are read together and put back whole (tp_shard)
        self._files = [spec.path / w for w in spec.manifest.weights]
        self._weights = self._files[0]
        for f in self._files:
            if not f.is_file():
                raise EngineError(f"{f}: not found; rebuild with: make build CONFIG=...")
        self._lengths: list[int] = []
        c = self.config
        # LlamaModel's tables, all positions: a shorter table could round its last rows otherwise
        # (a vectorized cos over the body of a tensor, a scalar one over its tail)
        arch = c.arch_spec
        decoder_parts.check_spec(arch)
        self._rope = RotaryEmbedding(c.head_dim, c.max_position_embeddings, *decoder_parts.rope_args(c, arch),
                                     self.device)

    def _read(self, names: list[str] | None = None, prefix: str = "") -> dict[str, torch.Tensor]:
        from safetensors import safe_open
        if len(self._files) > 1:
            from backend.runtime.tp_shard import load_unsharded
            try:
                return load_unsharded(self._files, self.config, names, prefix, device=str(self.device))
            except KeyError as exc:
                raise EngineError(f"{exc.args[0]}; rebuild with: make build CONFIG=...") from None
        with safe_open(str(self._weights), "pt", device=str(self.device)) as f:
            names = names if names is not None else [n for n in f.keys() if n.startswith(prefix)]
            missing = [n for n in names if n not in f.keys()]
            if missing:
                raise EngineError(f"{self._weights}: missing tensor {missing[0]!r}; rebuild with: make build CONFIG=...")
            return {n: f.get_tensor(n) for n in names}

    def embed(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        """Token ids per prompt -> its embedded rows ``[T_p, H]`` in the compute dtype."""
        table = self._read(["embed_tokens.weight"])["embed_tokens.weight"]
        # rows cast after the lookup: the same values as LlamaModel's lookup in a table cast first,
        # without a second copy of the vocabulary in the compute dtype
        hidden = [F.embedding(torch.tensor(ids, device=self.device), table).to(self.dtype) for ids in prompts]
        self._lengths = [len(ids) for ids in prompts]
        return hidden

    @torch.inference_mode()
    def run_layer(self, i: int, hidden: list[torch.Tensor]) -> None:
        """Replace every prompt's hidden states by layer ``i``'s output; only layer ``i`` is read."""
        c, bs = self.config, self.spec.engine.kv_block_size
        arch = c.arch_spec
        layer = build_layer(self._read(prefix=f"layers.{i}."), i, self.spec.quant_format, self.dtype, self.device,
                            experts=arch.experts if arch else None)
        if self.kv_dtype == torch.float8_e4m3fn and layer.k_scale is None:
            raise EngineError(FP8_KV_NEEDS_SCALES)
        shape = (-(-max(self._lengths) // bs), bs, c.num_kv_heads, c.head_dim)
        # one cache for every prompt, like prefill_logits' reuse of the runner's blocks 0..: slots past a
        # prompt's length hold another prompt's (finite) keys, which attention masks out
        kv = (torch.zeros(shape, dtype=self.kv_storage_dtype, device=self.device),
              torch.zeros(shape, dtype=self.kv_storage_dtype, device=self.device))
        for p, h in enumerate(hidden):
            meta = prefill_meta(h.shape[0], bs, self.device)
            cos, sin = self._rope.tables(meta.positions, self.dtype)
            hidden[p] = decoder_layer(c, layer, h, cos, sin, self.attention, kv, meta, self.scale)
        # no reference cycles (checked): the layer's tensors are freed here, before the next is read
        del layer, kv

    @torch.inference_mode()
    def logits(self, hidden: list[torch.Tensor]) -> Iterator[torch.Tensor]:
        """Final norm and head: fp32 logits ``[T_p, vocab]`` per prompt (the head read once)."""
        c = self.config
        head_name = "embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"
        t = self._read(["norm.weight", head_name])
        norm = t["norm.weight"].to(self.dtype)
        head = cpu_matmul.prepare(t.pop(head_name).to(self.dtype))
        del t
        for h in hidden:
            yield cpu_matmul.linear(rms_norm(h, norm, c.rms_norm_eps), head).float().cpu()
