"""The FastAPI application: OpenAI's routes over the engine model, health and metrics.

Every generation request is checked whole before anything reaches the engine (``request_plan``),
so a bad request costs no engine time and gets a 400 naming its field; the server keeps serving
everyone else. A client that goes away cancels its engine request (``streaming``). The Responses
API (``/v1/responses``) is its own module over the same plan, parsers and engine call.
"""
from __future__ import annotations

import asyncio
import contextlib
import urllib.error
import urllib.request
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from harness.openai.auth import ApiKeyMiddleware, KeyCheck
from harness.openai.chat_answer import ChatAnswer
from harness.openai.engine_client import EngineCall, Piece
from harness.openai.errors import ApiError, bad_request, error_body
from harness.openai.limits import Limits, read_json_body
from harness.openai.request_plan import plan_request
from harness.openai.responses import Collected, Completion, usage
from harness.openai.responses_api import ResponsesRoute
from harness.openai.served_model import ServedModel
from harness.openai.streaming import ClientGone, SSEResponse, sse, unless_disconnected
from harness.openai.tool_parsers import template_has_tools

__all__ = ["create_app"]


def create_app(model: ServedModel, triton_url: str, metrics_url: str | None, api_keys: tuple[str, ...] = (),
               limits: Limits = Limits(), triton_headers: dict[str, str] | None = None) -> FastAPI:
    """``triton_headers``: sent on every engine call, for a Triton that restricts inference to a key."""
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
    # built-in tool prompt renders them, in which row's syntax (a client can tell what the model was shown)
    tool_card = {"tool_parser": fmt.name if fmt else None,
                 "reasoning_parser": model.reasoning.name if model.reasoning else None,
                 "tool_prompt": None if fmt is None else
                 "chat_template" if template_has_tools(model.tokenizer.chat_template) else f"builtin_{fmt.name}"}

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
        plan = await plan_request(model, limits, body, chat)
        call = EngineCall(state["client"], model, plan.ids, plan.max_tokens, plan.sampling, headers=triton_headers)
        pieces = call.pieces()
        got = Collected(model.tokenizer, plan.sampling, chat)
        out = Completion(model.name, chat)
        answer = plan.answer(model) if chat else None
        if not plan.stream:
            async def collect():
                async for p in pieces:
                    got.add(p)
            try:
                await unless_disconnected(request, collect())
            except ClientGone:
                return Response(status_code=499)  # nobody reads it; the engine request is cancelled
            use = usage(len(plan.ids), got.n_tokens)
            if answer is None:
                return JSONResponse(out.response(got.text, got.finish, got.logprobs(), use))
            return JSONResponse(out.response(answer.message(got.text), answer.finish_reason(got.finish),
                                             got.logprobs(), use))
        # The first piece before the headers: a request the engine refuses, or a Triton server that
        # is down, still gets its real status (400/503) rather than a 200 with an error event.
        try:
            first = await unless_disconnected(request, pieces.__anext__())
        except StopAsyncIteration:
            first = None
        except ClientGone:
            return Response(status_code=499)
        return SSEResponse(_events(first, pieces, got, out, plan.include_usage, len(plan.ids), answer))

    async def _events(first: Piece | None, pieces: AsyncIterator[Piece], got: Collected, out: Completion,
                      include_usage: bool, n_prompt: int, answer: ChatAnswer | None) -> AsyncIterator[str]:
        try:
            if out.chat:  # OpenAI's first chunk names the role
                yield sse(out.chunk(role=True, text="", with_usage=include_usage))
            p = first
            while p is not None:
                lp = got.add(p)
                if answer is not None:
                    deltas = answer.feed(p.text) + (answer.end() if p.finish_reason is not None else [])
                    for i, d in enumerate(deltas or ([{}] if lp is not None else [])):
                        yield sse(out.chunk(delta=d, logprobs=lp if i == 0 else None, with_usage=include_usage))
                elif p.text or lp is not None:
                    yield sse(out.chunk(text=p.text, logprobs=lp, with_usage=include_usage))
                if p.finish_reason is not None:  # its own chunk, with an empty delta, as OpenAI sends it
                    finish = answer.finish_reason(p.finish_reason) if answer is not None else p.finish_reason
                    yield sse(out.chunk(finish_reason=finish, with_usage=include_usage))
                p = await anext(pieces, None)
            if include_usage:
                yield sse(out.usage_chunk(usage(n_prompt, got.n_tokens)))
        except ApiError as e:  # after the headers: the error travels as an event
            yield sse(e.body())
        finally:
            await pieces.aclose()  # a no-op when read to the end; else cancels the engine request
        yield "data: [DONE]\n\n"

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    responses = ResponsesRoute(model, limits, lambda: state["client"], triton_headers=triton_headers)

    @app.post("/v1/responses")
    async def create_response(request: Request):
        return await responses.create(request, await _body(request))

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
