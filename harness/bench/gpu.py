"""The executor on an NVIDIA GPU with a Llama-3.1-8B-shaped FP8 engine of random weights:
`python -m harness.bench.gpu [--isl 1000 --osl 1000 --num-requests 256] [--out F]`.

Speed does not depend on weight values (random weights are fine for speed), and no 8B
checkpoint can reach the GPU machine, so the weights are generated on the GPU in the bundle's runtime
layout (FP8 per-row weights, static input scales, FP8 KV scales) and handed to the Executor with a
manifest-only bundle. Measures, in one run:
  * single stream: decode ms per token against the bandwidth floor (bytes of weights read per token /
    measured device-to-device copy bandwidth); goal: within 15% of the floor;
  * throughput: `num-requests` requests of `isl` random prompt tokens and exactly `osl` output tokens
    (ignore_eos), all submitted at once: output tokens/s (TensorRT-LLM publishes 15,220 tok/s on H100
    for 1000/1000). A run that passes `--max-seconds` stops and reports the partial rate as such.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

LLAMA31_8B = {
    "architecture": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_layers": 32,
    "num_heads": 32, "num_kv_heads": 8, "head_dim": 128, "vocab_size": 128256, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "max_position_embeddings": 8192, "tie_word_embeddings": False,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "attention_bias": False, "mlp_bias": False, "sliding_window": None, "bos_token_id": 128000,
    "eos_token_ids": [128001, 128009], "pad_token_id": 128001, "dtype": "bfloat16"}


def synthetic_fp8_weights(m: dict, device: str = "cuda", seed: int = 0, std: float = 0.02) -> dict:
    """Random weights in the FP8 bundle layout (docs/contracts.md section 3), made layer by layer on
    the GPU so the bf16 originals never all exist at once. Tests use a larger ``std`` so that outputs
    depend strongly on the context (a check of attention and KV handling can then fail)."""
    import torch

    from quant.formats import quantize_fp8_per_row
    g = torch.Generator(device=device).manual_seed(seed)
    h, inter = m["hidden_size"], m["intermediate_size"]
    q, kv = m["num_heads"] * m["head_dim"], m["num_kv_heads"] * m["head_dim"]
    shapes = {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * inter, h), "down": (h, inter)}

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=torch.bfloat16) * std

    w = {"embed_tokens.weight": randn(m["vocab_size"], h), "norm.weight": torch.ones(h, device=device,
                                                                                     dtype=torch.bfloat16),
         "lm_head.weight": randn(m["vocab_size"], h)}
    one = torch.tensor(1.0, device=device)
    for i in range(m["num_layers"]):
        p = f"layers.{i}"
        w[f"{p}.input_norm.weight"] = torch.ones(h, device=device, dtype=torch.bfloat16)
        w[f"{p}.post_attn_norm.weight"] = torch.ones(h, device=device, dtype=torch.bfloat16)
        w[f"{p}.attn.k_scale"], w[f"{p}.attn.v_scale"] = one * 0.05, one * 0.05
        for name, shape in shapes.items():
            for k, v in quantize_fp8_per_row(randn(*shape)).items():
                w[f"{p}.{name}.{k}"] = v
            w[f"{p}.{name}.input_scale"] = one * 0.02
    return w


def weight_bytes_per_token(w: dict) -> int:
    """Bytes decode reads per step: every weight except the embedding table (one row is gathered)."""
    return sum(t.numel() * t.element_size() for k, t in w.items() if k != "embed_tokens.weight")


def manifest_bundle(m: dict, engine: dict, root: Path) -> Path:
    """A bundle with engine.json only (weights are passed in memory; hashes are not checked)."""
    from safetensors.torch import save_file

    from backend import bundle
    root.mkdir(parents=True, exist_ok=True)
    save_file({}, str(root / bundle.WEIGHTS))
    bundle.write(root, bundle.Manifest.from_dict({
        "format": bundle.FORMAT, "format_version": bundle.FORMAT_VERSION, "model": m, "engine": engine,
        "quantization": {"format": "fp8", "kv_cache": "fp8"}, "files": {bundle.WEIGHTS: ""}}))
    return root


def single_stream(ex, vocab: int, prompt_len: int = 128, out_len: int = 256) -> dict:
    import random

    from backend.engine.sampling_params import SamplingParams
    rng = random.Random(1)
    prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
    params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
    ex.generate([prompt[:16]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))  # warm-up
    stamps = []
    h = ex.submit(prompt, params)
    t0 = time.perf_counter()
    for ev in h:
        stamps.extend([time.perf_counter()] * len(ev.token_ids))
    decode_ms = (stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1e3
    return {"prompt_len": prompt_len, "output_len": len(stamps), "ttft_ms": (stamps[0] - t0) * 1e3,
            "decode_ms_per_token": decode_ms, "tok_s": 1e3 / decode_ms}


def throughput(ex, vocab: int, n: int, isl: int, osl: int, max_seconds: float) -> dict:
    import random

    from backend.engine.sampling_params import SamplingParams
    rng = random.Random(2)
    prompts = [[rng.randrange(vocab) for _ in range(isl)] for _ in range(n)]
    params = SamplingParams(max_tokens=osl, temperature=0.0, ignore_eos=True)
    before = ex.stats()["generated_tokens"]
    t0 = time.perf_counter()
    handles = [ex.submit(p, params) for p in prompts]
    deadline = t0 + max_seconds
    for h in handles:
        h.wait(max(0.0, deadline - time.perf_counter()))
    elapsed = time.perf_counter() - t0
    done = sum(h.finished for h in handles)
    generated = ex.stats()["generated_tokens"] - before
    for h in handles:
        if not h.finished:
            ex.cancel(h.request_id)
    return {"num_requests": n, "isl": isl, "osl": osl, "completed_requests": done, "complete": done == n,
            "elapsed_s": elapsed, "output_tokens": generated, "output_tok_s": generated / elapsed}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.bench.gpu", description=__doc__.splitlines()[0])
    ap.add_argument("--isl", type=int, default=1000, help="prompt tokens per request (default 1000)")
    ap.add_argument("--osl", type=int, default=1000, help="output tokens per request (default 1000)")
    ap.add_argument("--num-requests", type=int, default=256, help="requests in the throughput run")
    ap.add_argument("--max-batch-size", type=int, default=256)
    ap.add_argument("--max-num-tokens", type=int, default=8192, help="token budget of one step")
    ap.add_argument("--max-seconds", type=float, default=240.0, help="stop the throughput run after this")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--out", help="result JSON (default docs/perf/gpu-bench-<gpu>.json)")
    a = ap.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("bench_gpu: no NVIDIA GPU visible (torch.cuda.is_available() is false); run on the GPU machine",
              file=sys.stderr)
        return 2
    from backend.engine.executor import Executor
    from harness.bench.report import header, write_report
    from harness.bench.kernels import copy_bandwidth_gbs
    res = header(torch, "harness.bench.gpu")
    res["model"] = "Llama-3.1-8B shape, random FP8 weights (per-row), FP8 KV, lm_head bf16"
    res["copy_gbs"] = copy_bandwidth_gbs()
    m = dict(LLAMA31_8B)
    seq = a.isl + a.osl + 16
    engine = {"max_batch_size": a.max_batch_size, "max_num_tokens": a.max_num_tokens, "max_seq_len": seq,
              "max_input_len": a.isl + 8, "kv_block_size": 16, "kv_cache_dtype": "fp8_e4m3",
              "max_kv_tokens": a.num_requests * seq + 4096, "enable_prefix_caching": False,
              "enable_chunked_prefill": True, "scheduler_policy": "max_utilization",
              "attention_backend": "triton"}
    t0 = time.perf_counter()
    weights = synthetic_fp8_weights(m)
    res["weights_gib"] = weight_bytes_per_token(weights) / 2**30
    res["floor_ms_per_token"] = weight_bytes_per_token(weights) / (res["copy_gbs"] * 1e9) * 1e3
    with tempfile.TemporaryDirectory() as tmp:
        bundle = manifest_bundle(m, engine, Path(tmp) / "engine")
        ex = Executor(bundle, device="cuda", weights=weights, verify_hashes=False)
        del weights
        res["load_s"] = time.perf_counter() - t0
        try:
            graphs = ex.runner.graphs
            for mode in ("cuda_graphs", "eager"):
                ex.runner.graphs = graphs if mode == "cuda_graphs" else None   # eager: the same engine without them
                ss = single_stream(ex, m["vocab_size"])
                ss["vs_floor"] = ss["decode_ms_per_token"] / res["floor_ms_per_token"]
                res[f"single_stream_{mode}"] = ss
                print(f"single stream ({mode}): {ss['decode_ms_per_token']:.2f} ms/token ({ss['tok_s']:.0f} tok/s), "
                      f"floor {res['floor_ms_per_token']:.2f} ms -> {ss['vs_floor']:.2f}x floor", flush=True)
            ex.runner.graphs = graphs
            res["cuda_graphs"] = (graphs.failed or f"{len(graphs.graphs)} captured") if graphs is not None else "off"
            if not a.skip_throughput:
                tp = throughput(ex, m["vocab_size"], a.num_requests, a.isl, a.osl, a.max_seconds)
                res["throughput"] = tp
                print(f"throughput {a.num_requests} x {a.isl}/{a.osl}: {tp['output_tok_s']:.0f} output tok/s "
                      f"({'complete' if tp['complete'] else 'PARTIAL: stopped at --max-seconds'})", flush=True)
            res["peak_gpu_gib"] = torch.cuda.max_memory_allocated() / 2**30
        finally:
            ex.shutdown()
    return write_report(res, a.out, "gpu-bench")


if __name__ == "__main__":
    sys.exit(main())
