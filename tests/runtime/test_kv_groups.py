"""GroupedBlockManager: the full layers' pool and the sliding layers' own, reserved together or not at
all, the sliding pool releasing what falls behind the window, a prefix reused only as far as both pools
serve it. Pure Python: no model, no torch."""
import random
import subprocess
import sys

import pytest

from backend.engine.kv_cache import BlockManager
from backend.engine.kv_groups import GroupedBlockManager
from backend.engine.request import Request
from backend.engine.sampling_params import SamplingParams

BS, W = 4, 6


def req(rid, tokens, max_tokens=8):
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens))


def grouped(full=24, window=10, caching=True):
    return GroupedBlockManager(BlockManager(full, BS, caching), BlockManager(window, BS, caching, window=W))


def pools(bm):
    return [(list(p._free), list(p._evictable), list(p.ref_counts)) for p in (bm.full_pool, bm.window_pool)]


def test_pure_and_checked_at_construction():
    code = ("import sys; import backend.engine.kv_groups; bad = [m for m in ('torch', 'numpy') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
    with pytest.raises(ValueError, match="full layers' pool has no window"):
        GroupedBlockManager(BlockManager(8, BS, window=W), BlockManager(8, BS, window=W))
    with pytest.raises(ValueError, match="same block size"):
        GroupedBlockManager(BlockManager(8, BS), BlockManager(8, 2 * BS, window=W))


def test_the_sliding_pool_releases_what_the_window_left_and_the_full_pool_keeps_all():
    bm = grouped()
    r = req("a", range(30))
    assert bm.allocate_for(r, 30) == 0
    s = r.window_kv
    assert len(r.block_ids) == len(s.block_ids) == 8          # 30 tokens: 8 blocks in each pool
    r.num_computed_tokens = 30
    r.all_token_ids.append(99)
    assert bm.append_slots(r, 1)
    # the next query (position 30) reads keys 25..30: blocks 6 and 7 of the sliding pool
    assert s.num_released_blocks == 25 // BS == 6 and bm.window_pool.held_blocks(s) == 2
    assert bm.held_blocks(r) == 8 and r.num_released_blocks == 0
    for pos in range(25, 31):                                 # what the window reads is there
        assert bm.window_slot(r, pos) // BS == s.block_ids[pos // BS]
    bm.free(r)
    bm.check_invariants()
    assert bm.full_pool.num_free_blocks == 24 and bm.window_pool.num_free_blocks == 10


def test_a_refusal_by_either_pool_changes_neither():
    bm = grouped(full=24, window=3)
    r = req("a", range(16))
    assert bm.allocate_for(r, 16) is None                      # 3 sliding blocks for 16 tokens: too few
    assert not r.block_ids and r.window_kv.block_ids == []
    assert bm.allocate_for(r, 8) == 0
    r.num_computed_tokens = 8
    before = pools(bm)
    # 8 more tokens: the sliding pool needs 2 more blocks (none is behind the window yet) and has 1
    assert not bm.append_slots(r, 8)
    assert pools(bm)[0] == before[0] and len(r.block_ids) == 2 and r.num_slots == 8
    # the sliding pool has room but the full pool does not: what the sliding pool took goes back
    bm2 = grouped(full=3, window=10)
    r2 = req("b", range(8))
    assert bm2.allocate_for(r2, 8) == 0
    r2.num_computed_tokens = 8
    snap = pools(bm2)
    assert not bm2.append_slots(r2, 4, num_tentative=2)
    assert pools(bm2)[0] == snap[0]
    assert len(r2.window_kv.block_ids) == 2 and r2.window_kv.num_tentative_tokens == 0
    bm2.check_invariants()


def test_a_prefix_is_reused_as_far_as_both_pools_serve_it():
    bm = grouped(full=24, window=10)
    a = req("a", range(20))
    bm.allocate_for(a, 20)
    a.num_computed_tokens = 20
    bm.free(a)                                                 # both pools keep 5 cached blocks
    b = req("b", list(range(20)) + [7, 7])
    assert bm.lookup(b) == 20 and bm.allocate_for(b, 22) == 20
    assert b.num_computed_tokens == 20 == b.num_cached_tokens
    bm.free(b)
    # a 40-token request takes all 10 blocks of the sliding pool, evicting its copy of the prefix; the
    # full pool (24) takes never-cached blocks first and keeps it: only the full pool could serve it now
    d = req("d", range(100, 140))
    assert bm.allocate_for(d, 40) == 0
    bm.free(d)
    c = req("c", list(range(20)) + [8])
    assert bm.full_pool.lookup(c) == 20 and bm.lookup(c) == 0
    assert bm.allocate_for(c, 21) == 0 and c.num_computed_tokens == 0
    bm.check_invariants()


@pytest.mark.parametrize("seed", range(6))
def test_random_workload_never_leaks_and_keeps_every_window(seed):
    rng = random.Random(seed)
    bm = grouped(full=40, window=16)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(4, 24))] for _ in range(3)]
    live: list[Request] = []
    for step in range(500):
        op = rng.random()
        if op < 0.3 and len(live) < 6:
            r = req(f"r{step}", rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 9))])
            if bm.allocate_for(r, rng.randrange(1, 12)) is not None:
                live.append(r)
        elif op < 0.85 and live:
            r = rng.choice(live)
            if r.num_tentative_tokens:
                bm.rollback(r, rng.randrange(r.num_tentative_tokens + 1))
            r.num_computed_tokens = r.num_slots
            while len(r.all_token_ids) <= r.num_computed_tokens:
                r.all_token_ids.append(rng.randrange(50))
            new = len(r.all_token_ids) - r.num_computed_tokens
            if rng.random() < 0.5 and new == 1 and len(r.all_token_ids) <= r.slot_room:
                r.num_slots = len(r.all_token_ids)            # the scheduler's decode fast path
            elif not bm.append_slots(r, new, num_tentative=rng.randrange(3)):
                bm.free(r)
                live.remove(r)
                continue
        elif live:
            bm.free(live.pop(rng.randrange(len(live))))
        bm.check_invariants()
        for r in live:                                         # every key a query may read is held
            s = r.window_kv
            assert s.num_released_blocks <= max(r.num_computed_tokens - W + 1, 0) // BS
            assert len(s.block_ids) == len(r.block_ids) == -(-r.num_slots // BS)
    for r in live:
        bm.free(r)
    bm.check_invariants()
    assert bm.full_pool.num_free_blocks == 40 and bm.window_pool.num_free_blocks == 16
    assert bm.num_holders == 0 and bm.window_pool.num_holders == 0
    assert bm.window_pool.num_released_blocks > 0 and bm.full_pool.prefix_cache_hits > 0
