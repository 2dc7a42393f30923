"""Consistency checks of a ``BlockManager`` (tests and debugging; pure Python, no torch): the pool is a
partition of free, evictable and used blocks, and the refcounts are what the block tables hold."""
from __future__ import annotations


def check_invariants(bm) -> None:
    """Assert the pool is a consistent partition and refcounts match the block tables (the entries a
    sliding window released are not held)."""
    counts = [0] * bm.num_blocks
    for req in bm._holders.values():
        for b in req.block_ids[req.num_released_blocks:]:
            counts[b] += 1
        assert len(req.block_ids) == -(-req.num_slots // bm.block_size), req
    assert counts == bm.ref_counts, "refcounts do not match the block tables"
    free, evictable = set(bm._free), set(bm._evictable)
    assert len(free) == len(bm._free) and not (free & evictable)
    for b in range(bm.num_blocks):
        in_pool = b in free or b in evictable
        assert in_pool == (bm.ref_counts[b] == 0), f"block {b}: pool membership vs refcount"
        if b in free:
            assert bm.block_hash[b] is None
        if b in evictable:
            assert bm.block_hash[b] is not None
    for h, b in bm._cached.items():
        assert bm.block_hash[b] == h
    assert sum(h is not None for h in bm.block_hash) == len(bm._cached)


__all__ = ["check_invariants"]
