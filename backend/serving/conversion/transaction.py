"""NVIDIA's ``decoupled_mode`` (build option ``serving.decoupled``) inside the Python backend.

A decoupled model streams: any number of responses, then the FINAL flag. A non-decoupled one answers
each request with exactly one response, which is what HTTP ``/v2/models/<m>/infer`` and one-shot gRPC
``ModelInfer`` need (Triton refuses both on a decoupled model). Kiln's engine and bls models send
their responses from their own threads in both modes (the Python backend lets a non-decoupled model
use its response sender when it sends one response with the FINAL flag); what changes is that a
request asking to stream is refused, with a message that says how to get streaming.
"""
from __future__ import annotations

from typing import Any

__all__ = ["is_decoupled", "streaming_refused", "STREAMING_REFUSED"]

STREAMING_REFUSED = ("{model}: {flag}=true needs a decoupled (streaming) model; this repository was "
                     "built with serving.decoupled=false (one response per request): send {flag}=false, "
                     "or rebuild with serving.decoupled=true")


def is_decoupled(model_config: dict[str, Any]) -> bool:
    """The model's transaction policy, from ``initialize(args)``'s parsed ``model_config``."""
    return bool(model_config.get("model_transaction_policy", {}).get("decoupled", False))


def _flag(pb: Any, request: Any, name: str) -> bool:
    t = pb.get_input_tensor_by_name(request, name)
    if t is None:
        return False
    a = t.as_numpy().reshape(-1)
    return bool(a[0]) if a.size else False


def streaming_refused(pb: Any, request: Any, model: str, flag: str) -> bool:
    """For a non-decoupled model: if ``request`` asks to stream (boolean input ``flag`` true), answer
    it with an error as its one FINAL response and return True; otherwise return False. A request
    whose flag cannot be read is left to the model's own validation."""
    try:
        wants = _flag(pb, request, flag)
    except Exception:  # noqa: BLE001 - malformed: the model's own checks explain it better
        return False
    if not wants:
        return False
    resp = pb.InferenceResponse(output_tensors=[],
                                error=pb.TritonError(STREAMING_REFUSED.format(model=model, flag=flag)))
    try:
        request.get_response_sender().send(resp, flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
    except Exception:  # noqa: BLE001 - the client went away
        pass
    return True
