"""Admission policies of the scheduler, one registry (pure Python, no torch).

A policy answers "may this waiting request be admitted now?" on top of the block manager's own
"are there blocks for its first chunk?". ``max_utilization`` says yes to everything (the scheduler
preempts when running requests later run out of blocks); ``guaranteed_no_evict`` admits a request
only if the blocks for its whole life (prompt + max_tokens, capped at max_seq_len) are free after
reserving the same for every running request, so running requests never need preemption.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from backend.engine.kv_cache import BlockManager
from backend.engine.request import Request


class Scheduler(Protocol):
    """What a policy reads of the scheduler (``scheduler.Scheduler`` is one): named here, not imported,
    because the scheduler imports its policies."""
    block_manager: BlockManager
    running: list[Request]

    def blocks_for_life(self, request: Request) -> int: ...


class MaxUtilization:
    """Admit greedily; when a running request needs a block and none is free, preempt."""
    name = "max_utilization"

    def begin(self, scheduler: Scheduler) -> None:
        pass

    def admit(self, scheduler: Scheduler, request: Request) -> bool:
        return True

    def admitted(self, scheduler: Scheduler, request: Request) -> None:
        pass


class GuaranteedNoEvict:
    """Admit only requests whose whole life fits next to the running requests' reservations."""
    name = "guaranteed_no_evict"

    def __init__(self) -> None:
        self._reserved = 0

    def begin(self, scheduler: Scheduler) -> None:
        need, held = scheduler.blocks_for_life, scheduler.block_manager.held_blocks
        self._reserved = sum(max(need(r) - held(r), 0) for r in scheduler.running)

    def admit(self, scheduler: Scheduler, request: Request) -> bool:
        bm = scheduler.block_manager
        need = min(bm.num_blocks_needed(request, request.token_limit), scheduler.blocks_for_life(request))
        return need <= bm.num_free_blocks - self._reserved

    def admitted(self, scheduler: Scheduler, request: Request) -> None:
        self._reserved += max(scheduler.blocks_for_life(request) - scheduler.block_manager.held_blocks(request), 0)


POLICIES: dict[str, Callable[[], object]] = {
    MaxUtilization.name: MaxUtilization,
    GuaranteedNoEvict.name: GuaranteedNoEvict,
}


__all__ = ["POLICIES", "GuaranteedNoEvict", "MaxUtilization"]
