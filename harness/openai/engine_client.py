"""One generation = one gRPC stream to the engine model (``tensorrt_llm``), token ids in, pieces out.

Why the engine model and not the ensemble or bls: the front door already holds the token ids (exact
usage, the length check), the engine answers with the ids and their text (``output_text``: decoded
once in the engine host, a piece as a continuation, a stop string's characters cut), and closing
the stream cancels the request in
the engine, which frees its KV blocks. Closing an ensemble stream would not reach its engine step
on Triton 24.10 (model_repository/README.md, "Cancellation"), and bls would add a second hop.

The engine streams (``streaming`` true) also for an OpenAI request that is not streamed: the pieces
are collected by the caller. Each stream is read until the server ends it, never closed right after
the response flagged final (a Triton 24.10 defect then sometimes keeps the model referenced for
ever; harness/serving_client.py, READ_TO_THE_END); closing it EARLY is the cancellation.
"""
from __future__ import annotations

import dataclasses
import uuid
from typing import Any, AsyncIterator

import numpy as np

from backend.serving.text_models.postprocess import engine_text
from harness.openai.errors import ApiError, engine_error
from harness.openai.params import Sampling
from harness.openai.served_model import ServedModel

__all__ = ["Piece", "EngineCall", "engine_inputs", "openai_finish_reason"]


@dataclasses.dataclass
class Piece:
    """What one engine response adds."""
    ids: list[int]
    text: str
    logprobs: list[float]
    finish_reason: str | None = None   # OpenAI's, on the last piece only
    # per generated token, its most likely alternatives [(id, logprob)] (top_logprobs requests)
    tops: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)


def openai_finish_reason(engine_reason: str) -> str:
    """The engine's reason -> OpenAI's: "length" stays; "stop" (end token, stop word or string) and
    "cancelled" (the server is shutting down and ended the request early) become "stop", the only
    other value OpenAI clients know for a text answer."""
    return "length" if engine_reason == "length" else "stop"


def engine_inputs(prompt_ids: list[int], max_tokens: int, s: Sampling, vocab_size: int = 0) -> list:
    """The engine model's inputs, batch dimension first (``[1, 1]`` scalars, ``[1, L]`` lists)."""
    import tritonclient.grpc as g

    def add(name: str, value: Any, datatype: str, dtype: Any) -> None:
        arr = np.array([value if isinstance(value, list) else [value]], dtype=dtype)
        inp = g.InferInput(name, list(arr.shape), datatype)
        inp.set_data_from_numpy(arr)
        out.append(inp)

    out: list = []
    add("input_ids", list(prompt_ids), "INT32", np.int32)
    add("request_output_len", max_tokens, "INT32", np.int32)
    add("streaming", True, "BOOL", bool)
    add("exclude_input_in_output", True, "BOOL", bool)
    # greedy as temperature 0; top_p always sent: with neither top_k nor top_p the engine is greedy
    add("temperature", 0.0 if s.greedy else s.temperature, "FP32", np.float32)
    add("top_p", 1.0 if s.greedy else s.top_p, "FP32", np.float32)
    if s.top_k and not s.greedy:
        add("top_k", s.top_k, "INT32", np.int32)
    if s.seed is not None:
        add("seed", s.seed, "INT64", np.int64)
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(s, name) != 0.0:
            add(name, getattr(s, name), "FP32", np.float32)
    if s.repetition_penalty != 1.0:
        add("repetition_penalty", s.repetition_penalty, "FP32", np.float32)
    min_tokens = max_tokens if s.ignore_eos else s.min_tokens
    if min_tokens:
        add("min_tokens", min_tokens, "INT32", np.int32)
    if s.stop:
        add("stop_strings", [w.encode("utf-8") for w in s.stop], "BYTES", object)
    if s.logprobs:
        add("return_log_probs", True, "BOOL", bool)
    if s.top_logprobs:  # Kiln's engine extension: the k most likely tokens at each step
        add("top_logprobs", s.top_logprobs, "INT32", np.int32)
    if s.logit_bias:  # NVIDIA's dense embedding_bias: one value per vocabulary entry
        bias = np.zeros(vocab_size, np.float32)
        for tok, value in s.logit_bias:
            bias[tok] += value
        add("embedding_bias", bias.tolist(), "FP32", np.float32)
    if s.skip_special_tokens is False:  # Kiln's engine extension: special tokens kept in output_text
        add("skip_special_tokens", False, "BOOL", bool)
    if s.guide is not None:  # structured output: NVIDIA's two inputs, [1, 1] strings
        add("guided_decoding_guide_type", s.guide.kind.encode("utf-8"), "BYTES", object)
        add("guided_decoding_guide", s.guide.text.encode("utf-8"), "BYTES", object)
    return out


def _tops(result: Any) -> list[list[tuple[int, float]]]:
    """``output_top_ids`` / ``output_top_logprobs`` ``[1, 1, n, k]`` -> per token [(id, logprob)]."""
    ids, vals = result.as_numpy("output_top_ids"), result.as_numpy("output_top_logprobs")
    if ids is None or vals is None:
        return []
    ids, vals = ids.reshape(-1, ids.shape[-1]), vals.reshape(-1, vals.shape[-1])
    return [[(int(t), float(v)) for t, v in zip(ri, rv) if t >= 0] for ri, rv in zip(ids, vals)]


def _flat(result: Any, name: str) -> np.ndarray:
    arr = result.as_numpy(name)
    return np.zeros(0) if arr is None else arr.reshape(-1)


class EngineCall:
    """``async for piece in EngineCall(...).pieces()``. Raises ApiError for an error response.

    Cancelling the task that iterates (asyncio), or closing the iterator early, cancels the gRPC
    call in its ``finally``: Triton marks the request cancelled and the engine frees its KV blocks."""

    def __init__(self, client: Any, model: ServedModel, prompt_ids: list[int], max_tokens: int,
                 sampling: Sampling, request_id: str | None = None, headers: dict[str, str] | None = None):
        self.client, self.model = client, model
        self.headers = headers or None  # what a restricted Triton wants (harness/triton_auth.py)
        self.inputs = engine_inputs(prompt_ids, max_tokens, sampling, model.vocab_size)
        # a guide the engine cannot compile is the client's: a 400 naming the field it came from
        self.guide_param = sampling.guide.param if sampling.guide is not None else None
        # unguessable, like bls's: the engine honours a stop_request only for ids this long
        self.request_id = request_id or uuid.uuid4().hex
        self._it = None
        self.done = False        # the final response arrived
        self.cancelled = False   # the call was cancelled before it
        self._error: ApiError | None = None

    async def pieces(self) -> AsyncIterator[Piece]:
        import grpc

        async def requests():
            yield {"model_name": self.model.engine_model, "inputs": self.inputs, "request_id": self.request_id}

        self._it = self.client.stream_infer(requests(), headers=self.headers)
        sent, error = False, None
        try:
            while True:
                try:
                    result, err = await self._it.__anext__()
                except StopAsyncIteration:
                    break
                except grpc.aio.AioRpcError as e:
                    if e.code() == grpc.StatusCode.UNAVAILABLE:
                        raise ApiError(503, f"the Triton server is not reachable: {e.details()}",
                                       type="service_unavailable", code="engine_unavailable") from None
                    raise engine_error(e.details() or str(e.code()), sent, self.guide_param) from None
                if err is not None:  # an error response is final; read on to the stream's end
                    self.done = True
                    error = error or engine_error(err.message() if hasattr(err, "message") else str(err), sent,
                                                 self.guide_param)
                    continue
                piece = self._piece(result)
                if piece is None:
                    continue
                if piece.finish_reason is not None:
                    self.done = True
                sent = True
                yield piece
        finally:
            if not self.done:  # the caller stopped early (client gone) or the stream broke
                self.cancelled = True
                self._it.cancel()
        error = error or self._error
        if error is not None:
            raise error
        if not self.done:
            raise ApiError(500, "the engine's stream ended without a final response", type="server_error",
                           code="engine_error")

    def _piece(self, result: Any) -> Piece | None:
        ids = [int(t) for t in _flat(result, "output_ids")]
        reason_arr = _flat(result, "finish_reason")
        reason = reason_arr[0].decode("utf-8") if reason_arr.size else ""
        if reason.startswith("error"):  # in-band error (bls's requests only): final, read on to the end
            self.done = True
            self._error = engine_error(reason.partition(":")[2].strip() or reason, True, self.guide_param)
            return None
        logprobs = [float(x) for x in _flat(result, "output_log_probs")]
        text = engine_text(result.as_numpy("output_text")) or ""
        finish = openai_finish_reason(reason) if reason else None
        if not ids and finish is None:
            return None
        return Piece(ids, text, logprobs, finish, _tops(result))
