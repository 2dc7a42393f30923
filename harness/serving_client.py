"""Client helpers for the Kiln ensemble/bls models: HTTP generate, HTTP SSE, gRPC streaming.

Used by ``harness/client.py``, ``harness/perf/serving/sweep.py`` and the serving tests. Inputs are the
tensorrtllm_backend-compatible names (``text_input``, ``max_tokens``, ``temperature``, ...).
``headers``: what a Triton that requires an API key wants (``harness.triton_auth.http_headers`` for
the HTTP helpers, ``grpc_headers`` for the gRPC ones).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from typing import Any, AsyncIterator, Callable, Iterator

import numpy as np

__all__ = ["PARAM_TYPES", "GenerateError", "StreamResult", "grpc_inputs", "http_generate", "http_stream",
           "grpc_stream", "grpc_generate"]

# input name -> (Triton datatype, numpy dtype); BYTES lists are given as Python lists of str
PARAM_TYPES: dict[str, tuple[str, Any]] = {
    "text_input": ("BYTES", object), "max_tokens": ("INT32", np.int32), "stream": ("BOOL", bool),
    "temperature": ("FP32", np.float32), "top_k": ("INT32", np.int32), "top_p": ("FP32", np.float32),
    "repetition_penalty": ("FP32", np.float32), "presence_penalty": ("FP32", np.float32),
    "frequency_penalty": ("FP32", np.float32), "min_tokens": ("INT32", np.int32),
    "seed": ("UINT64", np.uint64), "end_id": ("INT32", np.int32), "pad_id": ("INT32", np.int32),
    "stop_words": ("BYTES", object), "bad_words": ("BYTES", object),
    "return_log_probs": ("BOOL", bool), "exclude_input_in_output": ("BOOL", bool),
    "apply_chat_template": ("BOOL", bool), "beam_width": ("INT32", np.int32),
    "num_return_sequences": ("INT32", np.int32), "return_perf_metrics": ("BOOL", bool),
}


class GenerateError(RuntimeError):
    """The server answered with an error (its message is kept as is)."""


def _array(name: str, value: Any) -> np.ndarray:
    """One request's value with the batch dimension the models declare (``[1, 1]``, ``[1, N]``);
    an ndarray is sent as it is (to send a wrong shape on purpose)."""
    if isinstance(value, np.ndarray):
        return value
    dtype = PARAM_TYPES[name][1]
    if dtype is object:
        vals = value if isinstance(value, (list, tuple)) else [value]
        return np.array([[v.encode("utf-8") if isinstance(v, str) else v for v in vals]], dtype=object)
    return np.array([[value]], dtype=dtype)


def grpc_inputs(text: str | bytes, datatypes: dict[str, str] | None = None, **params: Any) -> list:
    """InferInputs for the gRPC client; ``datatypes`` overrides a type (to send a wrong one on purpose)."""
    import tritonclient.grpc as g
    out = []
    for name, value in {"text_input": text, **params}.items():
        if value is None:
            continue
        arr = _array(name, value)
        dt = (datatypes or {}).get(name) or PARAM_TYPES[name][0]
        inp = g.InferInput(name, list(arr.shape), dt)
        inp.set_data_from_numpy(arr)
        out.append(inp)
    return out


def _http_body(text: str, params: dict[str, Any]) -> dict[str, Any]:
    return {"text_input": text, **{k: v for k, v in params.items() if v is not None}}


def http_generate(url: str, model: str, text: str, timeout: float = 300, headers: dict[str, str] | None = None,
                  **params: Any) -> dict[str, Any]:
    """POST /generate; returns the JSON body. Triton answers 200 with an error body for some failures."""
    import requests
    r = requests.post(f"http://{url}/v2/models/{model}/generate", json=_http_body(text, params), timeout=timeout,
                      headers=headers)
    body = r.json() if r.content else {}
    if r.status_code != 200 or "error" in body:
        raise GenerateError(body.get("error") or f"HTTP {r.status_code}: {r.text[:200]}")
    return body


def http_stream(url: str, model: str, text: str, timeout: float = 300, headers: dict[str, str] | None = None,
                **params: Any) -> Iterator[dict[str, Any]]:
    """POST /generate_stream (server-sent events); yields each event's JSON."""
    import requests
    params.setdefault("stream", True)
    with requests.post(f"http://{url}/v2/models/{model}/generate_stream", json=_http_body(text, params),
                       stream=True, timeout=timeout, headers=headers) as r:
        if r.status_code != 200:
            raise GenerateError(f"HTTP {r.status_code}: {r.text[:200]}")
        for line in r.iter_lines(decode_unicode=False):
            if not line.startswith(b"data:"):
                continue
            event = json.loads(line[5:].decode("utf-8"))
            if "error" in event:
                raise GenerateError(event["error"])
            yield event


@dataclasses.dataclass
class StreamResult:
    pieces: list[str] = dataclasses.field(default_factory=list)
    token_times: list[float] = dataclasses.field(default_factory=list)  # seconds since send, per piece
    start: float = 0.0
    end: float = 0.0
    error: str | None = None
    cancelled: bool = False

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    @property
    def latency(self) -> float:
        return self.end - self.start


# READ_TO_THE_END: a gRPC stream is read until the server ends it, never closed by the client at
# the response flagged final. Triton 24.10 (the nvidia-pytriton server) then sometimes keeps the
# model referenced for ever: it serves on, but cannot unload it, so shutdown waits out
# --exit-timeout-secs and exits 1 (seen for ensemble and bls, ~1 run in 2 of 12 sequential requests
# closed that way; 0 of 8 when read to the end). The server ends a stream right after its final
# response once the client has sent its request (the generator below is exhausted), so this costs
# nothing. A client that goes away mid-stream (a cancellation) is a different path and is safe
# (tests/serving/test_cancel_storm.py). tritonclient's aio stream cannot ask for Triton's empty final
# response (its triton_ parameter is reserved there): a flags-only final shows as the stream's end.


async def grpc_stream(client: Any, model: str, text: str, *, on_piece: Callable[[str], None] | None = None,
                      cancel_after: int | None = None, request_id: str = "", outputs: list[str] | None = None,
                      headers: dict[str, str] | None = None, **params: Any) -> StreamResult:
    """One streaming request over its own gRPC bidi stream (``tritonclient.grpc.aio`` client).

    ``cancel_after=n`` cancels the call after n pieces (the server sees the request cancelled).
    ``outputs``: the output names to ask for (the server sends only those); None = every output.
    Non-empty pieces only are recorded; the loop ends with the stream (READ_TO_THE_END).
    """
    params.setdefault("stream", True)
    inputs = grpc_inputs(text, **params)
    request = {"model_name": model, "inputs": inputs, "request_id": request_id}
    if outputs is not None:
        from tritonclient.grpc import InferRequestedOutput
        request["outputs"] = [InferRequestedOutput(name) for name in outputs]

    async def requests() -> AsyncIterator[dict]:
        yield request

    res = StreamResult(start=time.perf_counter())
    it = client.stream_infer(requests(), headers=headers)
    try:
        async for result, error in it:
            if error is not None:
                res.error = res.error or str(error)
                continue  # an error response is final too: read to the end (READ_TO_THE_END)
            piece = result.as_numpy("text_output")
            if piece is not None and piece.size:
                s = piece.reshape(-1)[0].decode("utf-8")
                if s:
                    res.pieces.append(s)
                    res.token_times.append(time.perf_counter() - res.start)
                    if on_piece is not None:
                        on_piece(s)
            final = result.get_response().parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                continue  # the server ends the stream next; see READ_TO_THE_END
            if cancel_after is not None and len(res.pieces) >= cancel_after:
                it.cancel()
                res.cancelled = True
                break
    except asyncio.CancelledError:
        res.cancelled = True
    res.end = time.perf_counter()
    return res


def grpc_generate(url: str, model: str, text: str, **params: Any) -> StreamResult:
    """Synchronous wrapper: one streaming request, a fresh client."""
    import tritonclient.grpc.aio as aio

    async def run() -> StreamResult:
        client = aio.InferenceServerClient(url)
        try:
            return await grpc_stream(client, model, text, **params)
        finally:
            await client.close()
    return asyncio.run(run())


# STOP_BY_ID: cancelling a gRPC stream to the ensemble does not reach its engine step on Triton 24.10
# (measured: the engine's request.is_cancelled() and response_sender.is_cancelled() stay false and
# its send() keeps succeeding; the ensemble drops the responses and the request runs to max_tokens).
# The ensemble forwards its request id to its steps, so a client that starts an ensemble stream with
# an unguessable id (a UUID: the engine refuses ids shorter than 16 characters) cancels it for real by
# closing the stream AND sending the engine model a stop_request with that id (model_repository
# README "Cancellation"). Closing the stream alone is enough for the engine and bls models.


async def stop_request(client: Any, engine_model: str, request_id: str,
                       headers: dict[str, str] | None = None) -> str | None:
    """Stop the engine request started with ``request_id`` (tensorrtllm_backend's ``stop_request``
    control request, sent to the engine model ``engine_model``). Returns the server's error, or None.
    The answer is one final response with no outputs."""
    import tritonclient.grpc as g
    stop = g.InferInput("stop_request", [1, 1], "BOOL")
    stop.set_data_from_numpy(np.array([[True]]))

    async def requests() -> AsyncIterator[dict]:
        yield {"model_name": engine_model, "inputs": [stop], "request_id": request_id}

    error = None
    async for _result, err in client.stream_infer(requests(), headers=headers):  # read to the end (READ_TO_THE_END)
        if err is not None:
            error = error or str(err)
    return error
