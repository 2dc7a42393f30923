"""KV blocks per layer group: the sliding-window layers of a model that mixes them with full-attention
layers (Gemma 3: five sliding to one full) keep their keys in a pool of their own (no torch).

A block id names the same token positions in every layer that shares its pool. With one pool, a block
behind every sliding layer's window could not be given back while one full layer still reads it, so a
Gemma 3 sequence held all its blocks in all layers. With a pool for the sliding layers, that pool's
``BlockManager(window=W)`` releases what falls behind the window (kv_cache.py, "Sliding windows"), and
the full layers' pool holds every block as before. Each layer reads the block table of its group
(``AttentionMetadata.window``, built by backend/engine/inputs.py).

``GroupedBlockManager`` is what the scheduler sees, with the one-pool manager's interface. Its
capacity figures (``num_blocks``, ``num_free_blocks``, ``most_blocks``, ``held_blocks``) are the full
layers' pool: the scheduler's admission and "can never fit" checks reason about it. The sliding pool is
sized by the runner (backend/runtime/kv_plan.py ``window_pool_blocks``) for every running sequence's
window plus one step's tokens, so in practice it never binds; when it does (a step whose earlier
prefill chunks are still held), an allocation fails there as in the full pool and the scheduler
preempts, as it does when the full pool runs out.

Prefix caching runs in both pools over the same block hashes: an admission reuses the longest prefix
that both serve (the sliding pool needs only the prefix's last window of blocks cached), so both
groups' KV is there for every reused token.
"""
from __future__ import annotations

from backend.engine.kv_cache import BlockManager
from backend.engine.request import Request


class WindowShadow:
    """A request as the sliding layers' ``BlockManager`` sees it: its own block table, reservation and
    counters; the tokens, their hashes, the computed count and the sampling parameters are the
    request's own (both groups hold the same tokens, so the hashes are one list)."""

    __slots__ = ("request", "block_ids", "num_slots", "num_tentative_tokens", "slot_room",
                 "num_committed_blocks", "num_released_blocks", "num_new_blocks", "num_reused_blocks",
                 "num_cached_tokens")

    def __init__(self, request: Request) -> None:
        self.request = request
        self.block_ids: list[int] = []
        self.num_slots = self.num_tentative_tokens = self.slot_room = 0
        self.num_committed_blocks = self.num_released_blocks = 0
        self.num_new_blocks = self.num_reused_blocks = self.num_cached_tokens = 0

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def all_token_ids(self) -> list[int]:
        return self.request.all_token_ids

    @property
    def block_hashes(self) -> list[bytes]:
        return self.request.block_hashes

    @property
    def params(self):
        return self.request.params

    @property
    def is_finished(self) -> bool:
        return self.request.is_finished

    @property
    def num_computed_tokens(self) -> int:
        return self.request.num_computed_tokens

    @num_computed_tokens.setter
    def num_computed_tokens(self, n: int) -> None:
        # only an admission sets it, to the prefix both groups serve (GroupedBlockManager.allocate_for)
        assert n == self.request.num_computed_tokens, (n, self.request)

    def __repr__(self) -> str:
        return f"WindowShadow({self.request!r}, blocks={len(self.block_ids)})"


def shadow(request: Request) -> WindowShadow:
    s = request.window_kv
    if s is None:
        s = request.window_kv = WindowShadow(request)
    return s


class GroupedBlockManager:
    """The full layers' pool (``full_pool``) and the sliding layers' (``window_pool``), one interface."""

    def __init__(self, full: BlockManager, window: BlockManager) -> None:
        if full.window is not None or window.window is None:
            raise ValueError("kv groups: the full layers' pool has no window and the sliding layers' has one")
        if full.block_size != window.block_size or full.enable_prefix_caching != window.enable_prefix_caching:
            raise ValueError("kv groups: both pools need the same block size and prefix caching setting")
        self.full_pool, self.window_pool = full, window
        self.block_size = full.block_size
        self.enable_prefix_caching = full.enable_prefix_caching

    # -- the full pool's figures (what the scheduler plans with) ---------------------------------
    @property
    def num_blocks(self) -> int:
        return self.full_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.full_pool.num_free_blocks

    @property
    def block_table_changes(self) -> list[Request] | None:
        return self.full_pool.block_table_changes

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.full_pool.prefix_cache_hit_rate

    def most_blocks(self, num_tokens: int, step_tokens: int) -> int:
        return self.full_pool.most_blocks(num_tokens, step_tokens)

    def held_blocks(self, request: Request) -> int:
        return self.full_pool.held_blocks(request)

    def stats(self) -> dict:
        out = self.full_pool.stats()
        w = self.window_pool
        out.update({"kv_window_blocks_total": w.num_blocks, "kv_window_blocks_used": w.num_used_blocks,
                    "kv_window_released_blocks": w.num_released_blocks})
        return out

    # -- prefix lookup ----------------------------------------------------------------------------
    def _common_prefix(self, request: Request) -> int:
        """Blocks of the longest prefix both pools serve now."""
        full = self.full_pool.lookup(request) // self.block_size
        return self.window_pool.lookup(shadow(request), cap=full) // self.block_size

    def lookup(self, request: Request) -> int:
        return self._common_prefix(request) * self.block_size

    def num_blocks_needed(self, request: Request, num_tokens: int) -> int:
        return self.full_pool.num_blocks_needed(request, num_tokens, cap=self._common_prefix(request))

    # -- allocation: both pools or neither ----------------------------------------------------------
    def allocate_for(self, request: Request, num_tokens: int) -> int | None:
        cap = self._common_prefix(request)
        s = shadow(request)
        target = min(cap * self.block_size + num_tokens, len(request.all_token_ids))
        if self.window_pool.num_blocks_needed(s, target, cap) > self.window_pool.num_free_blocks:
            return None
        cached = self.full_pool.allocate_for(request, num_tokens, cap)
        if cached is None:
            return None
        got = self.window_pool.allocate_for(s, num_tokens, cap)
        assert got == cached, (got, cached, request)
        return cached

    def append_slots(self, request: Request, num_new_tokens: int, num_tentative: int = 0) -> bool:
        s = shadow(request)
        # the scheduler's decode fast path reserves within slot_room without calling here (it moved
        # request.num_slots only); slot_room was the smaller of both groups' room, so s holds those slots
        s.num_slots = request.num_slots
        before = s.num_slots
        if not self.window_pool.append_slots(s, num_new_tokens, num_tentative):
            return False
        if not self.full_pool.append_slots(request, num_new_tokens, num_tentative):
            self._undo(s, before)
            return False
        request.slot_room = min(request.slot_room, s.slot_room)
        return True

    def append_tentative(self, request: Request, n: int) -> bool:
        s = shadow(request)
        before, tentative = s.num_slots, s.num_tentative_tokens
        if not self.window_pool.append_tentative(s, n):
            return False
        if not self.full_pool.append_tentative(request, n):
            self._undo(s, before, tentative)
            return False
        return True

    def _undo(self, s: WindowShadow, num_slots: int, tentative: int = 0) -> None:
        """Give back what the sliding pool just reserved past ``num_slots`` (the full pool refused),
        leaving ``tentative`` slots tentative: as rejected speculative slots, the path that returns
        fresh blocks to the free list in the order they were taken."""
        n = s.num_slots - num_slots
        s.num_tentative_tokens = max(s.num_tentative_tokens, n)
        self.window_pool.rollback(s, n)
        s.num_tentative_tokens = tentative

    def rollback(self, request: Request, n: int) -> None:
        self.full_pool.rollback(request, n)
        self.window_pool.rollback(shadow(request), n)

    def free(self, request: Request) -> None:
        self.full_pool.free(request)
        if request.window_kv is not None:
            self.window_pool.free(request.window_kv)

    def slot(self, request: Request, pos: int) -> int:
        return self.full_pool.slot(request, pos)

    def window_slot(self, request: Request, pos: int) -> int:
        return self.window_pool.slot(shadow(request), pos)

    def track_block_table_changes(self) -> list[Request]:
        """The full pool's log (input preparation refreshes the sliding layers' rows of the step's
        sequences from their ``window_kv`` instead: a second log would be one more list to keep)."""
        return self.full_pool.track_block_table_changes()

    def reset_prefix_cache(self) -> int:
        return self.full_pool.reset_prefix_cache() + self.window_pool.reset_prefix_cache()

    def check_invariants(self) -> None:
        self.full_pool.check_invariants()
        self.window_pool.check_invariants()
        assert set(self.window_pool._holders) <= set(self.full_pool._holders), "a sliding-pool holder the full pool lost"

    @property
    def num_holders(self) -> int:
        return self.full_pool.num_holders


__all__ = ["GroupedBlockManager", "WindowShadow"]
