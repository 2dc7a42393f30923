"""What every route that generates shares: server-sent events that cancel their engine request when
the client goes away, and a non-streamed wait that does the same.

A client that goes away cancels its engine request: a streamed answer's generator is closed
(``SSEResponse``), a non-streamed one is watched (``unless_disconnected``); either way the engine
call's ``finally`` cancels the gRPC stream and the engine frees the request's KV blocks.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any, AsyncIterator

import anyio
from fastapi import Request
from fastapi.responses import StreamingResponse

__all__ = ["SSEResponse", "ClientGone", "sse", "unless_disconnected", "DISCONNECT_POLL_S"]

DISCONNECT_POLL_S = 0.25   # how often a waiting request checks that its client is still there


class ClientGone(Exception):
    pass


class SSEResponse(StreamingResponse):
    """Server-sent events whose generator is always closed when the response ends, also when the
    client went away between two events: its ``finally`` then cancels the engine request at once
    instead of whenever the garbage collector finalizes it."""

    def __init__(self, content: AsyncIterator[str]):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()


def sse(obj: Any, event: str | None = None) -> str:
    """One event; ``event``: its name line (the Responses API names each event, chat does not)."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def unless_disconnected(request: Request, aw) -> Any:
    """Await ``aw``; if the client disconnects first, cancel it and raise ClientGone."""
    task = asyncio.ensure_future(aw)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientGone()
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
