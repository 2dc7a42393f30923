"""Helpers shared by the kernel tests (poisoned outputs, per-dtype error bounds, paged-cache setup)."""
import torch


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill an output buffer with NaN (or 0xFF bytes for fp8/ints) so unwritten elements show up."""
    if t.dtype.is_floating_point and t.dtype != torch.float8_e4m3fn:
        return t.fill_(float("nan"))
    return t.view(torch.uint8).fill_(0x7F).view(t.dtype) if t.dtype == torch.float8_e4m3fn else t.fill_(-1)


# relative error bounds per compute dtype: fp16 (10-bit mantissa), bf16 (7-bit), fp32 (exact in the
# interpreter; on a GPU tl.dot rounds fp32 inputs to tf32, a 10-bit mantissa, hence the looser bound)
TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 2e-3}
TOL_GPU_FP32 = 5e-3


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str, seed: int,
                 tol: float | None = None):
    """max |out - ref| <= tol (default TOL[dtype]) * max(1, max |ref|), with no NaN anywhere."""
    if tol is None:
        tol = TOL_GPU_FP32 if (dtype == torch.float32 and out.is_cuda) else TOL[dtype]
    out, ref = out.float().cpu(), ref.float().cpu()
    assert not torch.isnan(out).any(), f"{what}: NaN in output (unwritten element?) seed={seed}"
    err = (out - ref).abs().max().item() if out.numel() else 0.0
    bound = tol * max(1.0, ref.abs().max().item() if ref.numel() else 0.0)
    assert err <= bound, f"{what}: max abs error {err:.3g} > {bound:.3g} ({dtype}) seed={seed}"


def make_paged(lens, block_size, num_kv_heads, head_dim, dtype, device, spare_blocks=3):
    """Random K/V caches with a shuffled block table for sequences of the given lengths.

    -> (k_cache, v_cache, block_tables [B, max_blocks] int32); unused table entries are 0, and blocks
    are handed out in random order so a kernel that ignores the table reads the wrong tokens.
    """
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + spare_blocks
    perm = torch.randperm(num_blocks)
    width = max(1, max(need) if need else 1)
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    at = 0
    for b, nb in enumerate(need):
        tables[b, :nb] = perm[at:at + nb].int()
        at += nb
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k = torch.randn(shape, device=device).to(dtype)
    v = torch.randn(shape, device=device).to(dtype)
    return k, v, tables.to(device)


def to_fp8_cache(cache: torch.Tensor, scale: float) -> torch.Tensor:
    """Quantize a cache to float8_e4m3fn outside any kernel (the interpreter's own casts are wrong)."""
    return (cache.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
