"""The fused MoE kernel (plugins/fused_moe.py) and its align step (plugins/moe_align.py) against the
reference (plugins/reference/moe.py), in the interpreter: uneven expert loads with experts that get no
token, top-k 1 to 8, up to 128 experts, decode (T = 1) and an odd T, fp32 / fp16 / bf16 activations and
fp8 e4m3 experts with per-expert scales; outputs and scratch poisoned so an unwritten row fails. Shapes
are tiny (H, I in 16..64): every program costs Python time here. bf16 runs its dots in fp32 in the
interpreter (its bf16 tl.dot is wrong); the bf16 tensor-core path is checked on a GPU
(KILN_KERNEL_TESTS_ON_GPU=1)."""
import pytest
import torch

from plugins.moe_align import max_padded, moe_align
from plugins.reference.moe import align_ref


def routing(T: int, k: int, E: int, device: str):
    """Top-k ids drawn with a skewed load (expert e weighted 1 / (e + 1)^2, the upper half of the experts
    never chosen where k allows it: experts with no token) and positive weights."""
    used = max(k, E // 2)
    p = torch.zeros(E)
    p[:used] = 1.0 / (torch.arange(used, dtype=torch.float32) + 1) ** 2
    p = p[torch.randperm(E)]                       # the empty experts anywhere, not only at the end
    ids = torch.stack([torch.multinomial(p, k) for _ in range(T)]) if T else torch.zeros(0, k, dtype=torch.long)
    return ids.to(device), torch.rand(T, k, device=device) + 0.05


@pytest.mark.parametrize("T,k,E,block", [(37, 2, 8, 16), (1, 8, 128, 16), (5, 1, 3, 4), (9, 4, 16, 64), (0, 2, 4, 16)])
def test_align_matches_reference_and_brute_force(device, T, k, E, block):
    ids, _ = routing(T, k, E, device)
    s_ref, e_ref, P = align_ref(ids, E, block)
    flat = ids.reshape(-1).tolist()
    n = len(flat)
    # brute force: each expert's slots, in order, then padding, in ceil(count / block) blocks of its own
    at = 0
    for e in range(E):
        slots = [s for s, x in enumerate(flat) if x == e]
        nb = -(-len(slots) // block)
        assert s_ref[at:at + len(slots)].tolist() == slots
        assert (s_ref[at + len(slots):at + nb * block] == n).all()
        assert (e_ref[at // block:at // block + nb] == e).all()
        at += nb * block
    assert P == at == len(s_ref) == len(e_ref) * block
    sorted_ids, expert_ids, npad = moe_align(ids, E, block)
    size = max_padded(n, E, block)
    assert sorted_ids.shape == (size,) and expert_ids.shape == (size // block,) and size >= P
    assert npad.tolist() == [P]
    assert torch.equal(sorted_ids[:P], s_ref) and (sorted_ids[P:] == n).all()
    assert torch.equal(expert_ids[:P // block], e_ref)
