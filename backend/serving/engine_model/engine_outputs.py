"""The engine model's response tensors, in NVIDIA's ``tensorrt_llm`` layout.

Every response carries, batch dimension first (``max_batch_size`` > 0, one sequence per request):

* ``output_ids`` INT32 ``[1, 1, n]`` (batch, beam, tokens), FIRST: NVIDIA's benchmark reads the
  first output's third dimension as the response's token count. Streaming: the tokens new in this
  response. Not streaming: the prompt's ids then the generated ones, unless the request set
  ``exclude_input_in_output`` (tensorrtllm_backend's rule).
* ``sequence_length`` INT32 ``[1, 1]``: the number of ids in ``output_ids``.
* ``output_log_probs`` FP32 ``[1, 1, g]``: log-probabilities of this response's generated tokens
  (empty unless ``return_log_probs``); ``cum_log_probs`` FP32 ``[1, 1]``: their sum over the request
  so far. Always present, so that an ensemble that forwards them never waits for a missing output.
* ``sequence_index`` INT32 ``[1, 1]``: 0 (Kiln returns one sequence per request);
  ``batch_index`` INT32 ``[1, 1]``: the row of the request this response belongs to (0 for a
  request of one row: always present, so an ensemble forwarding it never waits for it).
* Kiln's own, for its postprocessing: ``output_text`` BYTES ``[1, 1]`` (the text of ``output_ids``,
  stop-string cut applied: the engine host decodes each token once, to know when its text is whole
  and whether a stop string appeared, and its text models and the OpenAI front door take that text
  instead of decoding again), ``context_ids`` INT32 ``[1, c]`` (ids before ``output_ids``, to decode it
  as a continuation when a caller has only the ids), ``text_trim`` INT32 ``[1, 1]`` (characters cut
  for a stop string), ``finish_reason`` BYTES ``[1, 1]`` (non-empty exactly on the final response).
* ``context_logits`` FP32 ``[1, prompt, vocab]`` (with ``return_context_logits``: on the first
  response, the model's logits at every prompt position) and ``generation_logits`` FP32
  ``[1, 1, g, vocab]`` (with ``return_generation_logits``: the raw logits of this response's
  generated tokens). Always present, zero-sized when not asked for (``[1, 0, 0]``, ``[1, 1, 0, 0]``),
  for the same reason as the log-probabilities.
* With ``return_perf_metrics``: the acceptance and perf figures, each ``[1, 1]``.

Responses of one stream that waited behind a send go out as one (``responder.py``): ``merge_outputs``
joins them by the rule each output has in ``MERGE_RULES`` (tokens and their per-token outputs
concatenated, counts added, running totals and the final response's fields taken from the last).

Numpy only: the Triton calls go through the ``pb`` (``triton_python_backend_utils``) a caller passes.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import numpy as np

from backend.serving.metrics.acceptance import ACCEPTANCE_OUTPUTS
from backend.serving.conversion.batching import batched
from backend.serving.metrics.perf_metrics import PERF_OUTPUTS

__all__ = ["MERGE_RULES", "error_response", "make_response", "merge_outputs", "requested_outputs",
           "response_tensors", "send_error", "send_empty_final"]


_NO_CONTEXT_LOGITS = np.zeros((1, 0, 0), np.float32)
_NO_GENERATION_LOGITS = np.zeros((1, 1, 0, 0), np.float32)


def response_tensors(ids: Sequence[int], context: Sequence[int], trim: int, logprobs: Sequence[float],
                     cum_logprob: float, reason: str, text: str = "",
                     extra: Mapping[str, np.ndarray] | None = None,
                     row: int = 0, context_logits: np.ndarray | None = None,
                     generation_logits: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """``context_logits`` ``[prompt, vocab]`` and ``generation_logits`` ``[g, vocab]`` (fp32), or None."""
    out = {
        "output_ids": np.asarray(ids, np.int32).reshape(1, 1, -1),
        "sequence_length": np.asarray([[len(ids)]], np.int32),
        "output_log_probs": np.asarray(logprobs, np.float32).reshape(1, 1, -1),
        "cum_log_probs": np.asarray([[cum_logprob]], np.float32),
        "batch_index": np.asarray([[row]], np.int32),
        "sequence_index": np.zeros((1, 1), np.int32),
        "context_ids": batched(context, np.int32),
        "text_trim": np.asarray([[trim]], np.int32),
        "output_text": _text(text),
        "finish_reason": np.asarray([[reason.encode("utf-8")]], dtype=object),
        "context_logits": (_NO_CONTEXT_LOGITS if context_logits is None
                           else np.asarray(context_logits, np.float32)[None]),
        "generation_logits": (_NO_GENERATION_LOGITS if generation_logits is None
                              else np.asarray(generation_logits, np.float32)[None, None]),
    }
    for name, value in (extra or {}).items():
        out[name] = batched(value)
    return out


def _text(text: str) -> np.ndarray:
    return np.asarray([[text.encode("utf-8")]], dtype=object)


def _join_text(parts: list[np.ndarray]) -> np.ndarray:
    # each part's text continues the one before (the detokenizer sends whole characters only)
    return np.asarray([[b"".join(p.reshape(-1)[0] for p in parts)]], dtype=object)


def _concat(axis: int) -> Callable[[list[np.ndarray]], np.ndarray]:
    """Per-token outputs: joined along the token axis. Empty parts are left out (a part without
    tokens, or logits a request did not ask for, is zero-sized in other dimensions too)."""
    def join(parts: list[np.ndarray]) -> np.ndarray:
        full = [p for p in parts if p.size]
        if len(full) <= 1:
            return full[0] if full else parts[-1]
        return np.concatenate(full, axis=axis)
    return join


def _add(parts: list[np.ndarray]) -> np.ndarray:
    return np.sum(parts, axis=0, dtype=parts[0].dtype)


def _first(parts: list[np.ndarray]) -> np.ndarray:
    return parts[0]


def _last(parts: list[np.ndarray]) -> np.ndarray:
    return parts[-1]


# How each output of consecutive responses of one stream becomes the output of one response.
MERGE_RULES: dict[str, Callable[[list[np.ndarray]], np.ndarray]] = {
    "output_ids": _concat(2), "output_log_probs": _concat(2), "generation_logits": _concat(2),
    "output_top_ids": _concat(2), "output_top_logprobs": _concat(2),
    "context_logits": _concat(1),       # only a request's first response carries them
    "sequence_length": _add, "num_output_tokens": _add,
    "context_ids": _first,              # the tokens before the first part's: decoding continues from them
    "output_text": _join_text,
    # running totals and the final response's fields: the last part's
    "cum_log_probs": _last, "text_trim": _last, "finish_reason": _last, "batch_index": _last,
    "sequence_index": _last, "num_input_tokens": _last,
    **{name: _last for name in ACCEPTANCE_OUTPUTS + PERF_OUTPUTS},
}


def merge_outputs(parts: Sequence[Mapping[str, np.ndarray]]) -> Mapping[str, np.ndarray]:
    """One response's outputs from consecutive responses of one stream, all but the last not final
    (no finish reason, no text cut). Every part has the same outputs (the request's options fix them)."""
    if len(parts) == 1:
        return parts[0]
    for p in parts[:-1]:
        assert p["finish_reason"][0, 0] == b"" and p["text_trim"][0, 0] == 0, "only the last part may end"
    return {name: MERGE_RULES[name]([p[name] for p in parts]) for name in parts[0]}


def requested_outputs(request: Any) -> frozenset[str] | None:
    """The outputs ``request`` asked for (None: every output). Its response sender delivers only those
    and drops the others itself, but in Triton 24.10's stub it drops them after releasing the GIL
    (``ResponseSender::Send``: ``gil_scoped_release``, then ``PruneOutputTensors``): a dropped tensor
    whose numpy array had no other reference frees that array with no GIL held, which corrupted the
    stub's heap ("malloc(): unaligned fastbin chunk detected") once responses were joined
    (``merge_outputs`` makes new arrays). So responses carry only these (``make_response``)."""
    names = request.requested_output_names()
    return frozenset(names) if names else None


def make_response(pb: Any, outputs: Mapping[str, np.ndarray], wanted: frozenset[str] | None) -> Any:
    """The Triton response carrying the outputs of ``outputs`` that the request asked for (``wanted``:
    ``requested_outputs``): the sender then has nothing to drop (``requested_outputs`` says why)."""
    return pb.InferenceResponse(output_tensors=[pb.Tensor(k, v) for k, v in outputs.items()
                                                if wanted is None or k in wanted])


def error_response(pb: Any, message: str, inband: bool = False, wanted: frozenset[str] | None = None) -> Any:
    """An error response, or for ``inband`` (the bls model's requests) a data response whose
    finish_reason is "error: <message>" (empty outputs; only the ``wanted`` ones)."""
    if inband:
        return make_response(pb, response_tensors([], [], 0, [], 0.0, f"error: {message}"), wanted)
    return pb.InferenceResponse(output_tensors=[], error=pb.TritonError(message))


def send_error(pb: Any, sender: Any, message: str, inband: bool = False,
               wanted: frozenset[str] | None = None) -> None:
    """A request's FINAL response (``error_response``) where no stream state exists yet."""
    resp = error_response(pb, message, inband, wanted)
    try:
        sender.send(resp, flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
    except Exception:  # noqa: BLE001 - nobody left to tell
        pass


def send_empty_final(pb: Any, sender: Any) -> None:
    """The answer to a stop: one FINAL response with no outputs, as tensorrtllm_backend sends (a
    non-decoupled model must send exactly one response, so not a bare FINAL flag)."""
    try:
        sender.send(pb.InferenceResponse(output_tensors=[]), flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
    except Exception:  # noqa: BLE001 - nobody left to tell
        pass
