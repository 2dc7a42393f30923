"""What one request may cost before it is refused: body size, JSON nesting depth, ``max_tokens``.

The body is refused on its size BEFORE it is read whole, parsed or tokenized (a 6 MB prompt used to
be tokenized for seconds only to be refused as too long afterwards): ``Content-Length`` is checked
first, and a body sent without one (chunked) is counted as it arrives and dropped at the limit.
Depth is checked on the parsed body with a loop, not recursion: Python's ``json`` parser recurses,
so a body of 100k nested brackets raises RecursionError (a 400 here, no longer a bare 500), and a
body just under the interpreter's limit would still reach code that recurses on it later (JSON
Schema checks, ``json.dumps`` of a tool schema).
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any

from fastapi import Request

from harness.openai.errors import ApiError

__all__ = ["Limits", "DEFAULT_MAX_BODY_BYTES", "MAX_JSON_DEPTH", "read_json_body", "json_depth"]

DEFAULT_MAX_BODY_BYTES = 4 << 20   # 4 MiB: ~1M tokens of text, far beyond any engine's max_input_len
MAX_JSON_DEPTH = 64                # tool schemas nest a handful of levels; 64 leaves room, not 100k


@dataclasses.dataclass(frozen=True)
class Limits:
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_tokens_cap: int | None = None   # --max-tokens-cap: the most a request may generate (None: max_seq_len)


def _too_large(limit: int, size: str) -> ApiError:
    return ApiError(413, f"the request body is {size}; this server accepts at most {limit} bytes "
                    f"(--max-body-bytes)", code="request_too_large")


async def read_json_body(request: Request, limit: int) -> Any:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit, f"{int(declared)} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit, f"over {limit} bytes")
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks))
    except RecursionError:
        raise ApiError(400, f"the request body nests JSON arrays or objects too deeply; at most "
                       f"{MAX_JSON_DEPTH} levels are accepted", code="invalid_json") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if json_depth(body) > MAX_JSON_DEPTH:
        raise ApiError(400, f"the request body nests JSON arrays or objects more than {MAX_JSON_DEPTH} "
                       "levels deep", code="invalid_json")
    return body


def json_depth(value: Any) -> int:
    """Nesting depth of parsed JSON (a scalar 0, ``[]`` 1), without recursion."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, dict):
            v = list(v.values())
        if isinstance(v, list):
            deepest = max(deepest, d)
            todo.extend((x, d + 1) for x in v if isinstance(x, (dict, list)))
    return deepest
