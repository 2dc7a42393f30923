"""The EAGLE-3 draft head in plain torch (runs beside the target on CPU or GPU).

One step of the draft for N entries::

    g     = fc(cat(aux_0, aux_1, aux_2))            # only for entries fed by the TARGET; entries fed
                                                     # by the draft's own previous step pass its
                                                     # pre-norm output instead (EAGLE's recurrence)
    x     = cat(rms(embed(token)), hidden_norm(g))   # [N, 2H]: token embedding next to the feature
    h     = g + o(attn(q(x), k(x), v(x)))            # ONE decoder layer with its own KV cache
    h     = h + mlp(rms(h))                          # -> pre-norm output (fed to the next step)
    probs = lm_head(norm(h))                         # over the draft vocabulary; d2t -> target ids

An entry at position p pairs the target's hidden state AT p with the token AT p+1 and predicts the
token at p+2, exactly how ModelOpt trains it (inputs shifted left by one).

The draft's KV cache is a small contiguous buffer per sequence (:class:`DraftKV`): it holds one
entry per committed position; tentative entries written while growing a tree are dropped by
resetting ``length`` (nothing to free).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from backend.ops import cpu_matmul
from backend.model.layers import RotaryEmbedding, apply_rope, rms_norm
from backend.speculative.checkpoint import DraftConfig

_L = "layers.0."


@dataclass
class DraftKV:
    """Per-sequence draft cache: ``k, v [capacity, Hkv, D]``; entries ``[0, length)`` are committed.
    ``slot >= 0``: ``k, v`` are row ``slot`` of a :class:`DraftKVPool` (fixed addresses, what the
    CUDA-graphed chain draft reads); otherwise they are this sequence's own tensors, grown on demand."""
    k: torch.Tensor
    v: torch.Tensor
    length: int = 0
    slot: int = -1

    def ensure(self, capacity: int) -> None:
        if capacity > self.k.shape[0]:
            if self.slot >= 0:
                raise ValueError(f"draft KV: {capacity} entries exceed the pool's {self.k.shape[0]} per "
                                 f"sequence (engine.max_seq_len bounds them)")
            new = max(capacity, 2 * self.k.shape[0])
            grow = new - self.k.shape[0]
            self.k = torch.cat([self.k, self.k.new_zeros((grow,) + tuple(self.k.shape[1:]))])
            self.v = torch.cat([self.v, self.v.new_zeros((grow,) + tuple(self.v.shape[1:]))])


class DraftKVPool:
    """Every sequence's draft cache in one tensor pair ``[slots, capacity, Hkv, D]``, so that a
    captured graph can address any sequence's cache by slot number. The last slot is scratch: the
    padding rows of a graphed batch write there."""

    def __init__(self, slots: int, capacity: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        bs = 16   # capacity in whole blocks: the pool doubles as a paged cache (block = 16 entries)
        capacity = -(-capacity // bs) * bs
        shape = (slots + 1, capacity, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.capacity, self.block_size, self.scratch = capacity, bs, slots
        self._free = list(range(slots - 1, -1, -1))

    def acquire(self) -> DraftKV | None:
        """A cleared cache in a free slot; None when every slot is taken (the caller falls back)."""
        if not self._free:
            return None
        slot = self._free.pop()
        return DraftKV(self.k[slot], self.v[slot], 0, slot)

    def release(self, cache: DraftKV) -> None:
        if cache.slot >= 0 and cache.k.data_ptr() == self.k[cache.slot].data_ptr():
            self._free.append(cache.slot)
            cache.slot = -2     # released: never handed back twice

    def paged(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The pool as a paged KV cache ``[blocks, 16, Hkv, D]``: slot s owns a contiguous run of
        blocks (``block_tables``), so the paged-decode kernel reads a sequence without gathering it."""
        shape = (-1, self.block_size) + tuple(self.k.shape[2:])
        return self.k.view(shape), self.v.view(shape)

    def block_tables(self, slots: torch.Tensor) -> torch.Tensor:
        per = self.capacity // self.block_size
        return (slots.to(torch.int32)[:, None] * per
                + torch.arange(per, dtype=torch.int32, device=slots.device)[None, :])


@dataclass
class DraftSlice:
    """One sequence's share of a batched draft call (``Eagle3Draft.step_many``)."""
    n: int                            # rows of this sequence
    cache: DraftKV
    write_at: int                     # first cache row its keys/values go to
    mask: torch.Tensor | None = None  # [n, write_at + n - cache.length] bool, None = causal


class Eagle3Draft:
    """Weights + math of one EAGLE-3 head. Stateless apart from the weights; caches are passed in."""

    def __init__(self, cfg: DraftConfig, tensors: dict[str, torch.Tensor], embed_tokens: torch.Tensor,
                 target_lm_head: "cpu_matmul.Weight | None", max_position: int,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16) -> None:
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = dtype

        def w(name: str) -> torch.Tensor:
            return tensors[name].to(device=self.device, dtype=dtype)

        self.fc = w("fc.weight")
        self.input_norm = w(_L + "input_layernorm.weight")
        self.hidden_norm = w(_L + "hidden_norm.weight")
        self.post_norm = w(_L + "post_attention_layernorm.weight")
        # One fused matmul for q|k|v: the three share the same [2H] input.
        self.qkv = torch.cat([w(_L + "self_attn.q_proj.weight"), w(_L + "self_attn.k_proj.weight"),
                              w(_L + "self_attn.v_proj.weight")])
        self.o = w(_L + "self_attn.o_proj.weight")
        self.gate_up = torch.cat([w(_L + "mlp.gate_proj.weight"), w(_L + "mlp.up_proj.weight")])
        self.down = w(_L + "mlp.down_proj.weight")
        # The CPU kernels' storage (backend/ops/cpu_matmul.py); unchanged elsewhere.
        self.fc, self.qkv, self.o, self.gate_up, self.down = map(
            cpu_matmul.prepare, (self.fc, self.qkv, self.o, self.gate_up, self.down))
        self.norm = w("norm.weight")
        self.embed = embed_tokens.to(device=self.device, dtype=dtype)
        if cfg.has_lm_head:
            self.lm_head = w("lm_head.weight")
        else:
            assert target_lm_head is not None, "a draft without lm_head needs the target's"
            # The target's head, already in its CPU storage there (then shared, not copied).
            self.lm_head = (target_lm_head if cpu_matmul.is_packed(target_lm_head)
                            else target_lm_head.to(device=self.device, dtype=dtype))
        self.lm_head = cpu_matmul.prepare(self.lm_head)
        # draft id -> target id (identity when the vocabularies are the same).
        if "d2t" in tensors and cfg.draft_vocab_size < cfg.vocab_size:
            self.d2t_ids = (torch.arange(cfg.draft_vocab_size) + tensors["d2t"].long().cpu()).to(self.device)
        else:
            self.d2t_ids = None
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        self.rope = RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling, self.device)

    def kv_pool(self, slots: int, capacity: int) -> DraftKVPool:
        """The draft's cache pool (made on first call; every speculator of this draft shares it)."""
        pool = getattr(self, "_pool", None)
        if pool is None or pool.scratch < slots or pool.capacity < capacity:
            pool = self._pool = DraftKVPool(slots, capacity, self.cfg.num_kv_heads, self.cfg.head_dim,
                                            self.dtype, self.device)
        return pool

    def new_cache(self, capacity: int = 256) -> DraftKV:
        shape = (capacity, self.cfg.num_kv_heads, self.cfg.head_dim)
        return DraftKV(torch.zeros(shape, dtype=self.dtype, device=self.device),
                       torch.zeros(shape, dtype=self.dtype, device=self.device))

    @torch.inference_mode()
    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """``aux [N, A*H]`` (the target's captured layers, concatenated in ``cfg.aux_layers`` order)
        -> draft feature ``[N, H]``."""
        return cpu_matmul.linear(aux.to(self.dtype), self.fc)

    @torch.inference_mode()
    def step(self, feats: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
             cache: DraftKV, write_at: int, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Run the decoder layer for N new entries of one sequence.

        ``feats [N, H]``, ``tokens [N]`` (the token AFTER each entry's position), ``positions [N]``.
        Their keys/values are written at cache rows ``[write_at, write_at + N)``; each entry attends
        to the committed rows ``[0, cache.length)`` and to the tentative rows
        ``[cache.length, write_at + N)`` allowed by ``mask [N, write_at + N - cache.length]`` (bool;
        default: earlier tentative rows visible, causal among the new ones). Returns the pre-norm
        outputs ``[N, H]``. Does not change ``cache.length``: the caller commits rows it keeps.
        """
        return self.step_many(feats, tokens, positions, [DraftSlice(feats.shape[0], cache, write_at, mask)])

    @torch.inference_mode()
    def step_many(self, feats: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                  slices: list["DraftSlice"]) -> torch.Tensor:
        """``step`` for several sequences at once: rows ``[N, ...]`` are the sequences' entries one
        after another (``slices[i].n`` rows each, with its own cache, ``write_at`` and mask).

        Every matmul runs once over all N rows (at batch 8 this is what the draft costs); only the
        attention, whose keys differ per sequence, loops over the slices."""
        n = feats.shape[0]
        assert sum(sl.n for sl in slices) == n, ([sl.n for sl in slices], n)
        g, q, k, v = self._project(feats, tokens, positions)
        outs, r = [], 0
        for sl in slices:
            outs.append(self._attend(q[r:r + sl.n], k[r:r + sl.n], v[r:r + sl.n], sl))
            r += sl.n
        return self._finish(g, outs[0] if len(outs) == 1 else torch.cat(outs))

    def step_pooled(self, feats: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                    pool: DraftKVPool, slots: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """One entry per sequence, every cache in ``pool``: entry i is written at row ``rows[i]`` of
        slot ``slots[i]`` and sees that slot's rows ``[0, rows[i]]`` (a chain: every earlier row is
        committed or an ancestor). No host sync and no shape that depends on the data, so it can
        be captured in a CUDA graph. -> pre-norm outputs ``[N, H]``."""
        from plugins import registry
        paged_decode = registry.load("paged_decode", "triton")   # the split-K decode kernel (GPU/interpreter)
        g, q, k, v = self._project(feats, tokens, positions)
        flat = slots * pool.capacity + rows
        pool.k.view(-1, *pool.k.shape[2:]).index_copy_(0, flat, k)
        pool.v.view(-1, *pool.v.shape[2:]).index_copy_(0, flat, v)
        kc, vc = pool.paged()
        attn = paged_decode(q.contiguous(), kc, vc, pool.block_tables(slots), (rows + 1).to(torch.int32),
                            self.scale, max_seq_len=pool.capacity)
        return self._finish(g, attn.reshape(q.shape[0], self.q_size))

    def _project(self, feats: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor):
        """-> the residual input ``g [N, H]`` and rotated ``q [N, Hq, D]``, ``k, v [N, Hkv, D]``."""
        c = self.cfg
        n = feats.shape[0]
        emb = F.embedding(tokens, self.embed)
        g = feats.to(self.dtype)
        hin = rms_norm(g, self.input_norm, c.rms_norm_eps) if c.double_hidden_norm else g
        x = torch.cat([rms_norm(emb, self.input_norm, c.rms_norm_eps),
                       rms_norm(hin, self.hidden_norm, c.rms_norm_eps)], dim=-1)
        q, k, v = cpu_matmul.linear(x, self.qkv).split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        cos, sin = self.rope.tables(positions, self.dtype)
        q = apply_rope(q.view(n, c.num_heads, c.head_dim), cos, sin)
        k = apply_rope(k.view(n, c.num_kv_heads, c.head_dim), cos, sin)
        return g, q, k, v.view(n, c.num_kv_heads, c.head_dim)

    def _finish(self, g: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Attention output ``[N, Hq*D]`` -> the layer's pre-norm output (o, residual, MLP)."""
        h = g + cpu_matmul.linear(attn, self.o)
        gate, up = cpu_matmul.linear(rms_norm(h, self.post_norm, self.cfg.rms_norm_eps),
                                     self.gate_up).chunk(2, dim=-1)
        return h + cpu_matmul.linear(F.silu(gate) * up, self.down)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sl: "DraftSlice") -> torch.Tensor:
        """Write one sequence's new keys/values at ``sl.write_at`` and attend -> ``[n, Hq*D]``."""
        n, cache, write_at = sl.n, sl.cache, sl.write_at
        cache.ensure(write_at + n)
        cache.k[write_at:write_at + n] = k
        cache.v[write_at:write_at + n] = v
        past = cache.length
        assert write_at >= past
        end = write_at + n
        keys, vals = cache.k[:end], cache.v[:end]
        mask = sl.mask
        if mask is None:  # causal among the new rows; earlier tentative rows all visible
            mask = torch.ones(n, end - past, dtype=torch.bool, device=self.device).tril(write_at - past)
        assert mask.shape == (n, end - past), (tuple(mask.shape), n, end - past)
        full = torch.cat([torch.ones(n, past, dtype=torch.bool, device=self.device), mask.to(self.device)], 1)
        attn = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0),
            vals.transpose(0, 1).unsqueeze(0), attn_mask=full.view(1, 1, n, end), scale=self.scale,
            enable_gqa=self.cfg.num_heads != self.cfg.num_kv_heads)
        return attn.squeeze(0).transpose(0, 1).reshape(n, self.q_size)

    @torch.inference_mode()
    def logits(self, prenorm: torch.Tensor) -> torch.Tensor:
        """Pre-norm outputs ``[N, H]`` -> fp32 logits over the DRAFT vocabulary ``[N, Vd]``."""
        return cpu_matmul.linear(rms_norm(prenorm, self.norm, self.cfg.rms_norm_eps), self.lm_head).float()

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.d2t_ids is None else self.d2t_ids[draft_ids]


__all__ = ["DraftKV", "DraftKVPool", "DraftSlice", "Eagle3Draft"]
