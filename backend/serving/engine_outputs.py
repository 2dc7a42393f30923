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
* ``sequence_index`` INT32 ``[1, 1]``: 0 (Kiln returns one sequence per request).
* Kiln's own, for its postprocessing: ``context_ids`` INT32 ``[1, c]`` (ids before ``output_ids``,
  to decode it as a continuation), ``text_trim`` INT32 ``[1, 1]`` (characters to cut for a stop
  string), ``finish_reason`` BYTES ``[1, 1]`` (non-empty exactly on the final response).
* With ``return_perf_metrics``: the acceptance and perf figures, each ``[1, 1]``.

Pure numpy: no Triton, no torch.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from backend.serving.batching import batched

__all__ = ["response_tensors"]


def response_tensors(ids: Sequence[int], context: Sequence[int], trim: int, logprobs: Sequence[float],
                     cum_logprob: float, reason: str,
                     extra: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    out = {
        "output_ids": np.asarray(ids, np.int32).reshape(1, 1, -1),
        "sequence_length": np.asarray([[len(ids)]], np.int32),
        "output_log_probs": np.asarray(logprobs, np.float32).reshape(1, 1, -1),
        "cum_log_probs": np.asarray([[cum_logprob]], np.float32),
        "sequence_index": np.zeros((1, 1), np.int32),
        "context_ids": batched(context, np.int32),
        "text_trim": np.asarray([[trim]], np.int32),
        "finish_reason": np.asarray([[reason.encode("utf-8")]], dtype=object),
    }
    for name, value in (extra or {}).items():
        out[name] = batched(value)
    return out
