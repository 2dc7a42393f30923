"""``POST /v1/responses``: OpenAI's Responses API, the subset agent SDKs send, over the chat path.

A request is translated into a chat body (``responses_input``) and planned, checked and sent exactly
as a chat completion is (``request_plan``, ``EngineCall``); its answer goes through the same
parsers (``ChatAnswer``: reasoning, then tool calls) into Responses output items and events
(``responses_output``). So what chat guarantees holds here: tool calls under ``required`` or a
named function are valid by construction, usage counts are the engine's.

``previous_response_id``: a response is kept (unless ``store`` is false) as its conversation, the
input it continued plus its output, in a bounded in-memory store (``ResponseStore``, the newest
1000); a later request that names it continues that conversation (its ``instructions`` are not
carried over, as OpenAI's are not). An id the server does not keep (never made, forgotten, or made
before a restart) is a 400 naming it.
"""
from __future__ import annotations

from typing import Any, AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from harness.openai.chat_answer import ChatAnswer
from harness.openai.engine_client import EngineCall, Piece
from harness.openai.errors import ApiError
from harness.openai.limits import Limits
from harness.openai.request_plan import Plan, plan_request
from harness.openai.responses_input import ChatBody, ResponseStore, rename, to_chat_body
from harness.openai.responses_output import EventStream, ResponseObject, response_usage
from harness.openai.served_model import ServedModel
from harness.openai.streaming import ClientGone, SSEResponse, sse, unless_disconnected

__all__ = ["ResponsesRoute"]


class _Run:
    """One response's answer as it is read: chat deltas -> Responses events, and the counts."""

    def __init__(self, plan: Plan, answer: ChatAnswer, events: EventStream):
        self.plan, self.answer, self.events = plan, answer, events
        self.n_out = self.n_reasoning = 0

    def piece(self, p: Piece) -> list[dict]:
        thinking = self.answer.reasoning is not None and self.answer.reasoning.state == "reasoning"
        deltas = self.answer.feed(p.text)
        # reasoning_tokens: the tokens of pieces read while the model was in its reasoning block
        if thinking or any("reasoning_content" in d for d in deltas):
            self.n_reasoning += len(p.ids)
        self.n_out += len(p.ids)
        out = [e for d in deltas for e in self.events.delta(d)]
        if p.finish_reason is not None:
            out += [e for d in self.answer.end() for e in self.events.delta(d)]
        return out

    def finish(self, engine_finish: str | None) -> tuple[list[dict], dict]:
        use = response_usage(len(self.plan.ids), self.n_out, self.n_reasoning)
        return self.events.finish(use, engine_finish == "length")


class ResponsesRoute:
    def __init__(self, model: ServedModel, limits: Limits, client: Callable[[], Any], store: ResponseStore | None = None,
                 triton_headers: dict[str, str] | None = None):
        self.model, self.limits, self.client, self.triton_headers = model, limits, client, triton_headers
        self.store = store or ResponseStore()

    async def create(self, request: Request, body: dict[str, Any]) -> Response:
        chat = to_chat_body(body, self.store)
        try:
            plan = await plan_request(self.model, self.limits, chat.body, chat=True)
        except ApiError as e:
            raise rename(e, chat.origin) from None
        run = _Run(plan, plan.answer(self.model), EventStream(ResponseObject(self.model.name, body,
                                                                             body.get("tools") or [])))
        pieces = EngineCall(self.client(), self.model, plan.ids, plan.max_tokens, plan.sampling,
                            headers=self.triton_headers).pieces()
        keep = body.get("store") is not False
        if not plan.stream:
            finish: list[str | None] = [None]

            async def collect():
                async for p in pieces:
                    run.piece(p)
                    finish[0] = p.finish_reason or finish[0]
            try:
                await unless_disconnected(request, collect())
            except ClientGone:
                return Response(status_code=499)
            _, final = run.finish(finish[0])
            if keep:
                self._keep(final, chat)
            return JSONResponse(final)
        try:  # the first piece before the headers, as chat does: a refusal keeps its status
            first = await unless_disconnected(request, pieces.__anext__())
        except StopAsyncIteration:
            first = None
        except ClientGone:
            return Response(status_code=499)
        return SSEResponse(self._events(first, pieces, run, chat, keep))

    async def _events(self, first: Piece | None, pieces: AsyncIterator[Piece], run: _Run, chat: ChatBody,
                      keep: bool) -> AsyncIterator[str]:
        try:
            for ev in run.events.start():
                yield sse(ev, ev["type"])
            p, finish = first, None
            while p is not None:
                for ev in run.piece(p):
                    yield sse(ev, ev["type"])
                finish = p.finish_reason or finish
                p = await anext(pieces, None)
            last, final = run.finish(finish)
            if keep:
                self._keep(final, chat)
            for ev in last:
                yield sse(ev, ev["type"])
        except ApiError as e:  # after the headers: OpenAI's error event
            ev = run.events.event("error", code=e.code, message=e.message, param=e.param)
            yield sse(ev, "error")
        finally:
            await pieces.aclose()  # a no-op when read to the end; else cancels the engine request

    def _keep(self, final: dict, chat: ChatBody) -> None:
        """The conversation this response ends, as chat messages: what previous_response_id continues."""
        text = "".join(p["text"] for it in final["output"] if it["type"] == "message" for p in it["content"])
        calls = [{"id": it["call_id"], "type": "function", "function": {"name": it["name"], "arguments": it["arguments"]}}
                 for it in final["output"] if it["type"] == "function_call" and it["status"] == "completed"]
        turn: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
        if calls:
            turn["tool_calls"] = calls
        self.store.put(final["id"], chat.history + [turn])
