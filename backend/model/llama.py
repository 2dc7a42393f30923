"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Phi-3) that runs an engine bundle's weights.

Weights use the runtime layout of docs/contracts.md section 3 (fused ``qkv`` and ``gate_up``).
The model owns no KV memory: the runner passes ``kv_caches`` (one ``(k_cache, v_cache)`` per layer)
and the per-step ``AttentionMetadata``; attention goes through the chosen backend.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from backend.ops import cpu_matmul
from backend.ops.attention import AttentionBackend
from backend.ops.linear import FP8Linear, QuantLinear, make_linear
from backend.bundle_schema import ModelConfig
from backend.arch_spec import Experts
from backend.model import decoder_parts, spec_layer
from backend.model.moe import ExpertMLP, build_experts
from backend.model.layers import apply_rope, rms_norm, silu_and_mul
from plugins import registry

# The CPU kernels of the plain layer, where they apply (float32 on CPU): rows of the kernel table.
_cpu_add_rms_norm = registry.load("add_rms_norm", "cpu")
_cpu_mul_fake_quant_fp8 = registry.load("mul_fake_quant_fp8", "cpu")


def _linear_tensors(weights: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    p = prefix + "."
    found = {k[len(p):]: v for k, v in weights.items() if k.startswith(p) and "." not in k[len(p):]}
    if not found:
        raise KeyError(f"weights.safetensors: no tensors for linear {prefix!r} "
                       f"(expected {prefix}.weight and its format's scales)")
    return found


def _tensor(weights: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in weights:
        raise KeyError(f"weights.safetensors: missing tensor {name!r}")
    return weights[name]


@dataclass
class DecoderLayer:
    input_norm: torch.Tensor
    post_attn_norm: torch.Tensor
    qkv: QuantLinear
    o: QuantLinear
    gate_up: QuantLinear | None             # None on an expert layer, whose MLP is ``moe``
    down: QuantLinear | None
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    moe: ExpertMLP | None = None            # model.arch.experts.layers has this layer (backend/model/moe.py)
    q_norm: torch.Tensor | None = None      # per-head RMSNorm weights [D] (model.arch.qk_norm: Qwen3)
    k_norm: torch.Tensor | None = None
    # model.arch.norm_placement pre_post (Gemma 3): post_attn_norm then normalizes the attention output,
    # these the MLP's input and output (backend/model/spec_layer.py)
    pre_ff_norm: torch.Tensor | None = None
    post_ff_norm: torch.Tensor | None = None


FF_NORMS = ("pre_ff_norm", "post_ff_norm")


def build_layer(weights: dict[str, torch.Tensor], i: int, quant_format: str, dtype: torch.dtype,
                device: torch.device, aot=None, experts: Experts | None = None,
                expert_kernel: Callable | None = None) -> DecoderLayer:
    """Layer ``i`` from the bundle's tensors, its linears in the storage their kernels want
    (the model builds every layer so; ``layer_probe`` builds one to time it). ``experts``: the spec's
    expert layers; layer ``i``'s MLP is then the experts' when it is one of them, run by
    ``expert_kernel`` (the kernel table's fused_moe; None: the per-expert loop, backend/model/moe.py)."""
    p = f"layers.{i}"
    sparse = experts is not None and i in experts.layers
    mlp = ("router", "experts") if sparse else ("gate_up", "down")
    lin = {name: make_linear(quant_format, _linear_tensors(weights, f"{p}.{name}"), dtype, device,
                             where=f"{p}.{name}", aot=aot)
           for name in ("qkv", "o") + (() if sparse else mlp)}
    if sparse:
        hidden = _tensor(weights, f"{p}.input_norm.weight").shape[0]
        lin.update(gate_up=None, down=None,
                   moe=build_experts(weights, p, experts, hidden, dtype, device, expert_kernel, aot))
    ks, vs = weights.get(f"{p}.attn.k_scale"), weights.get(f"{p}.attn.v_scale")
    return DecoderLayer(
        input_norm=_tensor(weights, f"{p}.input_norm.weight").to(device=device, dtype=dtype),
        post_attn_norm=_tensor(weights, f"{p}.post_attn_norm.weight").to(device=device, dtype=dtype),
        k_scale=ks.to(device).float().reshape(()) if ks is not None else None,
        v_scale=vs.to(device).float().reshape(()) if vs is not None else None, **lin,
        **decoder_parts.layer_qk_norms(weights, p, dtype, device),
        **{n: _tensor(weights, f"{p}.{n}.weight").to(device=device, dtype=dtype) if f"{p}.{n}.weight" in weights
           else None for n in FF_NORMS})


def decoder_layer(c: ModelConfig, layer: DecoderLayer, hidden: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, attention: AttentionBackend, kv_cache: tuple[torch.Tensor, torch.Tensor],
                  meta, scale: float, row_linear: Callable | None = None, window: int | None = None) -> torch.Tensor:
    """One layer on plain ops (the torch attention backend): ``hidden [T, H]`` -> ``[T, H]``; writes
    the step's keys and values into ``kv_cache``. ``row_linear(linear, x)`` computes the ``o`` and
    ``down`` products (``LlamaModel.row_linear``: a tensor-parallel rank all-reduces them there).
    ``window``: the layer's sliding window (None: full attention)."""
    row = row_linear or _apply
    t = hidden.shape[0]
    # Attention block.
    hidden, x = _norm_input(layer.qkv, hidden, None, layer.input_norm, c.rms_norm_eps)
    qkv = _apply(layer.qkv, x)
    # queries and keys rotated together: one set of small ops instead of two (a decode step is
    # bound by their count on CPU), the same numbers
    qk = qkv[:, :c.q_size + c.kv_size].view(t, c.num_heads + c.num_kv_heads, c.head_dim)
    if layer.q_norm is not None:
        qk = decoder_parts.qk_norm(qk, layer.q_norm, layer.k_norm, c.num_heads, c.rms_norm_eps)
    qk = apply_rope(qk, cos, sin)
    q, k = qk[:, :c.num_heads], qk[:, c.num_heads:]
    v = qkv[:, c.q_size + c.kv_size:].view(t, c.num_kv_heads, c.head_dim)
    k_cache, v_cache = kv_cache
    attention.write_kv(k, v, k_cache, v_cache, meta.slot_mapping, layer.k_scale, layer.v_scale)
    extra = {"window": window} if window is not None else {}   # a backend without windows never sees one
    attn = attention.forward(q, k_cache, v_cache, meta, scale, layer.k_scale, layer.v_scale, **extra)
    # MLP block: the residual add, its norm and gate_up's input quantization in one kernel call on CPU
    hidden, x = _norm_input(layer.gate_up, hidden, row(layer.o, attn.reshape(t, c.q_size)),
                            layer.post_attn_norm, c.rms_norm_eps)
    if layer.moe is not None:
        return hidden + layer.moe(x)
    return hidden + row(layer.down, _down_input(layer.down, _apply(layer.gate_up, x)))


class LlamaModel:
    """``forward(input_ids [T], meta, kv_caches, capture_hidden_layers) -> (hidden [T, H], captured)``.

    ``captured`` maps each requested layer index ``i`` to the residual stream after layer ``i``
    (what Hugging Face returns as ``hidden_states[i + 1]``); EAGLE-3 drafts read these.
    """

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], quant_format: str,
                 attention: AttentionBackend, device: torch.device | str = "cpu",
                 dtype: torch.dtype | None = None) -> None:
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype or config.torch_dtype
        self.attention = attention
        spec = config.arch_spec   # engine.json model.arch; None in bundles built before the spec
        self.plan = spec_layer.plan_of(spec, config)
        self.scale = self.plan.scale
        dt, dev = self.dtype, self.device

        def dense(name: str) -> torch.Tensor:
            return _tensor(weights, name).to(device=dev, dtype=dt)

        self.embed_tokens = dense("embed_tokens.weight")
        self.norm = dense("norm.weight")
        head = "embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
        lm_head = self.embed_tokens if config.tie_word_embeddings else dense(head)
        # On CPU the logits matmul wants its own storage (backend/ops/cpu_matmul.py: fp16-packed or
        # column-major); a tied head then becomes a second copy, since the embedding gather needs rows.
        self.lm_head = cpu_matmul.prepare_from(_tensor(weights, head), f"as {dt}", lambda: lm_head)
        aot = attention.aot   # the bundle's cubins (GPU) serve the 4-bit GEMMs too
        experts = spec.experts if spec is not None else None
        # an expert layer's MLP: the fused expert kernel where the kernel table has one for this backend
        # and device, else the per-expert loop (backend/model/moe.py)
        moe = registry.expert_kernel(attention.name, dev, dt) if experts is not None else None
        self.layers = [build_layer(weights, i, quant_format, dt, dev, aot, experts, moe)
                       for i in range(config.num_layers)]
        self._check_shapes()
        # one table per attention kind (Gemma 3: sliding layers rope base 10k, full ones 1M)
        self.ropes = spec_layer.rope_tables(spec, config, dev)
        self.rope = next(iter(self.ropes.values()))   # the fused path's (it refuses more than one)
        # per layer: its sliding window (None: full); windows that never bind are dropped (bound_windows)
        self.windows = list(self.plan.windows)
        # With the Triton attention backend (a GPU, or the interpreter in tests) a decoder layer runs
        # fused kernels: norm, QKV GEMM, rope+KV write, attention, O GEMM, norm, gate/up GEMM, act, down
        # GEMM, or an expert layer's router and fused expert kernel (see _forward_fused). The torch
        # backend keeps the plain ops below, numbers unchanged.
        # The kernel table says whether the backend's kind has them (None: the plain layer).
        self._kernels = registry.fused_layer_kernels(attention.name, dev, dt)
        self.fused = self._kernels is not None
        decoder_parts.check_spec(spec)
        decoder_parts.check_qk_norms(spec, self.layers)
        if self.plan.one_plus:   # (1 + w) norms: the multiplier once, in fp32 as transformers computes it
            self.norm = spec_layer.one_plus_weight(self.norm)
            for layer in self.layers:
                for name in ("input_norm", "post_attn_norm", "q_norm", "k_norm") + FF_NORMS:
                    if getattr(layer, name) is not None:
                        setattr(layer, name, spec_layer.one_plus_weight(getattr(layer, name)))
        if self.plan.post_norms and any(layer.pre_ff_norm is None or layer.post_ff_norm is None
                                        for layer in self.layers):
            raise KeyError("weights.safetensors: a layer lacks pre_ff_norm/post_ff_norm weights, which "
                           "model.arch.norm_placement pre_post needs; rebuild the bundle")
        if self.fused:
            half = config.head_dim // 2
            # per attention kind, [max_pos, 2, D/2] fp32: the same angles as the torch path's tables
            # (before their dtype cast)
            self.cos_sins = {kind: torch.stack([r.cos[:, :half], r.sin[:, :half]], dim=1).contiguous()
                             for kind, r in self.ropes.items()}

    def _check_shapes(self) -> None:
        c = self.config
        want = {"qkv": c.q_size + 2 * c.kv_size, "o": c.hidden_size, "gate_up": 2 * c.intermediate_size,
                "down": c.hidden_size}
        for i, layer in enumerate(self.layers):
            for name, out in want.items():
                if getattr(layer, name) is None:    # an expert layer's MLP: build_experts checked it
                    continue
                got = getattr(layer, name).out_features
                if got != out:
                    raise ValueError(f"weights.safetensors: layers.{i}.{name} has {got} output features; "
                                     f"model config implies {out}")
        if tuple(self.embed_tokens.shape) != (c.vocab_size, c.hidden_size):
            raise ValueError(f"weights.safetensors: embed_tokens.weight is {tuple(self.embed_tokens.shape)}; "
                             f"expected ({c.vocab_size}, {c.hidden_size})")

    @property
    def kv_cache_scales(self) -> list[tuple[torch.Tensor | None, torch.Tensor | None]]:
        return [(layer.k_scale, layer.v_scale) for layer in self.layers]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token ids -> the first residual stream (a tensor-parallel rank overrides it: backend/runtime/tp.py)."""
        return F.embedding(input_ids, self.embed_tokens)

    def row_linear(self, linear: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        """The ``o`` and ``down`` products, in both layer paths: the only places where a layer's
        partial sums would meet if its inner dimension were split. A tensor-parallel rank overrides
        this to all-reduce them (backend/runtime/tp.py); ``x`` may be fp8 codes (see ``_apply``)."""
        return _apply(linear, x)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                capture_hidden_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        if self.fused:
            return self._forward_fused(input_ids, meta, kv_caches, capture_hidden_layers)
        c, plan = self.config, self.plan
        tables = {kind: rope.tables(meta.positions, self.dtype) for kind, rope in self.ropes.items()}
        captured: dict[int, torch.Tensor] = {}
        hidden = self.embed(input_ids)
        if plan.embedding_scale is not None:   # sqrt(hidden) rounded to the model's dtype first, as transformers
            hidden = hidden * torch.tensor(plan.embedding_scale, dtype=hidden.dtype, device=hidden.device)
        for i, layer in enumerate(self.layers):
            cos, sin = tables[plan.rope_of[i]]
            # a sliding layer with a KV pool of its own reads that pool's block tables
            m = meta.window if meta.window is not None and self.windows[i] is not None else meta
            if plan.plain:
                hidden = decoder_layer(c, layer, hidden, cos, sin, self.attention, kv_caches[i], m, self.scale,
                                       self.row_linear, self.windows[i])
            else:
                hidden = spec_layer.spec_layer(c, plan, layer, hidden, cos, sin, self.attention, kv_caches[i], m,
                                               self.windows[i], self.row_linear, _apply)
            if i in capture_hidden_layers:
                captured[i] = hidden
        return spec_layer.norm(hidden, self.norm, c.rms_norm_eps, plan.one_plus), captured

    def bound_windows(self, max_seq_len: int) -> list[int]:
        """Drop the windows no sequence of at most ``max_seq_len`` tokens reaches past (there sliding-window
        attention is full attention, and the full path is the faster one); the windows left, which the
        attention backend must honour."""
        self.windows = [w if w is not None and w < max_seq_len else None for w in self.windows]
        return sorted({w for w in self.windows if w is not None})

    def _forward_fused(self, input_ids, meta, kv_caches, capture_hidden_layers):
        """The same layer on fused kernels. The residual stream is added lazily: each block's output
        (``delta``) goes into the next norm kernel, which writes the sum (the new residual) and the
        normed row, quantized to fp8 when the linear it feeds is an FP8 one (``_fp8_in``).
        ``delta`` is always ``row_linear``'s output, so on a tensor-parallel rank it is the whole
        (all-reduced, biased) sum before any kernel adds it to the residual; the kernels that quantize
        the O and down inputs (attention's ``out_scale``, ``silu_mul_quant``) work on this rank's
        heads/columns alone, with the replicated per-tensor input scales."""
        c, k, aot, plan = self.config, self._kernels, self.attention.aot, self.plan
        t, eps = input_ids.shape[0], c.rms_norm_eps
        norm = k["add_rms_norm_quant"]
        captured: dict[int, torch.Tensor] = {}
        hidden = self.embed(input_ids)
        if plan.embedding_scale is not None:   # Gemma: sqrt(hidden), rounded to the model's dtype first
            hidden = hidden * torch.tensor(plan.embedding_scale, dtype=hidden.dtype, device=hidden.device)
        delta = None
        for i, layer in enumerate(self.layers):
            # Attention block.
            x, hidden = (norm(hidden, layer.input_norm, eps, None, _fp8_in(layer.qkv), aot=aot) if delta is None
                         else norm(delta, layer.input_norm, eps, hidden, _fp8_in(layer.qkv), aot=aot))
            qkv = _apply(layer.qkv, x)
            k_cache, v_cache = kv_caches[i]
            window = self.windows[i]
            m = meta.window if meta.window is not None and window is not None else meta
            # Qwen3's per-head q/k RMS norms in the same kernel, before the rotation (None: no norms)
            q = k["rope_write_kv"](qkv, m.positions, self.cos_sins[plan.rope_of[i]], k_cache, v_cache, m.slot_mapping,
                                   c.num_heads, c.num_kv_heads, layer.k_scale, layer.v_scale, aot=aot,
                                   q_norm=layer.q_norm, k_norm=layer.k_norm, eps=eps)
            # an FP8 O projection's input comes quantized out of the attention kernel
            extra = {"window": window} if window is not None else {}
            attn = self.attention.forward(q, k_cache, v_cache, m, self.scale, layer.k_scale, layer.v_scale,
                                          out_scale=_fp8_in(layer.o), **extra)
            delta = self.row_linear(layer.o, attn.reshape(t, c.q_size))
            # MLP block. Gemma's pre_post placement normalizes each block's output before the residual
            # takes it, and feeds the MLP its own pre norm (the weights are already 1 + w: __init__).
            if plan.post_norms:
                delta = k["rms_norm"](delta, layer.post_attn_norm, eps, aot=aot)
                x, hidden = norm(delta, layer.pre_ff_norm, eps, hidden, _fp8_in(layer.gate_up), aot=aot)
            else:
                x, hidden = norm(delta, layer.post_attn_norm, eps, hidden, _fp8_in(layer.gate_up), aot=aot)
            if layer.moe is not None:   # an expert layer: router, then the fused expert kernel (__init__)
                delta = layer.moe(x)
            else:
                delta = self.row_linear(layer.down, self._fused_act(layer, _apply(layer.gate_up, x)))
            if plan.post_norms:
                delta = k["rms_norm"](delta, layer.post_ff_norm, eps, aot=aot)
            if i in capture_hidden_layers:
                captured[i] = hidden + delta
        if delta is None:
            return rms_norm(hidden, self.norm, eps), captured
        return norm(delta, self.norm, eps, hidden, None, aot=aot)[0], captured

    def _fused_act(self, layer: DecoderLayer, gate_up: torch.Tensor) -> torch.Tensor:
        """The fused layer's activation of a dense MLP: ``down``'s input (its fp8 codes when it takes them)."""
        aot = self.attention.aot
        if self.plan.activation == "silu":
            return self._kernels["silu_mul_quant"](gate_up, _fp8_in(layer.down), aot=aot)
        gate, up = gate_up.chunk(2, dim=-1)   # GELU-tanh (Gemma): PyTorch's op, then the fp8 codes if wanted
        y = spec_layer.ACTIVATIONS[self.plan.activation](gate) * up
        if _fp8_in(layer.down) is not None:
            y = self._kernels["quantize_fp8"](y.contiguous(), _fp8_in(layer.down), aot=aot)
        return y

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [N, H]`` (already normed) -> fp32 logits ``[N, vocab]``."""
        return cpu_matmul.linear(hidden, self.lm_head).float()


def _fp8_in(linear: QuantLinear) -> torch.Tensor | None:
    """The static input scale of an FP8 linear (its input then arrives quantized), else None."""
    return linear.input_scale if isinstance(linear, FP8Linear) else None


class FakeQuantized(NamedTuple):
    """An FP8 linear's input already fake-quantized with its input scale (``_down_input``). What
    ``row_linear`` hooks ask of an input (dtype, shape) it answers for its values."""
    values: torch.Tensor

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype

    @property
    def shape(self) -> torch.Size:
        return self.values.shape


def _norm_input(linear: QuantLinear, hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor | FakeQuantized]:
    """``(hidden + delta, rms_norm(hidden + delta))`` (``hidden`` as it is when ``delta`` is None), the
    norm as ``linear``'s input: already fake-quantized for an emulated FP8 ``linear``. One CPU kernel
    call for what is ~12 dispatched ops (plugins/cpu: the same bits); the PyTorch ops otherwise."""
    fq = isinstance(linear, FP8Linear) and linear.emulated
    done = _cpu_add_rms_norm(hidden, delta, weight, eps, linear.input_scale_value if fq else None)
    if done is not None:
        return done[0], (FakeQuantized(done[1]) if fq else done[1])
    if delta is not None:
        hidden = hidden + delta
    return hidden, rms_norm(hidden, weight, eps)


def _down_input(down: QuantLinear, gate_up: torch.Tensor) -> torch.Tensor | FakeQuantized:
    """SwiGLU's ``silu(gate) * up`` for the down projection. An emulated FP8 ``down`` (CPU) gets the
    product already fake-quantized, by one CPU kernel call that multiplies and quantizes (the same
    bits as ``down`` quantizing ``silu_and_mul``'s output itself, ~14 dispatched ops fewer)."""
    if isinstance(down, FP8Linear) and down.emulated:
        gate, up = gate_up.chunk(2, dim=-1)
        xq = _cpu_mul_fake_quant_fp8(F.silu(gate), up, down.input_scale_value)
        if xq is not None:
            return FakeQuantized(xq)
    return silu_and_mul(gate_up)


def _apply(linear: QuantLinear, x: torch.Tensor | FakeQuantized) -> torch.Tensor:
    """An FP8 linear takes the fp8 codes a fused kernel wrote, or the values ``_down_input``
    fake-quantized; every other linear its usual input."""
    if type(x) is FakeQuantized:
        return linear.forward_fake_quantized(x.values)
    return linear.forward_fp8(x) if x.dtype == torch.float8_e4m3fn else linear(x)
