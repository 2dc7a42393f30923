"""BlockManager: accounting, prefix cache (chained hashes, refcounts, LRU), tentative slots and
rollback, capacity planning. Pure Python: no model, no torch."""
import random
import subprocess
import sys

import pytest

from backend.engine.kv_cache import BlockManager
from backend.runtime.kv_capacity import kv_bytes_per_token, kv_capacity_blocks
from backend.engine.request import Request
from backend.engine.sampling_params import SamplingParams

BS = 4


def req(rid, tokens, max_tokens=8):
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens))


def compute(bm, r, n=None):
    """What the executor+scheduler do after a step: the reserved tokens now have KV."""
    r.num_computed_tokens = r.num_slots if n is None else n


def snapshot(bm, *reqs):
    return (list(bm._free), list(bm._evictable), dict(bm._cached), list(bm.ref_counts),
            list(bm.block_hash), [(list(r.block_ids), r.num_slots, r.num_tentative_tokens,
                                   r.num_committed_blocks) for r in reqs])


def test_pure_core_imports_no_torch():
    code = ("import sys; import backend.engine.kv_cache, backend.engine.kv_hashes, backend.engine.kv_checks, "
            "backend.runtime.kv_capacity, backend.engine.scheduler, "
            "backend.engine.scheduler_types, backend.engine.scheduler_policies, backend.engine.request, "
            "backend.engine.sampling_params; bad = [m for m in ('torch', 'numpy') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_bad_construction_arguments():
    with pytest.raises(ValueError, match=r"engine.kv_block_size: 6; allowed: a power of two"):
        BlockManager(8, 6)
    with pytest.raises(ValueError, match=r"num_blocks 0; allowed: an integer >= 1"):
        BlockManager(0, 4)


def test_allocate_append_free_accounting_and_slots():
    bm = BlockManager(8, BS)
    r = req("a", range(10, 20))                   # 10 tokens -> 3 blocks
    assert bm.allocate_for(r, 100) == 0
    assert r.block_ids == [0, 1, 2] and r.num_slots == 10
    assert (bm.num_used_blocks, bm.num_free_blocks) == (3, 5)
    assert [bm.slot(r, p) for p in (0, 3, 4, 9)] == [0, 3, 4, 9]
    compute(bm, r)
    r.all_token_ids.append(7)
    assert bm.append_slots(r, 1)                  # position 10 still fits block 2
    assert len(r.block_ids) == 3
    compute(bm, r)
    for t in (8, 9):
        r.all_token_ids.append(t)
        assert bm.append_slots(r, 1)
        compute(bm, r)
    assert r.block_ids == [0, 1, 2, 3] and bm.slot(r, 12) == 12
    with pytest.raises(AssertionError):
        bm.slot(r, 13)                            # not reserved
    bm.check_invariants()
    bm.free(r)
    assert bm.num_free_blocks == 8 and bm.num_used_blocks == 0 and r.block_ids == []
    bm.check_invariants()


def test_allocation_fails_atomically_when_pool_is_exhausted():
    bm = BlockManager(4, BS)
    a = req("a", range(12))
    assert bm.allocate_for(a, 12) == 0            # 3 blocks
    b = req("b", range(100, 108))
    before = snapshot(bm, a, b)
    assert bm.allocate_for(b, 8) is None          # needs 2, 1 free
    assert not bm.can_allocate(b, 8) and bm.can_allocate(b, 4)
    assert snapshot(bm, a, b) == before
    compute(bm, a)
    a.all_token_ids.extend([1, 2, 3, 4, 5])       # 17 tokens -> 5 blocks: only 4 exist
    assert not bm.append_slots(a, 5)
    assert len(a.block_ids) == 3 and bm.num_free_blocks == 1
    bm.check_invariants()


def test_prefix_hit_across_requests_and_last_token_always_computed():
    bm = BlockManager(16, BS)
    prompt = list(range(100, 110))                # 10 tokens: 2 full blocks + 2
    a = req("a", prompt)
    assert bm.allocate_for(a, 10) == 0
    compute(bm, a)
    bm.free(a)                                    # commits the 2 full computed blocks
    assert bm.num_cached_blocks == 2 and bm.num_evictable_blocks == 2
    b = req("b", prompt[:8] + [1, 2, 3])
    assert bm.lookup(b) == 8
    assert bm.allocate_for(b, 100) == 8
    assert b.num_computed_tokens == 8 and b.num_slots == 11 and b.num_cached_tokens == 8
    assert b.block_ids[:2] == a_blocks_first_two(bm, prompt)
    # Exactly 8 tokens (2 full blocks) identical: at most 1 block may hit, the last token computes.
    c = req("c", prompt[:8])
    assert bm.allocate_for(c, 100) == 4 and c.num_slots == 8
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (10 + 11 + 8, 8 + 4)
    # A different first block breaks the chain even though the second block's tokens match.
    d = req("d", [0, 0, 0, 0] + prompt[4:8] + [5])
    assert bm.lookup(d) == 0
    bm.check_invariants()


def a_blocks_first_two(bm, prompt):
    from backend.engine.kv_hashes import ROOT, hash_block
    h0 = hash_block(ROOT, prompt[:4])
    h1 = hash_block(h0, prompt[4:8])
    return [bm._cached[h0], bm._cached[h1]]


def test_refcounts_with_shared_prefix_and_in_use_hits_cost_no_free_blocks():
    bm = BlockManager(8, BS)
    prompt = list(range(50, 63))                  # 13 tokens
    a = req("a", prompt)
    bm.allocate_for(a, 13)
    compute(bm, a)
    a.all_token_ids.append(1)
    assert bm.append_slots(a, 1)                  # commits a's 3 full computed blocks
    shared = a.block_ids[:3]
    b = req("b", prompt + [9, 9])                 # shares 3 blocks, needs 1 more of its own
    assert bm.num_blocks_needed(b, 15) == 1
    free_before = bm.num_free_blocks
    assert bm.allocate_for(b, 15) == 12
    assert bm.num_free_blocks == free_before - 1
    assert b.block_ids[:3] == shared and all(bm.ref_counts[x] == 2 for x in shared)
    bm.check_invariants()
    bm.free(a)
    assert all(bm.ref_counts[x] == 1 for x in shared)
    assert bm.num_evictable_blocks == 0          # still in use by b
    bm.free(b)
    assert all(bm.ref_counts[x] == 0 for x in shared) and bm.num_free_blocks == 8
    bm.check_invariants()


def test_lru_eviction_order_tail_before_head_and_older_before_newer():
    bm = BlockManager(6, BS)
    a = req("a", range(0, 9))                     # 2 full blocks + 1
    b = req("b", range(100, 109))
    for r in (a, b):
        bm.allocate_for(r, 9)
        compute(bm, r)
    a_blocks, b_blocks = list(a.block_ids), list(b.block_ids)
    bm.free(a)
    bm.free(b)
    assert bm.num_cached_blocks == 4 and bm.num_free_blocks == 6
    # The 2 never-cached blocks go first, then a's tail, a's head, b's tail, b's head.
    x = req("x", range(500, 512))
    assert bm.allocate_for(x, 12) == 0            # 3 blocks: 2 uncached + a's tail
    assert set(x.block_ids) == {a_blocks[2], b_blocks[2], a_blocks[1]}
    assert bm.lookup(req("a2", range(0, 9))) == 4     # a's head survives, its tail is gone
    assert bm.lookup(req("b2", range(100, 109))) == 8
    y = req("y", range(600, 604))
    assert bm.allocate_for(y, 4) == 0
    assert y.block_ids == [a_blocks[0]]
    assert bm.lookup(req("a3", range(0, 9))) == 0
    assert bm.num_evictions == 2
    # A hit takes a block out of the LRU; freeing it again makes it the most recent.
    bm.free(x)
    bm.free(y)                                    # both uncached: back to the free stack
    c = req("c", range(200, 209))
    bm.allocate_for(c, 9)
    compute(bm, c)
    bm.free(c)                                    # LRU now: b tail, b head, c tail, c head
    z = req("z", range(100, 109))
    assert bm.allocate_for(z, 9) == 8
    compute(bm, z)
    bm.free(z)                                    # LRU now: c tail, c head, b tail, b head
    w = req("w", range(700, 712))                 # 3 blocks: 2 never-cached + evict c's tail
    assert bm.allocate_for(w, 12) == 0
    assert bm.lookup(req("c2", range(200, 209))) == 4
    assert bm.lookup(req("b3", range(100, 109))) == 8
    bm.check_invariants()


def test_tentative_then_full_rollback_restores_exact_state():
    bm = BlockManager(8, BS)
    other = req("o", range(40, 49))
    bm.allocate_for(other, 9)
    compute(bm, other)
    bm.free(other)                                # leaves cached evictable blocks in the pool
    r = req("r", range(7))
    bm.allocate_for(r, 7)
    compute(bm, r)
    before = snapshot(bm, r)
    assert bm.append_tentative(r, 6)              # 7 + 6 = 13 slots -> 4 blocks
    assert len(r.block_ids) == 4 and r.num_tentative_tokens == 6
    bm.rollback(r, 6)
    assert snapshot(bm, r) == before
    bm.check_invariants()


def test_speculative_accept_part_hashes_only_accepted_blocks():
    bm = BlockManager(8, BS)
    r = req("r", range(10, 17))                   # 7 tokens
    bm.allocate_for(r, 7)
    compute(bm, r)
    r.all_token_ids.append(20)                    # sampled token: 8 tokens, 7 computed
    assert bm.append_slots(r, 1, num_tentative=5)   # score token 7 + drafts at 8..12
    assert r.num_slots == 13 and len(r.block_ids) == 4
    # Verification accepts 1 draft (+ 1 bonus token): 3 drafts rejected.
    bm.rollback(r, 3)
    r.num_computed_tokens += 2
    r.all_token_ids.extend([21, 22])
    assert r.num_slots == 10 and len(r.block_ids) == 3 and r.num_tentative_tokens == 0
    assert bm.append_slots(r, 1)                  # commits blocks full of accepted, computed KV
    assert r.num_committed_blocks == 2 and bm.num_cached_blocks == 2
    bm.check_invariants()
    bm.free(r)
    assert bm.num_free_blocks == 8
    with pytest.raises(AssertionError, match="tentative"):
        bm.rollback(req("q", [1]), 1)


def test_reset_prefix_cache_forgets_everything():
    bm = BlockManager(4, BS)
    a = req("a", range(9))
    bm.allocate_for(a, 9)
    compute(bm, a)
    bm.free(a)
    assert bm.reset_prefix_cache() == 2
    assert bm.num_cached_blocks == 0 and bm.lookup(req("b", range(9))) == 0
    bm.check_invariants()


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("caching", [True, False])
def test_random_workload_never_leaks(seed, caching):
    rng = random.Random(seed)
    bm = BlockManager(24, BS, enable_prefix_caching=caching)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(4, 20))] for _ in range(3)]
    live: list[Request] = []
    for step in range(400):
        op = rng.random()
        if op < 0.3 and len(live) < 8:
            toks = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 9))]
            r = req(f"r{step}", toks)
            if bm.allocate_for(r, rng.randrange(1, 32)) is not None:
                live.append(r)
        elif op < 0.8 and live:
            # Finish the reserved step: some drafts accepted, KV computed, tokens sampled.
            r = rng.choice(live)
            if r.num_tentative_tokens:
                bm.rollback(r, rng.randrange(r.num_tentative_tokens + 1))
            compute(bm, r)
            while len(r.all_token_ids) <= r.num_computed_tokens:
                r.all_token_ids.append(rng.randrange(50))
            k = rng.randrange(3)
            bm.append_slots(r, len(r.all_token_ids) - r.num_computed_tokens, num_tentative=k)
        elif live:
            bm.free(live.pop(rng.randrange(len(live))))
        bm.check_invariants()
        assert bm.num_used_blocks + bm.num_free_blocks == bm.num_blocks
    for r in live:
        bm.free(r)
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks and bm.num_holders == 0
    if caching:
        assert bm.prefix_cache_hits > 0


def test_kv_capacity_explicit_device_and_cpu(tmp_path):
    per_tok = kv_bytes_per_token(num_layers=30, num_kv_heads=3, head_dim=64, dtype_bytes=2)
    assert per_tok == 2 * 30 * 3 * 64 * 2
    assert kv_capacity_blocks(16, per_tok, max_kv_tokens=1000) == 63
    gib = 2**30
    assert kv_capacity_blocks(16, per_tok, free_device_bytes=10 * gib, free_mem_fraction=0.5) == \
        (5 * gib) // (16 * per_tok)
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 100 kB\nMemAvailable:    8388608 kB\n")   # 8 GiB
    blocks = kv_capacity_blocks(16, per_tok, cpu_ram_fraction=0.1, meminfo_path=str(meminfo))
    assert blocks == int(8 * gib * 0.1) // (16 * per_tok)
    assert kv_capacity_blocks(16, per_tok, meminfo_path=str(meminfo), max_useful_tokens=4096) == 256
    # The real /proc/meminfo of this machine gives some positive capacity.
    assert kv_capacity_blocks(16, per_tok, max_useful_tokens=2048) == 128


def test_kv_capacity_errors(tmp_path):
    with pytest.raises(ValueError, match=r"cannot hold one sequence of 2048 tokens"):
        kv_capacity_blocks(16, 1000, free_device_bytes=10**6, min_tokens=2048)
    with pytest.raises(ValueError, match=r"engine.max_kv_tokens: 0; allowed"):
        kv_capacity_blocks(16, 1000, max_kv_tokens=0)
    with pytest.raises(ValueError, match=r"engine.kv_cache_free_mem_fraction: 1.5; allowed: \(0, 1\]"):
        kv_capacity_blocks(16, 1000, free_device_bytes=10**9, free_mem_fraction=1.5)
    with pytest.raises(ValueError, match=r"cannot read .*nope.*set engine.max_kv_tokens"):
        kv_capacity_blocks(16, 1000, meminfo_path=str(tmp_path / "nope"))
    bad = tmp_path / "meminfo"
    bad.write_text("MemTotal: 1 kB\n")
    with pytest.raises(ValueError, match=r"no MemAvailable line"):
        kv_capacity_blocks(16, 1000, meminfo_path=str(bad))


def test_tentative_reservation_fails_atomically_and_reserved_blocks_count():
    bm = BlockManager(3, BS)
    r = req("r", range(7))                        # 2 blocks
    bm.allocate_for(r, 7)
    compute(bm, r)
    before = snapshot(bm, r)
    assert not bm.append_tentative(r, 9)          # 16 slots = 4 blocks > 3
    assert snapshot(bm, r) == before
    assert bm.append_tentative(r, 0) and snapshot(bm, r) == before
    other = req("o", range(50, 54))
    assert bm.can_allocate(other, 4) and not bm.can_allocate(other, 4, reserved_blocks=1)


def test_identical_prefixes_computed_concurrently_keep_one_cached_copy():
    bm = BlockManager(8, BS)
    a, b = req("a", range(9)), req("b", range(9))
    assert bm.allocate_for(a, 9) == 0 and bm.allocate_for(b, 9) == 0   # nothing cached yet
    compute(bm, a)
    compute(bm, b)
    bm.free(a)
    bm.free(b)                                    # same hashes: b's copies stay uncached
    assert bm.num_cached_blocks == 2 and bm.num_free_blocks == 8
    assert bm.lookup(req("c", range(9))) == 8
    bm.check_invariants()


# -- sliding windows ---------------------------------------------------------------------------------

@pytest.mark.parametrize("window", [1, 5, 8, 9])
@pytest.mark.parametrize("caching", [False, True])
def test_a_window_releases_exactly_the_blocks_no_later_query_reads(window, caching):
    # the query at position p reads keys p - window < k <= p; a block may go once every key in it is at
    # most p - window for the next position p to compute (every later query reads less far back)
    bm = BlockManager(64, BS, enable_prefix_caching=caching, window=window)
    r = req("r", range(100, 103), max_tokens=60)
    assert bm.allocate_for(r, 3) == 0
    for p in range(3, 60):
        compute(bm, r)
        r.all_token_ids.append(p)
        assert bm.append_slots(r, 1)
        unread = sum(1 for i in range(len(r.block_ids)) if (i + 1) * BS - 1 <= p - window)
        assert r.num_released_blocks == unread, (p, r.num_released_blocks, unread)
        assert bm.held_blocks(r) <= bm.most_blocks(p + 1, 1)
        bm.check_invariants()
    bm.free(r)
    bm.check_invariants()
    assert bm.num_free_blocks == 64 and bm.num_released_blocks == bm.stats()["kv_window_released_blocks"] > 0


def _cache_then_evict_head(bm, tokens, n: int) -> None:
    """A request's blocks computed, freed (so cached), then its first ``n`` blocks evicted."""
    r = req("cached", tokens)
    assert bm.allocate_for(r, len(r.all_token_ids)) == 0
    compute(bm, r)
    blocks = list(r.block_ids)
    bm.free(r)
    for b in blocks[:n]:   # what eviction does to a block (kv_cache.BlockManager._take)
        bm._cached.pop(bm.block_hash[b])
        bm.block_hash[b] = None
        del bm._evictable[b]
        bm._free.append(b)
    bm.check_invariants()


def test_with_a_window_a_prefix_hit_needs_only_the_last_windows_blocks():
    bm = BlockManager(64, BS, enable_prefix_caching=True, window=6)
    # 40 tokens cached, then the first three blocks evicted: a prefix stays usable as long as the blocks
    # its last window reads are there
    _cache_then_evict_head(bm, range(40), 3)
    b = req("b", list(range(40)) + [7, 7])
    served = bm.lookup(b)
    assert served == 40                               # blocks 0-2 gone, yet every prompt block counts
    assert bm.allocate_for(b, 2) == 40
    # resuming at position 40, keys from 35 on are read: blocks 8 and 9 hit, 0-7 are released
    assert b.num_released_blocks == 8 and bm.held_blocks(b) == len(b.block_ids) - 8
    bm.check_invariants()
    # without a window the same cache serves nothing: a prefix is cached from its first block on
    full = BlockManager(64, BS, enable_prefix_caching=True)
    _cache_then_evict_head(full, range(40), 1)
    assert full.lookup(req("d", list(range(40)) + [7])) == 0
    assert full.lookup(req("e", list(range(4)) + [7])) == 0 and len(full._cached) == 9


def test_a_window_bounds_what_a_request_can_ever_need():
    bm = BlockManager(16, BS, window=8)
    assert bm.most_blocks(4000, 4) == -(-(4 + 8 - 1) // BS) + 1 == 4
    assert bm.most_blocks(6, 4) == 2                   # short: all its blocks
    assert BlockManager(16, BS).most_blocks(4000, 4) == 1000
    with pytest.raises(ValueError, match="window 0; allowed: an integer >= 1 or None"):
        BlockManager(16, BS, window=0)
