"""The kernel benchmarks' cases on Llama-3.1-8B shapes: each returns a zero-argument ``run()`` over inputs
allocated once on the GPU. ``gpu_kernels`` times them against their peers and ``sweep`` times them under
every candidate launch configuration (both import them from here)."""
from __future__ import annotations

from harness.perf.lib.models import LLAMA31_8B, attention_dims

LLAMA8B = attention_dims(LLAMA31_8B)   # the kernels' shapes: one Llama-3.1-8B layer


def _paged(batch, ctx, hkv, d, block, dtype):
    import torch
    nblk = batch * (ctx // block)
    tables = torch.randperm(nblk, device="cuda", dtype=torch.int32).view(batch, ctx // block)
    k = torch.randn(nblk, block, hkv, d, device="cuda").to(dtype)
    v = torch.randn(nblk, block, hkv, d, device="cuda").to(dtype)
    return k, v, tables


def decode_case(batch=64, ctx=2048, block=16, kv="bf16"):
    """Paged decode on Llama-3.1-8B heads: -> a zero-argument run() (inputs allocated once)."""
    import torch

    from plugins.paged_decode import paged_decode
    hq, hkv, d = LLAMA8B["num_heads"], LLAMA8B["num_kv_heads"], LLAMA8B["head_dim"]
    kv_dtype = torch.float8_e4m3fn if kv == "fp8" else torch.bfloat16
    k, v, tables = _paged(batch, ctx, hkv, d, block, torch.bfloat16)
    k, v = k.to(kv_dtype), v.to(kv_dtype)
    q = torch.randn(batch, hq, d, device="cuda", dtype=torch.bfloat16)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    one = torch.tensor(1.0, device="cuda")

    def run():
        return paged_decode(q, k, v, tables, lens, d ** -0.5, one, one, max_seq_len=ctx)
    run.tensors = (q, k, v, tables, lens, one)
    return run


def prefill_case(seqs=4, length=2048, block=16):
    import torch

    from plugins.paged_prefill import paged_prefill
    hq, hkv, d = LLAMA8B["num_heads"], LLAMA8B["num_kv_heads"], LLAMA8B["head_dim"]
    k, v, tables = _paged(seqs, length, hkv, d, block, torch.bfloat16)
    q = torch.randn(seqs * length, hq, d, device="cuda", dtype=torch.bfloat16)
    qsl = torch.arange(0, seqs + 1, device="cuda", dtype=torch.int32) * length
    ctx = torch.zeros(seqs, dtype=torch.int32, device="cuda")

    def run():
        return paged_prefill(q, k, v, tables, qsl, ctx, d ** -0.5, max_query_len=length)
    run.tensors = (q, k, v, tables)
    return run


def w4a16_case(m: int, n: int, k: int, fmt: str):
    import torch

    from plugins.gemm_w4a16 import w4a16_linear
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda")
    if fmt == "nvfp4":
        ws = torch.rand(n, k // 16, device="cuda").to(torch.float8_e4m3fn)
        args = (w, ws, torch.tensor(0.01, device="cuda"))
    else:
        args = (w, (torch.rand(n, k // 128, device="cuda") * 0.01).bfloat16())

    def run():
        return w4a16_linear(x, fmt, *args)
    run.x = x
    return run
