"""The verify stage's comparison with one decoder layer resident at a time (``verify.path`` streamed).

    streamed_compare(hf_dir, spec, prompts, progress) -> (agreeing positions, summed KL, positions)

Teacher-forced like the whole-model comparison, and the same numbers: each model's own hidden states
feed its own next layer (this is not a per-layer comparison), every prompt runs as its own forward
of the shapes the whole-model path runs, so the final logits are those of the whole models (bit for
bit on SmolLM2: tests/builder/test_verify_stream.py).

1. Reference: the real Hugging Face decoder layer classes in fp32, built on the meta device and
   given one layer's tensors read from the import stage's safetensors shards (``quant.stream``'s
   helpers: the embedding lookup and the keyword arguments the model hands a layer come from the
   model's own forward). Its logits (positions x vocabulary, fp32) are kept; its hidden states and
   the head are dropped.
2. Candidate: the bundle through ``backend.runtime.layerwise.LayerwiseRunner`` (Kiln's runtime
   arithmetic: linear formats, KV-cache dtype, attention), compared prompt by prompt.

Resident at once: one layer of one model, one model's hidden states (tokens x hidden x 4 bytes), the
reference logits, or at the end one head (see ``builder.stages.verify.memory_estimate``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

Advance = Callable[[int], None]


def reference_logits(hf_dir: Path, prompts: list[list[int]], advance: Advance,
                     device: str = "cpu") -> list[torch.Tensor]:
    """fp32 logits ``[T_p, vocab]`` per prompt (on the host) of the unquantized checkpoint ``hf_dir``,
    computed layer by layer on ``device`` (``advance(1)`` after each layer and after the head)."""
    # quant.stream owns the meta-device model and the capture of a layer's inputs: one copy of that
    # logic for quantize and verify
    from quant.stream import LAYER_PREFIX, Shards, StreamUnsupported, hf_config, layer_inputs, meta_model

    shards = Shards(hf_dir)
    config = hf_config(hf_dir)
    batches = [torch.tensor([ids]) for ids in prompts]
    hidden, kwargs = layer_inputs(shards, config, batches, device=device, dtype=torch.float32)
    model = meta_model(config, device)
    layers, norm = list(model.model.layers), model.model.norm
    del model
    names = shards.names()
    with torch.inference_mode():
        for i in range(config.num_hidden_layers):
            prefix = f"{LAYER_PREFIX}{i}."
            layer, layers[i] = layers[i], None
            tensors = {n[len(prefix):]: shards.get(n).to(device=device, dtype=torch.float32)
                       for n in names if n.startswith(prefix)}
            missing, unexpected = layer.load_state_dict(tensors, strict=False, assign=True)
            if missing or unexpected:
                raise StreamUnsupported(f"layer {i}: missing {missing[:4]}, unexpected {unexpected[:4]} tensors")
            del tensors
            for p, (h, kw) in enumerate(zip(hidden, kwargs)):
                out = layer(h, **kw)
                hidden[p] = out[0] if isinstance(out, tuple) else out
            del layer
            advance(1)
        del kwargs
        norm.load_state_dict({"weight": shards.get("model.norm.weight").to(device=device, dtype=torch.float32)},
                             assign=True)
        tied = getattr(config, "tie_word_embeddings", False)
        head = shards.get("model.embed_tokens.weight" if tied else "lm_head.weight").to(device=device,
                                                                                          dtype=torch.float32)
        # [1, T, H] like the whole model's lm_head input: the same matmul shape, the same sums
        logits = [F.linear(norm(h), head)[0].cpu() for h in hidden]
        del head, hidden
    advance(1)
    return logits


def compare(ref_logits: torch.Tensor, logits: torch.Tensor) -> tuple[int, float, int]:
    """-> (positions where the argmax agrees, summed KL(ref || candidate), positions)."""
    ref_lp = ref_logits.float().log_softmax(-1)
    lp = logits.float().log_softmax(-1)
    agree = int((ref_lp.argmax(-1) == lp.argmax(-1)).sum())
    kl = float((ref_lp.exp() * (ref_lp - lp)).sum(-1).clamp_min(0).sum())
    return agree, kl, ref_logits.shape[0]


def streamed_compare(hf_dir: Path, spec, prompts: list[list[int]],
                     progress, device: str = "cpu") -> tuple[int, float, int]:
    """(positions where the top-1 tokens agree, summed KL(reference || bundle), positions) over
    ``prompts``; ``spec``: the bundle's ``EngineSpec``; ``progress(description, total)``: the stage
    context's progress bar; ``device``: where both models' layers run (fp32, the torch attention
    backend on a GPU too: verify measures quantization, not the serving kernels)."""
    from backend.runtime.layerwise import LayerwiseRunner

    n = spec.model.num_layers
    with progress("verify: unquantized model, layer by layer", n + 1) as advance:
        ref = reference_logits(hf_dir, prompts, advance, device)
    agree = positions = 0
    kl_sum = 0.0
    with progress("verify: bundle, layer by layer", n + 1) as advance:
        # fp32 like the reference (see verify.run)
        lw = LayerwiseRunner(spec, device=device, dtype=torch.float32, attention="torch")
        hidden = lw.embed(prompts)
        for i in range(n):
            lw.run_layer(i, hidden)
            advance(1)
        for p, logits in enumerate(lw.logits(hidden)):
            a, k, m = compare(ref[p], logits)
            agree, kl_sum, positions = agree + a, kl_sum + k, positions + m
            ref[p] = None   # each prompt's reference logits go once compared
        advance(1)
    return agree, kl_sum, positions
