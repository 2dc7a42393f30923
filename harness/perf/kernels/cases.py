"""The kernel benchmarks' cases on Llama-3.1-8B shapes, each over inputs allocated once on the GPU:
eager cases (a zero-argument ``run()``) and decode-sized cases as lists of calls over weight or cache
copies larger than L2 (``graphed`` captures them as one CUDA graph, so a time is the kernel's and the
bytes stream from HBM as in a graphed decode step). ``gpu_kernels`` times them against their peers,
``sweep`` under every candidate launch configuration; ``dry_run`` runs the graphed cases' calls once at
toy sizes in the interpreter against their references."""
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


def graphed(calls: list, min_calls: int = 48):
    """``calls`` (zero-argument functions) captured as one CUDA graph, the list repeated to at least
    ``min_calls`` so a replay's own launch is a small part of it: -> (replay, calls per replay). Times
    of small kernels then leave the host's launch costs out, as a graphed decode step does."""
    import torch
    for fn in calls:           # compile outside the capture
        fn()
    torch.cuda.synchronize()
    rounds = -(-min_calls // len(calls))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(rounds):
            for fn in calls:
                fn()
    return g.replay, rounds * len(calls)


def decode_calls(batch: int, ctx: int, kv: str = "fp8", device: str = "cuda", l2_bytes: int = 1 << 28,
                 heads: dict | None = None, block: int = 16):
    """Paged decode at (batch, ctx) over KV-cache copies that together exceed ``l2_bytes`` (b1 ctx 8192
    fp8 on Llama-3-8B heads is 16.8 MB: one copy would stay in an H100's 50 MB L2 across a graph's
    replays) -> (calls, (q, k, v, tables, lens, scale, num_splits) of copy 0)."""
    import torch

    from plugins import paged_decode as pd
    h = heads or LLAMA8B
    hq, hkv, d = h["num_heads"], h["num_kv_heads"], h["head_dim"]
    kv_dtype = torch.float8_e4m3fn if kv == "fp8" else torch.bfloat16
    per_copy = 2 * batch * ctx * hkv * d * (1 if kv == "fp8" else 2)
    copies = max(1, -(-l2_bytes // per_copy))
    nblk = batch * (-(-ctx // block))
    q = torch.randn(batch, hq, d, device=device, dtype=_act(device))
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    scale = torch.tensor(1.0, device=device)
    caches = []
    for _ in range(copies):
        tables = torch.randperm(nblk, device=device).to(torch.int32).view(batch, -1)
        k = torch.randn(nblk, block, hkv, d, device=device).to(kv_dtype)
        v = torch.randn(nblk, block, hkv, d, device=device).to(kv_dtype)
        caches.append((k, v, tables))
    calls = [lambda c=c: pd.paged_decode(q, c[0], c[1], c[2], lens, d ** -0.5, scale, scale, max_seq_len=ctx)
             for c in caches]
    fp8 = kv == "fp8"
    target = pd._target_programs(q.device, fp8)
    splits = pd.choose_splits(batch, hkv, ctx, target, pd._cfg(fp8)["tile"], pd._split_target(target, pd._cfg(fp8)))[0]
    k, v, tables = caches[0]
    return calls, (q, k, v, tables, lens, scale, splits)


def fp8_small_m_case(m: int, n: int, k: int, path: str = "kernel", l2_bytes: int = 1 << 28):
    """FP8 W8A8 at M rows: -> list of zero-argument calls over weight copies that together exceed
    ``l2_bytes`` (so the weight streams from HBM as in a decode step), and the tensors of copy 0.
    path: "kernel" (plugins/gemm_fp8_small.py) or "scaled_mm" (torch._scaled_mm, rowwise scales)."""
    import torch

    from plugins.gemm_fp8_small import fp8_gemm_small_m, lock_count
    fp8 = torch.float8_e4m3fn
    copies = max(2, -(-l2_bytes // (n * k)))
    xq = (torch.randn(m, k, device="cuda") * 30).clamp(-448, 448).to(fp8)
    ws = [(torch.randn(n, k, device="cuda") * 100).clamp(-448, 448).to(fp8) for _ in range(copies)]
    wsc = torch.rand(n, device="cuda") * 0.01 + 1e-3
    xs = torch.tensor(0.02, device="cuda")
    locks = torch.zeros(lock_count(n), dtype=torch.int32, device="cuda")
    if path == "kernel":
        calls = [lambda w=w: fp8_gemm_small_m(xq, w, wsc, xs, torch.bfloat16, locks=locks) for w in ws]
    else:
        sa, sb = xs.reshape(1, 1).repeat(m, 1), wsc.view(1, n)
        calls = [lambda w=w: torch._scaled_mm(xq, w.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
                 for w in ws]
    return calls, (xq, ws[0], wsc, xs)


def w4a16_weights(n: int, k: int, fmt: str, device: str = "cuda"):
    """Random packed 4-bit weights of one format: (weight, weight_scale, weight_scale_2 or None)."""
    import torch
    w = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device)
    if fmt == "nvfp4":
        return w, (torch.rand(n, k // 16, device=device) * 2 + 0.1).to(torch.float8_e4m3fn), \
            torch.tensor(0.01, device=device)
    return w, (torch.rand(n, k // 128, device=device) * 0.01 + 1e-3).to(_act(device)), None


def _act(device: str):
    """The activation dtype: bf16 on GPUs, fp16 in the interpreter (its bf16 dots are wrong)."""
    import torch
    return torch.bfloat16 if device == "cuda" else torch.float16


def w4a16_small_m_calls(m: int, n: int, k: int, fmt: str, path: str = "kernel", device: str = "cuda",
                        l2_bytes: int = 1 << 28):
    """W4A16 at M rows: -> (calls over weight copies that together exceed ``l2_bytes``, (x, weight,
    weight_scale, weight_scale_2, locks) of copy 0). path "kernel": plugins/gemm_w4a16_small.py through
    w4a16_linear, as a linear calls it (its own split-K counters); "bf16": torch.matmul on a dense weight."""
    import torch

    from plugins.gemm_w4a16 import w4a16_linear
    from plugins.gemm_w4a16_small import lock_count
    act = _act(device)
    x = torch.randn(m, k, device=device, dtype=act)
    locks = torch.zeros(lock_count(n), dtype=torch.int32, device=device)
    if path == "bf16":
        copies = max(2, -(-l2_bytes // (2 * n * k)))
        dense = [torch.randn(n, k, device=device, dtype=act) for _ in range(copies)]
        return [lambda w=w: x @ w.t() for w in dense], (x, dense[0], None, None, locks)
    copies = max(2, -(-l2_bytes // (n * k // 2)))
    ws = [w4a16_weights(n, k, fmt, device) for _ in range(copies)]
    calls = [lambda c=c: w4a16_linear(x, fmt, c[0], c[1], c[2], locks=locks) for c in ws]
    return calls, (x, *ws[0], locks)


W4A16_SMALL_M_SHAPES = [(4096, 4096), (14336, 4096)]   # (N, K): o/qkv-like, up/gate
DECODE_GRAPHED = [(1, 8192, "fp8"), (64, 2048, "fp8")]  # the two FP8-KV decode goals


def dry_run() -> int:
    """The graphed cases' calls once each at toy sizes on CPU (Triton interpreter), against their
    references: the bench's own code paths are checked where no GPU is. No timing."""
    from plugins.reference.attention import paged_decode_ref
    from plugins.reference.gemm import int4_awq_linear_ref, nvfp4_linear_ref
    toy = dict(num_heads=4, num_kv_heads=2, head_dim=64)
    worst = 0.0
    for batch, ctx, kv in ((1, 300, "fp8"), (3, 64, "fp8")):
        calls, (q, k, v, tables, lens, scale, splits) = decode_calls(batch, ctx, kv, "cpu", l2_bytes=1, heads=toy)
        out = calls[0]()
        ref = paged_decode_ref(q, k, v, tables, lens, 0.125, scale, scale)
        err = (out.float() - ref.float()).abs().max().item()
        print(f"  dry-run decode b{batch} ctx{ctx} {kv} splits={splits}: max err {err:.2e}")
        worst = max(worst, err / 2e-2)
    for fmt in ("nvfp4", "int4_awq"):
        for m in (1, 4, 16):
            calls, (x, w, ws, ws2, locks) = w4a16_small_m_calls(m, 96, 512, fmt, "kernel", "cpu", l2_bytes=1)
            ref = nvfp4_linear_ref(x, w, ws, ws2) if fmt == "nvfp4" else int4_awq_linear_ref(x, w, ws)
            err = ((calls[0]().float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            print(f"  dry-run w4a16 {fmt} m={m}: max rel err {err:.2e}, counters left {int(locks.abs().sum())}")
            worst = max(worst, err / 5e-3, 1e9 * int(locks.abs().sum()))
    print("dry-run: ok" if worst <= 1 else "dry-run: FAILED (an error above its bound)")
    return 0 if worst <= 1 else 1
