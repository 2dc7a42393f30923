"""Paged KV cache bookkeeping: blocks, block tables, refcounts and the prefix cache (no torch).

The tensors live in the model runner; this module only decides which block holds which tokens.

Prefix caching: a FULL block is named by a chained hash ``H_i = blake2b(H_{i-1} || tokens_i)``, so
equal hashes mean equal token prefixes up to and including that block. A block gets its hash
("committed") only once its KV has been computed, i.e. once ``request.num_computed_tokens`` covers it
(a block registered at allocation time could be freed by a preemption in the same step before its KV
is written, and a later hit would read garbage). Freed blocks that carry a hash stay reusable in an
LRU pool and are evicted only when no never-cached free block is left.

Speculative decoding: ``append_slots(..., num_tentative=k)`` / ``append_tentative`` reserve slots for
unverified tokens, ``rollback(request, n)`` returns the last ``n``; tentative tokens are never hashed
because hashes only cover ``all_token_ids`` (accepted tokens) up to ``num_computed_tokens``.

Sliding windows: when every layer of the model attends to at most ``window`` trailing tokens
(``BlockManager(window=W)``), the query at position ``p`` reads keys ``p - W < k <= p`` only, and no
later query reads further back. So once ``num_computed_tokens`` is ``p``, every block that ends at or
before ``p - W`` is released (``num_released_blocks``: the leading entries of ``block_ids`` the request
no longer holds; committed blocks stay cached like any freed block). A sequence then holds about
``W / block_size`` blocks plus its step's chunk however long it grows. The released entries stay in
the block table (their ids may be reused by other requests): the attention masks those positions, so
what the table points to there is never used.

A request's ``block_ids`` list is only ever appended to in place; any other change (free, rollback,
re-admission) installs a new list. Consumers that keep a copy (``backend/engine/inputs.py``) rely on that,
or read the opt-in ``block_table_changes`` log.

Not thread-safe: the executor's loop thread (or its lock) owns the scheduler and this manager.
"""
from __future__ import annotations

from collections import OrderedDict

from backend.engine.kv_checks import check_invariants
from backend.engine.kv_hashes import extend_hashes
from backend.engine.request import Request

class BlockManager:
    """Fixed-size KV blocks shared by all requests.

    Block states: *free* (refcount 0, no hash; handed out first), *evictable* (refcount 0 with a
    hash; LRU order, reused on a prefix hit or evicted when free runs out), *used* (refcount > 0).
    """

    window_pool = None   # one pool for every layer (backend/engine/kv_groups.py gives sliding layers theirs)

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 window: int | None = None) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"kv cache: num_blocks {num_blocks!r}; allowed: an integer >= 1")
        if not isinstance(block_size, int) or block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"engine.kv_block_size: {block_size!r}; allowed: a power of two >= 1")
        if window is not None and (not isinstance(window, int) or window < 1):
            raise ValueError(f"kv cache: window {window!r}; allowed: an integer >= 1 or None")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.window = window               # see "Sliding windows" above; None: every token stays
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}            # hash -> block holding that prefix
        # Stack of never-cached free blocks; popping from the end hands out block 0 first.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._evictable: OrderedDict[int, None] = OrderedDict()   # least recently used first
        self._holders: dict[str, Request] = {}         # requests that hold blocks (leak checks)
        # Requests whose block list changed (grew, was replaced or emptied) since the consumer
        # (input preparation) last cleared this list: it then refreshes only those block-table rows
        # instead of checking every sequence every step. None (off) until a consumer asks for it:
        # an unread log would grow forever.
        self.block_table_changes: list[Request] | None = None
        # Counters (tokens): prompt tokens looked up at admission and how many were cached.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.num_evictions = 0
        # Counters (blocks): taken from the pool for a request, and cached blocks a request reused
        self.num_alloc_new_blocks = 0
        self.num_reused_blocks = 0
        self.num_released_blocks = 0   # blocks given back because they fell out of every window

    # -- counters -----------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that an allocation can take (never-cached free + evictable cached)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free) - len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a reusable prefix (in use or evictable)."""
        return len(self._cached)

    @property
    def num_evictable_blocks(self) -> int:
        return len(self._evictable)

    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def stats(self) -> dict:
        return {"kv_blocks_total": self.num_blocks, "kv_blocks_used": self.num_used_blocks,
                "kv_blocks_free": self.num_free_blocks, "kv_blocks_cached": self.num_cached_blocks,
                "kv_block_size": self.block_size, "prefix_cache_queries": self.prefix_cache_queries,
                "prefix_cache_hits": self.prefix_cache_hits,
                "prefix_cache_hit_rate": self.prefix_cache_hit_rate,
                "kv_evictions": self.num_evictions, "kv_alloc_new_blocks": self.num_alloc_new_blocks,
                "kv_reused_blocks": self.num_reused_blocks, "kv_window_released_blocks": self.num_released_blocks}

    # -- prefix lookup ------------------------------------------------------------------------
    def _compute_hashes(self, request: Request, num_full_blocks: int) -> list[bytes]:
        return extend_hashes(request.block_hashes, request.all_token_ids, num_full_blocks, self.block_size)

    def _behind_window(self, num_tokens: int) -> int:
        """Leading blocks no query after the first ``num_tokens`` tokens reads (0 without a window)."""
        if self.window is None:
            return 0
        return max(num_tokens - self.window + 1, 0) // self.block_size

    def _lookup_blocks(self, request: Request, cap: int | None = None) -> tuple[int, list[int]]:
        """The longest cached prefix: (skip, hits) where the prefix is ``skip + len(hits)`` blocks, the
        first ``skip`` behind the window (not needed, so not looked for: with a window only the last
        window's blocks of a prefix must still be cached) and ``hits`` the cached blocks after them.
        ``cap``: at most that many blocks (another layer group's prefix: backend/engine/kv_groups.py)."""
        if not self.enable_prefix_caching or request.params.return_context_logits:
            return 0, []         # context logits need every prompt position computed
        # Leave at least the last token to compute: its logits give the next token.
        max_blocks = (len(request.all_token_ids) - 1) // self.block_size
        if cap is not None:
            max_blocks = min(max_blocks, cap)
        hashes = self._compute_hashes(request, max_blocks)
        cached, bs = self._cached, self.block_size
        best, run_start = 0, 0          # best prefix (blocks); where the current run of cached blocks began
        for i in range(max_blocks):
            if hashes[i] not in cached:
                if self.window is None:
                    break               # a prefix is cached from its first block on
                run_start = i + 1
                continue
            if run_start <= self._behind_window((i + 1) * bs):
                best = i + 1
        skip = self._behind_window(best * bs)
        return skip, [cached[hashes[i]] for i in range(skip, best)]

    def lookup(self, request: Request, cap: int | None = None) -> int:
        """Tokens of ``request`` that the prefix cache would serve now (no side effects)."""
        skip, hits = self._lookup_blocks(request, cap)
        return (skip + len(hits)) * self.block_size

    def most_blocks(self, num_tokens: int, step_tokens: int) -> int:
        """The most blocks a sequence of ``num_tokens`` tokens holds at once when a step computes at most
        ``step_tokens`` of them: all its blocks, or with a window the window's, the step's and one more."""
        whole = -(-num_tokens // self.block_size)
        if self.window is None:
            return whole
        return min(whole, -(-(step_tokens + self.window - 1) // self.block_size) + 1)

    def num_blocks_needed(self, request: Request, num_tokens: int, cap: int | None = None) -> int:
        """Free blocks an admission of ``request`` holding ``num_tokens`` tokens would consume
        (cache hits on blocks already in use are free; hits on evictable blocks are not). With a window:
        as if none were released before ``num_tokens`` (``most_blocks`` bounds what a sequence holds)."""
        skip, hits = self._lookup_blocks(request, cap)
        total = -(-num_tokens // self.block_size) - skip
        ref = self.ref_counts
        return max(total - len(hits), 0) + sum(1 for b in hits if ref[b] == 0)

    def can_allocate(self, request: Request, num_tokens: int, reserved_blocks: int = 0) -> bool:
        return self.num_blocks_needed(request, num_tokens) <= self.num_free_blocks - reserved_blocks

    # -- allocation ---------------------------------------------------------------------------
    def _take(self, n: int) -> list[int]:
        """Pop ``n`` blocks (caller checked availability): never-cached ones first, then evict LRU."""
        free = self._free
        out = []
        while len(out) < n and free:
            out.append(free.pop())
        if len(out) < n:
            evictable, cached, block_hash = self._evictable, self._cached, self.block_hash
            for _ in range(n - len(out)):
                block, _ = evictable.popitem(last=False)
                del cached[block_hash[block]]
                block_hash[block] = None
                out.append(block)
                self.num_evictions += 1
        ref = self.ref_counts
        for b in out:
            ref[b] = 1
        return out

    def allocate_for(self, request: Request, num_tokens: int, cap: int | None = None) -> int | None:
        """Admit a request that holds no blocks: reuse its cached prefix, then reserve slots for up to
        ``num_tokens`` more tokens (capped at the request's length).

        Returns the number of tokens served from the prefix cache (``request.num_computed_tokens``
        is set to it; the step computes ``request.num_slots - request.num_computed_tokens`` tokens),
        or ``None`` when there are not enough free blocks (nothing changes then). ``cap``: a prefix of
        at most that many blocks.
        """
        assert not request.block_ids and request.num_slots == 0, f"{request} already holds blocks"
        assert num_tokens >= 1
        skip, hits = self._lookup_blocks(request, cap)
        bs = self.block_size
        num_cached = (skip + len(hits)) * bs
        target = min(num_cached + num_tokens, len(request.all_token_ids))
        ref = self.ref_counts
        num_new = -(-target // bs) - skip - len(hits)
        if num_new + sum(1 for b in hits if ref[b] == 0) > self.num_free_blocks:
            return None
        evictable = self._evictable
        for b in hits:
            if ref[b] == 0:
                del evictable[b]
            ref[b] += 1
        # the skipped entries are released already (never read: the attention masks them); any valid
        # block id stands in the table there
        request.block_ids = [0] * skip + hits + self._take(num_new)
        request.slot_room = 0
        request.num_new_blocks += num_new
        request.num_reused_blocks += len(hits)
        self.num_alloc_new_blocks += num_new
        self.num_reused_blocks += len(hits)
        if self.block_table_changes is not None:
            self.block_table_changes.append(request)
        request.num_slots = target
        request.num_tentative_tokens = 0
        request.num_committed_blocks = skip + len(hits)
        request.num_computed_tokens = num_cached
        request.num_cached_tokens = num_cached
        self._holders[request.request_id] = request
        request.num_released_blocks = skip
        if self.enable_prefix_caching:
            self.prefix_cache_queries += len(request.all_token_ids)
            self.prefix_cache_hits += num_cached
        if self.window is not None:
            self._release_behind_window(request)
        return num_cached

    def append_slots(self, request: Request, num_new_tokens: int, num_tentative: int = 0) -> bool:
        """Make room for ``num_new_tokens`` tokens after ``request.num_computed_tokens`` plus
        ``num_tentative`` unverified speculative ones. Returns False (nothing changed) when the pool
        is exhausted: the scheduler then preempts someone."""
        assert request.num_tentative_tokens == 0, "roll back tentative slots before reserving more"
        self._commit(request)
        if self.window is not None:
            self._release_behind_window(request)
        target = request.num_computed_tokens + num_new_tokens + num_tentative
        assert target >= request.num_slots, "append_slots cannot shrink a reservation"
        blocks = request.block_ids
        need = -(-target // self.block_size) - len(blocks)
        if need > 0:
            if need > len(self._free) + len(self._evictable):
                return False
            if need == 1 and self._free:     # the common decode case, without list building
                b = self._free.pop()
                self.ref_counts[b] = 1
                blocks.append(b)
            else:
                blocks.extend(self._take(need))
            request.num_new_blocks += need
            self.num_alloc_new_blocks += need
            if self.block_table_changes is not None:
                self.block_table_changes.append(request)
        request.num_slots = target
        request.num_tentative_tokens = num_tentative
        # What the scheduler's decode loop may reserve without calling here: tokens up to the last
        # block's end while no full block awaits its hash (the next token after a full block must
        # come here to commit it). Set on every call, 0 wherever the block list or the commit count
        # is reset, so it is never more than the blocks hold.
        room = len(blocks)
        if self.enable_prefix_caching and request.num_committed_blocks < room - 1:
            room = request.num_committed_blocks + 1
        request.slot_room = room * self.block_size
        return True

    def append_tentative(self, request: Request, n: int) -> bool:
        """Reserve ``n`` more slots after the current reservation for unverified tokens."""
        if n <= 0:
            return True
        target = request.num_slots + n
        need = -(-target // self.block_size) - len(request.block_ids)
        if need > 0:
            if need > self.num_free_blocks:
                return False
            request.block_ids.extend(self._take(need))
            request.num_new_blocks += need
            self.num_alloc_new_blocks += need
            if self.block_table_changes is not None:
                self.block_table_changes.append(request)
        request.num_slots = target
        request.num_tentative_tokens += n
        return True

    def rollback(self, request: Request, n: int) -> None:
        """Give back the last ``n`` reserved slots (rejected speculative tokens); the remaining
        tentative slots count as accepted. Blocks no longer needed return to the free pool in the
        reverse order they were taken, so a reserve+rollback leaves the pool exactly as it was."""
        assert 0 <= n <= request.num_tentative_tokens, (
            f"rollback of {n} slots but {request.num_tentative_tokens} are tentative")
        request.num_slots -= n
        request.num_tentative_tokens = 0
        request.slot_room = 0
        assert request.num_slots >= request.num_computed_tokens
        keep = -(-request.num_slots // self.block_size)
        blocks = request.block_ids
        if len(blocks) > keep:
            ref, free = self.ref_counts, self._free
            for b in reversed(blocks[keep:]):
                assert ref[b] == 1 and self.block_hash[b] is None, "rolled back a shared or cached block"
                ref[b] = 0
                free.append(b)
            # A new list, never an in-place shrink: consumers that cache a copy of a block table
            # (input preparation) rely on "same list object => only appended to".
            request.block_ids = blocks[:keep]
            if self.block_table_changes is not None:
                self.block_table_changes.append(request)

    def _release_behind_window(self, request: Request) -> None:
        """Give back the blocks no query from ``num_computed_tokens`` on can read (called after
        ``_commit``, so a full block leaves with its hash and stays a prefix-cache hit)."""
        first_needed = request.num_computed_tokens - self.window + 1   # the oldest key still read
        upto = min(max(first_needed, 0) // self.block_size, len(request.block_ids))
        done = request.num_released_blocks
        if upto <= done:
            return
        ref, block_hash = self.ref_counts, self.block_hash
        evictable, free, blocks = self._evictable, self._free, request.block_ids
        for i in range(done, upto):
            b = blocks[i]
            ref[b] -= 1
            if ref[b] == 0:
                if block_hash[b] is not None:
                    evictable[b] = None
                else:
                    free.append(b)
        request.num_released_blocks = upto
        self.num_released_blocks += upto - done

    def held_blocks(self, request: Request) -> int:
        """Blocks ``request`` holds now (its block table less the entries a window released)."""
        return len(request.block_ids) - request.num_released_blocks

    def _commit(self, request: Request) -> None:
        """Register the hashes of blocks that became full with computed, accepted tokens."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = min(request.num_computed_tokens, len(request.all_token_ids)) // bs
        committed = request.num_committed_blocks
        if num_full <= committed:
            return
        hashes = self._compute_hashes(request, num_full)
        cached, block_hash, blocks = self._cached, self.block_hash, request.block_ids
        for i in range(committed, num_full):
            h = hashes[i]
            if h not in cached:
                # Another request may have computed the same prefix concurrently: keep the first.
                b = blocks[i]
                if block_hash[b] is None:
                    block_hash[b] = h
                    cached[h] = b
        request.num_committed_blocks = num_full

    def free(self, request: Request) -> None:
        """Release every block of ``request`` (finish, abort or preemption). Full computed blocks
        stay cached; the sequence's tail is queued for eviction before its head, which is the part
        other requests are likely to share."""
        if request.block_ids:
            if request.num_tentative_tokens:
                request.num_slots -= request.num_tentative_tokens
                request.num_tentative_tokens = 0
            self._commit(request)
            ref, block_hash = self.ref_counts, self.block_hash
            evictable, free = self._evictable, self._free
            for b in reversed(request.block_ids[request.num_released_blocks:]):
                ref[b] -= 1
                assert ref[b] >= 0
                if ref[b] == 0:
                    if block_hash[b] is not None:
                        evictable[b] = None
                    else:
                        free.append(b)
            if self.block_table_changes is not None:
                self.block_table_changes.append(request)
        # A new list object: input preparation detects a changed block table by identity.
        request.block_ids = []
        request.slot_room = 0
        request.num_slots = 0
        request.num_tentative_tokens = 0
        request.num_committed_blocks = 0
        request.num_released_blocks = 0
        self._holders.pop(request.request_id, None)

    def track_block_table_changes(self) -> list[Request]:
        """Start logging block-list changes (see ``block_table_changes``); returns the log."""
        if self.block_table_changes is None:
            self.block_table_changes = []
        return self.block_table_changes

    def slot(self, request: Request, pos: int) -> int:
        """Flat KV slot of token ``pos`` of ``request`` (block_id * block_size + offset)."""
        assert 0 <= pos < request.num_slots, f"position {pos} outside {request.num_slots} slots"
        bs = self.block_size
        return request.block_ids[pos // bs] * bs + pos % bs

    def reset_prefix_cache(self) -> int:
        """Forget every cached hash (after an executor error the KV contents are suspect).
        Returns how many hashes were dropped."""
        n = len(self._cached)
        for b in self._evictable:
            self._free.append(b)
        self._evictable.clear()
        self._cached.clear()
        self.block_hash = [None] * self.num_blocks
        return n

    # -- consistency (tests and debugging) ----------------------------------------------------
    def check_invariants(self) -> None:
        """Assert the pool is a consistent partition and refcounts match the block tables."""
        check_invariants(self)

    @property
    def num_holders(self) -> int:
        return len(self._holders)


__all__ = ["BlockManager"]
