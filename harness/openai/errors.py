"""OpenAI's error shape and which HTTP status each failure gets.

Clients (the official ``openai`` package included) turn the status into an exception class
(400 BadRequestError, 404 NotFoundError, 503 InternalServerError, ...) and read ``error.param`` to
show which field was wrong, so every refusal names its field.
"""
from __future__ import annotations

from typing import Any

__all__ = ["ApiError", "bad_request", "error_body", "engine_error"]


class ApiError(Exception):
    """A request that ends with an OpenAI error response instead of a completion."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(param: str, message: str, code: str | None = "invalid_value") -> ApiError:
    # the field leads the message too: a client that prints only the message still sees it
    return ApiError(400, f"'{param}': {message}", param=param, code=code)


# Substrings of the engine's own messages (backend/serving) that say it is not serving now, as
# opposed to refusing this request: shutting down, draining, or its model not loaded.
_UNAVAILABLE = ("shutting down", "not serving", "unavailable", "not ready", "is not found", "unknown model")


# What the engine's refusal of a structured-output guide names: NVIDIA's inputs
# (backend.serving.conversion.convert.InvalidRequest) or the engine's own sampling field (SamplingParams)
_GUIDE_WORDS = ("guided_decoding_guide", "sampling.guide")


def engine_error(message: str, sent_anything: bool, guide_param: str | None = None) -> ApiError:
    """An error the engine model (or Triton) answered with. The front door checks every parameter
    first, so a refusal here is rare: an input the engine checks more strictly, a guide that does not
    compile (a 400 naming ``guide_param``, the request field the guide came from; the engine's
    message kept), or a server that is stopping."""
    low = message.lower()
    if guide_param and not sent_anything and any(w in low for w in _GUIDE_WORDS):
        return ApiError(400, f"'{guide_param}': the engine refused it: {message}", param=guide_param,
                        code="invalid_value")
    if any(s in low for s in _UNAVAILABLE):
        return ApiError(503, f"the engine is not available: {message}", type="service_unavailable",
                        code="engine_unavailable")
    if not sent_anything and "input '" in low:  # backend.serving.conversion.convert.InvalidRequest's wording
        return ApiError(400, message, code="invalid_value")
    return ApiError(500, f"the engine failed: {message}", type="server_error", code="engine_error")
