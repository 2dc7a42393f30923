"""The FastAPI application: OpenAI's routes over the engine model, health and metrics.

Every generation request is checked whole before anything reaches the engine (params, prompts), so
a bad request costs no engine time and gets a 400 naming its field; the server keeps serving
everyone else. A client that goes away cancels its engine request: a streamed answer's generator
is closed (``SSEResponse``), a non-streamed one is watched (``_unless_disconnected``); either way the
engine call's ``finally`` cancels the gRPC stream and the engine frees the request's KV blocks.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import urllib.error
import urllib.request
from typing import Any, AsyncIterator

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from backend.engine.sampling_params import room_problem
from harness.openai.auth import ApiKeyMiddleware, KeyCheck
from harness.openai.engine_client import EngineCall, Piece
from harness.openai.errors import ApiError, bad_request, error_body
from harness.openai.limits import Limits, read_json_body
from harness.openai.params import Sampling, check_logit_bias, check_unsupported, parse_sampling, parse_stream
from harness.openai.prompts import chat_prompt_ids, completion_prompt_ids
from harness.openai.responses import Completion, chat_logprobs, completion_logprobs, usage
from harness.openai.served_model import ServedModel
from harness.openai.tool_answer import ToolAnswer, with_tool_guide
from harness.openai.tool_parsers import template_has_tools
from harness.openai.tools import parse_tools

__all__ = ["create_app", "DISCONNECT_POLL_S"]

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


def _event(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _unless_disconnected(request: Request, aw) -> Any:
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


class _Answer:
    """Accumulates one answer's pieces: text, ids, log-probabilities, finish reason."""

    def __init__(self, model: ServedModel, sampling: Sampling, chat: bool):
        self.model, self.s, self.chat = model, sampling, chat
        self.text, self.n_tokens, self.finish = "", 0, None
        self.lp_entries: list = []
        self.lp_tokens: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def logprobs_of(self, p: Piece) -> Any:
        if not self.s.logprobs:
            return None
        tok = self.model.tokenizer
        if self.chat:
            return {"content": chat_logprobs(tok, p.ids, p.logprobs, self.s.top_logprobs, p.tops)}
        return completion_logprobs(tok, p.ids, p.logprobs, self.s.top_logprobs, len(self.text), p.tops)

    def add(self, p: Piece) -> Any:
        lp = self.logprobs_of(p)
        if lp is not None and self.chat:
            self.lp_entries.extend(lp["content"])
        elif lp is not None:
            for k in self.lp_tokens:
                self.lp_tokens[k].extend(lp[k] or [])
        self.text += p.text
        self.n_tokens += len(p.ids)
        self.finish = p.finish_reason or self.finish
        return lp

    def logprobs(self) -> Any:
        if not self.s.logprobs:
            return None
        if self.chat:
            return {"content": self.lp_entries}
        return {**self.lp_tokens, "top_logprobs": self.lp_tokens["top_logprobs"] if self.s.top_logprobs else None}


def create_app(model: ServedModel, triton_url: str, metrics_url: str | None, api_keys: tuple[str, ...] = (),
               limits: Limits = Limits()) -> FastAPI:
    state: dict[str, Any] = {}
    keys = KeyCheck(api_keys)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        import tritonclient.grpc.aio as aio
        state["client"] = aio.InferenceServerClient(triton_url)  # bound to this event loop
        try:
            yield
        finally:
            await state["client"].close()

    app = FastAPI(title="Kiln OpenAI-compatible API", lifespan=lifespan, docs_url=None, redoc_url=None)
    if keys.enabled:
        app.add_middleware(ApiKeyMiddleware, keys=keys)

    @app.exception_handler(ApiError)
    async def _api_error(_req, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_req, e: StarletteHTTPException):  # unknown routes, wrong methods
        kind = "not_found" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(e.detail), kind, None, None), status_code=e.status_code)

    fmt = model.tool_format
    # Kiln's additions to the card: how tools are written and whether the bundle's template or the
    # built-in tool prompt renders them (a client can tell what the model was shown)
    tool_card = {"tool_parser": fmt.name if fmt else None,
                 "tool_prompt": None if fmt is None else
                 "chat_template" if template_has_tools(model.tokenizer.chat_template) else "builtin_hermes"}

    def model_card() -> dict[str, Any]:
        return {"id": model.name, "object": "model", "created": model.created, "owned_by": "kiln",
                "max_model_len": model.max_seq_len, **tool_card}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def one_model(model_id: str):
        if model_id != model.name:
            raise _unknown_model(model_id)
        return model_card()

    def _unknown_model(name: Any) -> ApiError:
        return ApiError(404, f"The model '{name}' does not exist; this server serves '{model.name}' "
                        "(GET /v1/models)", param="model", code="model_not_found", type="not_found_error")

    async def _body(request: Request) -> dict[str, Any]:
        body = await read_json_body(request, limits.max_body_bytes)
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
        if "model" not in body:
            raise bad_request("model", "required", code="missing_required_parameter")
        if body["model"] != model.name:
            raise _unknown_model(body["model"])
        return body

    async def generate(request: Request, chat: bool) -> Response:
        body = await _body(request)
        check_unsupported(body)
        stream, include_usage = parse_stream(body)
        sampling = parse_sampling(body, chat=chat)
        check_logit_bias(sampling, model.vocab_size)
        tools = parse_tools(body) if chat else None
        if not chat and body.get("tools"):
            raise bad_request("tools", "tools are a chat feature: send them to /v1/chat/completions",
                              code="unsupported_value")
        if tools is not None:  # in a thread: the first one imports xgrammar (~2 s), none blocks the loop
            sampling = await asyncio.to_thread(with_tool_guide, sampling, tools, model.tool_format)
        ids = (chat_prompt_ids(model, body.get("messages"), tools) if chat
               else completion_prompt_ids(model, body.get("prompt")))
        room = model.max_seq_len - len(ids)
        cap = limits.max_tokens_cap
        max_tokens = sampling.max_tokens if sampling.max_tokens is not None else min(room, cap or room)
        name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        if cap is not None and max_tokens > cap:
            raise bad_request(name, f"{max_tokens} is more than this server's cap of {cap} tokens per request "
                              "(--max-tokens-cap)")
        problem = room_problem(max_tokens, room)
        if problem is not None:
            raise bad_request(name, f"{max_tokens}: {problem}")
        call = EngineCall(state["client"], model, ids, max_tokens, sampling)
        pieces = call.pieces()
        answer = _Answer(model, sampling, chat)
        out = Completion(model.name, chat)
        tool_answer = ToolAnswer(model.tool_format) if tools is not None else None
        if not stream:
            async def collect():
                async for p in pieces:
                    answer.add(p)
            try:
                await _unless_disconnected(request, collect())
            except ClientGone:
                return Response(status_code=499)  # nobody reads it; the engine request is cancelled
            use = usage(len(ids), answer.n_tokens)
            if tool_answer is None:
                return JSONResponse(out.response(answer.text, answer.finish, answer.logprobs(), use))
            content, calls = tool_answer.message(answer.text)
            return JSONResponse(out.response(content, tool_answer.finish_reason(answer.finish), answer.logprobs(),
                                             use, calls))
        # The first piece before the headers: a request the engine refuses, or a Triton server that
        # is down, still gets its real status (400/503) rather than a 200 with an error event.
        try:
            first = await _unless_disconnected(request, pieces.__anext__())
        except StopAsyncIteration:
            first = None
        except ClientGone:
            return Response(status_code=499)
        return SSEResponse(_events(first, pieces, answer, out, include_usage, len(ids), tool_answer))

    async def _events(first: Piece | None, pieces: AsyncIterator[Piece], answer: _Answer, out: Completion,
                      include_usage: bool, n_prompt: int, tools: ToolAnswer | None) -> AsyncIterator[str]:
        try:
            if out.chat:  # OpenAI's first chunk names the role
                yield _event(out.chunk(role=True, text="", with_usage=include_usage))
            p = first
            while p is not None:
                lp = answer.add(p)
                if tools is not None:
                    deltas = tools.feed(p.text) + (tools.end() if p.finish_reason is not None else [])
                    for i, d in enumerate(deltas or ([{}] if lp is not None else [])):
                        yield _event(out.chunk(delta=d, logprobs=lp if i == 0 else None, with_usage=include_usage))
                elif p.text or lp is not None:
                    yield _event(out.chunk(text=p.text, logprobs=lp, with_usage=include_usage))
                if p.finish_reason is not None:  # its own chunk, with an empty delta, as OpenAI sends it
                    finish = tools.finish_reason(p.finish_reason) if tools is not None else p.finish_reason
                    yield _event(out.chunk(finish_reason=finish, with_usage=include_usage))
                p = await anext(pieces, None)
            if include_usage:
                yield _event(out.usage_chunk(usage(n_prompt, answer.n_tokens)))
        except ApiError as e:  # after the headers: the error travels as an event
            yield _event(e.body())
        finally:
            await pieces.aclose()  # a no-op when read to the end; else cancels the engine request
        yield "data: [DONE]\n\n"

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    @app.get("/health")
    async def health():
        try:
            ready = await state["client"].is_model_ready(model.engine_model, client_timeout=2.0)
        except Exception as e:  # noqa: BLE001 - unreachable or refusing: not ready either way
            return JSONResponse(error_body(f"the Triton server at {triton_url} did not answer: {e}"[:500],
                                           "service_unavailable", None, "engine_unavailable"), status_code=503)
        if not ready:
            return JSONResponse(error_body(f"the engine model '{model.engine_model}' is not ready",
                                           "service_unavailable", None, "engine_unavailable"), status_code=503)
        return {"status": "ok", "model": model.name, "engine_model": model.engine_model}

    @app.get("/metrics")
    async def metrics():
        """Triton's Prometheus text (kiln_*, nv_trt_llm_*, nv_inference_*), passed through."""
        if not metrics_url:
            return JSONResponse(error_body("no --metrics-url was given", "not_found", None, None), status_code=404)

        def fetch() -> str:
            with urllib.request.urlopen(metrics_url, timeout=5) as r:
                return r.read().decode("utf-8", errors="replace")
        try:
            text = await asyncio.to_thread(fetch)
        except (urllib.error.URLError, OSError) as e:
            return JSONResponse(error_body(f"Triton's metrics at {metrics_url} did not answer: {e}",
                                           "service_unavailable", None, "engine_unavailable"), status_code=503)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    return app
