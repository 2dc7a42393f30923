"""The "triton" attention backend equals the "torch" reference backend on whole steps: mixed prefill +
decode batches, chunked prefill after cached context, verify passes of chains, speculative rows with a
tree mask, fp8 KV."""
import pytest
import torch

from backend.ops.attention import get_backend
from backend.ops.attention.metadata import AttentionMetadata
from plugins.reference.kv_cache import write_kv_ref
from tests.kernels.kernel_utils import assert_close


def _step(ctx, qlens, num_prefills, block_size, device, tree=None):
    """Metadata for one step: sequence b has ctx[b] cached tokens and qlens[b] new ones; blocks are
    handed out in a shuffled order; slot_mapping covers the new tokens (plus one -1 padding row)."""
    lens = [c + q for c, q in zip(ctx, qlens)]
    nblk = [-(-n // block_size) for n in lens]
    perm = torch.randperm(sum(nblk) + 2).tolist()
    tables = torch.zeros(len(lens), max(nblk), dtype=torch.int32)
    slots, positions, at = [], [], 0
    for b, (c, q) in enumerate(zip(ctx, qlens)):
        blocks = perm[at:at + nblk[b]]
        at += nblk[b]
        tables[b, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        for p in range(c, c + q):
            slots.append(blocks[p // block_size] * block_size + p % block_size)
            positions.append(p)
    qsl = [0]
    for q in qlens:
        qsl.append(qsl[-1] + q)
    meta = AttentionMetadata(
        positions=torch.tensor(positions, device=device), slot_mapping=torch.tensor(slots, device=device),
        block_tables=tables.to(device), seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        context_lens=torch.tensor(ctx, dtype=torch.int32, device=device), num_prefills=num_prefills,
        num_prefill_tokens=qsl[num_prefills], num_decode_tokens=qsl[-1] - qsl[num_prefills],
        max_query_len=max(qlens), max_seq_len=max(lens), tree_mask=tree)
    return meta, sum(nblk) + 2


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.float8_e4m3fn])
@pytest.mark.parametrize("ctx,qlens,num_prefills", [
    ([0, 40, 15, 70], [23, 9, 1, 1], 2),   # fresh prefill, chunked prefill, two decodes
    ([3, 100], [1, 1], 0),                 # decode-only step
    ([0], [37], 1),                        # prefill-only step
    ([3, 100, 33], [4, 1, 5], 0),          # verify pass of chains: row by row on the decode kernel
    ([20], [12], 0),                       # a query too long for that: the prefill kernel
])
def test_triton_backend_equals_torch_backend(device, fresh_seed, kv_dtype, ctx, qlens, num_prefills):
    hq, hkv, d, bs = 9, 3, 64, 16
    meta, num_blocks = _step(ctx, qlens, num_prefills, bs, device)
    ks = vs = None
    if kv_dtype == torch.float8_e4m3fn:
        ks, vs = torch.tensor(0.02, device=device), torch.tensor(0.03, device=device)
    outs, caches = [], []
    # the context's K/V: written by the reference path into both caches, so both read identical bytes
    history = {b: torch.randn(c, 2, hkv, d, device=device).half() for b, c in enumerate(ctx)}
    for name in ("torch", "triton"):
        be = get_backend(name, device)
        kc = torch.zeros(num_blocks, bs, hkv, d, device=device).to(kv_dtype)
        vc = torch.zeros_like(kc)
        for b, c in enumerate(ctx):
            if c:
                pos = torch.arange(c, device=device)
                slots = meta.block_tables[b].long()[pos // bs] * bs + pos % bs
                write_kv_ref(history[b][:, 0], history[b][:, 1], kc, vc, slots, ks, vs)
        torch.manual_seed(fresh_seed)
        q = torch.randn(sum(qlens), hq, d, device=device).half()
        k = torch.randn(sum(qlens), hkv, d, device=device).half()
        v = torch.randn(sum(qlens), hkv, d, device=device).half()
        be.write_kv(k, v, kc, vc, meta.slot_mapping, ks, vs)
        outs.append(be.forward(q, kc, vc, meta, d ** -0.5, ks, vs))
        caches.append((kc, vc))
    assert_close(outs[1], outs[0], torch.float16, f"backend ctx={ctx} q={qlens}", fresh_seed)
    # both backends store the same bytes (fp8: the same rounding of x / scale)
    for a, b in zip(*caches):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_triton_backend_tree_mask_speculative_rows(device, fresh_seed):
    # one decode row verifying a 4-token draft tree ([root, a, b, a.child]) after 30 cached tokens
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool, device=device)
    meta, num_blocks = _step([30], [4], 0, 16, device, tree=tree)
    outs = []
    for name in ("torch", "triton"):
        torch.manual_seed(fresh_seed)
        kc = torch.randn(num_blocks, 16, 2, 64, device=device).half()
        vc = torch.randn_like(kc)
        q = torch.randn(4, 4, 64, device=device).half()
        outs.append(get_backend(name, device).forward(q, kc, vc, meta, 0.125, None, None))
    assert_close(outs[1], outs[0], torch.float16, "tree rows", fresh_seed)
