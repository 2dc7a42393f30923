"""An OpenAI request body -> checked sampling parameters; a mistake names its field (400).

OpenAI's sampling meets TensorRT-LLM's here. The engine model decodes GREEDILY when a request sets
neither ``top_k`` nor ``top_p`` (its ``top_p`` 0 = off), whatever the temperature, while OpenAI
samples at temperature 1 and top_p 1 by default; so ``top_p`` is always sent (``Sampling.top_p``),
and greedy decoding is asked for with temperature 0, which is also what OpenAI's temperature 0 and
top_p 0 mean.

Structured output (``parse_guide``): OpenAI's ``response_format`` (``json_object``, ``json_schema``) and
vLLM's ``guided_json`` / ``guided_regex`` / ``guided_grammar`` become the engine's guide, NVIDIA's
``guided_decoding_guide_type`` + ``guided_decoding_guide``; the engine masks every token with it.

Fields OpenAI defines that Kiln cannot honour are refused unless they hold their neutral value (one
sequence per request, no legacy functions): a client must never get something other than what it
asked for without knowing. Fields that do not change the output
(``user``, ``metadata``, ``store``, ...) and unknown fields are ignored, as OpenAI-compatible servers
usually do, so that clients adding new optional fields keep working.
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Mapping

from harness.openai.errors import bad_request

__all__ = ["Sampling", "Guide", "check_logit_bias", "parse_sampling", "parse_guide", "parse_stream", "check_unsupported",
           "MAX_STOP", "GUIDE_FIELDS"]

MAX_STOP = 4           # OpenAI's limit on stop sequences
SEED_MOD = 1 << 63     # the engine's seed is INT64 with -1 = none: any integer is folded into 63 bits


@dataclasses.dataclass(frozen=True)
class Guide:
    """A structured-output constraint as the engine takes it, and the request field it came from
    (what a 400 names, the engine's refusal of a guide that does not compile included)."""
    kind: str     # guided_decoding_guide_type: "json_schema", "regex" or "ebnf_grammar"
    text: str     # guided_decoding_guide: the schema (JSON text), the regex, the grammar
    param: str    # "response_format", "guided_json", "guided_regex" or "guided_grammar"


@dataclasses.dataclass(frozen=True)
class Sampling:
    max_tokens: int | None        # None: all the room the prompt leaves in max_seq_len
    temperature: float
    top_p: float
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False      # vLLM's extension (benchmark clients send it): min_tokens = max_tokens
    logprobs: bool = False        # the chosen token's log-probability
    top_logprobs: int = 0         # alternatives per token (the engine's top_logprobs extension)
    guide: Guide | None = None    # structured output (parse_guide)
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, bias) added to the logits
    # vLLM's extension: false keeps special tokens in the text; None: the route's default (true,
    # except chat on a model whose tool or reasoning markers are special tokens)
    skip_special_tokens: bool | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_p == 0.0 or self.top_k == 1


# ---- field readers: each refuses a wrong type or range with the field's name ---------------------

def _int(body: Mapping[str, Any], name: str, lo: int | None = None, hi: int | None = None,
         default: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad_request(name, f"expected an integer, got {json_type(v)}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise bad_request(name, f"{v} is out of range; allowed: {_range(lo, hi)}")
    return v


def _num(body: Mapping[str, Any], name: str, lo: float, hi: float | None, default: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise bad_request(name, f"expected a finite number, got {json_type(v)} {v!r}"[:200])
    if v < lo or (hi is not None and v > hi):
        raise bad_request(name, f"{v} is out of range; allowed: {_range(lo, hi)}")
    return float(v)


def _bool(body: Mapping[str, Any], name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad_request(name, f"expected true or false, got {json_type(v)}")
    return v


def _range(lo, hi) -> str:
    return f"[{lo}, {hi}]" if hi is not None else f">= {lo}"


def json_type(v: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object", type(None): "null"}.get(type(v), type(v).__name__)


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    words = [v] if isinstance(v, str) else v
    if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
        raise bad_request("stop", f"expected a string or an array of strings, got {json_type(v)}")
    if len(words) > MAX_STOP:
        raise bad_request("stop", f"{len(words)} stop sequences; at most {MAX_STOP} are allowed")
    return tuple(dict.fromkeys(w for w in words if w))  # "" stops nothing; duplicates once


# ---- the request as a whole ----------------------------------------------------------------------

def parse_max_tokens(body: Mapping[str, Any], default: int | None) -> int | None:
    """``max_completion_tokens`` (chat's current name) or ``max_tokens``; both given must agree."""
    a = _int(body, "max_completion_tokens", lo=1)
    b = _int(body, "max_tokens", lo=1)
    if a is not None and b is not None and a != b:
        raise bad_request("max_completion_tokens", f"{a} differs from max_tokens={b}; send one of them")
    return a if a is not None else b if b is not None else default


def parse_sampling(body: Mapping[str, Any], *, chat: bool) -> Sampling:
    """``chat``: chat's ``logprobs`` (bool) + ``top_logprobs``; else completions' ``logprobs`` (int)."""
    temperature = _num(body, "temperature", 0.0, 2.0, 1.0)
    top_p = _num(body, "top_p", 0.0, 1.0, 1.0)
    top_k = _int(body, "top_k", lo=-1, default=0)      # vLLM's extension; -1 = off as there
    if chat:
        logprobs = _bool(body, "logprobs")
        top = _int(body, "top_logprobs", lo=0, hi=20, default=0)
        if top and not logprobs:
            raise bad_request("top_logprobs", "needs logprobs: true")
    else:
        n = _int(body, "logprobs", lo=0, hi=5)
        logprobs, top = n is not None, n or 0
    max_tokens = parse_max_tokens(body, None if chat else 16)  # 16: the completions API's default
    min_tokens = _int(body, "min_tokens", lo=0, default=0)
    ignore_eos = _bool(body, "ignore_eos")
    if max_tokens is not None and min_tokens > max_tokens:
        raise bad_request("min_tokens", f"{min_tokens} exceeds max_tokens={max_tokens}")
    seed = _int(body, "seed")
    guide = parse_guide(body)
    if guide is not None:
        # the grammar's end allows only the end token, which both of these forbid until later
        for name, on in (("ignore_eos", ignore_eos), ("min_tokens", min_tokens > 0)):
            if on:
                raise bad_request(name, f"cannot be combined with {guide.param}: the constrained output ends "
                                  "with the end token as soon as it is complete", code="unsupported_value")
    s = Sampling(
        max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=max(top_k, 0),
        seed=None if seed is None else seed % SEED_MOD, stop=_stop(body),
        presence_penalty=_num(body, "presence_penalty", -2.0, 2.0, 0.0),
        frequency_penalty=_num(body, "frequency_penalty", -2.0, 2.0, 0.0),
        repetition_penalty=_num(body, "repetition_penalty", 1e-6, None, 1.0),
        min_tokens=min_tokens, ignore_eos=ignore_eos, logprobs=logprobs, top_logprobs=top, guide=guide,
        logit_bias=_logit_bias(body),
        skip_special_tokens=None if body.get("skip_special_tokens") is None else _bool(body, "skip_special_tokens"))
    return s


def _logit_bias(body: Mapping[str, Any]) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias``: ``{"<token id>": bias}``, each bias in [-100, 100] added to that token's
    logit before sampling (-100 in effect bans it, 100 all but forces it). The ids are checked
    against the vocabulary by ``check_logit_bias`` (the model is needed)."""
    v = body.get("logit_bias")
    if v is None:
        return ()
    if not isinstance(v, dict):
        raise bad_request("logit_bias", f"expected an object mapping token ids to biases, got {json_type(v)}")
    out = []
    for key, bias in v.items():
        try:
            tok = int(key)
        except (TypeError, ValueError):
            raise bad_request("logit_bias", f"key {json_dumps_short(key)} is not a token id") from None
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise bad_request("logit_bias", f"bias {json_dumps_short(bias)} for token {tok} is out of range; "
                              "allowed: a number in [-100, 100]")
        out.append((tok, float(bias)))
    return tuple(out)


def check_logit_bias(s: Sampling, vocab_size: int) -> None:
    bad = [t for t, _ in s.logit_bias if not 0 <= t < vocab_size]
    if bad:
        raise bad_request("logit_bias", f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")


# ---- structured output --------------------------------------------------------------------------

GUIDE_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_grammar")
_RESPONSE_TYPES = ("text", "json_object", "json_schema")
ANY_OBJECT = '{"type": "object"}'   # json_object: any JSON object


def _response_format(v: Any) -> Guide | None:
    """OpenAI's ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}``,
    or ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``."""
    def bad(why: str) -> Exception:
        return bad_request("response_format", why)
    if not isinstance(v, dict):
        raise bad(f"expected an object such as {{\"type\": \"json_object\"}}, got {json_type(v)}")
    kind = v.get("type")
    if kind not in _RESPONSE_TYPES:
        raise bad(f"type {json_dumps_short(kind)} is not supported; allowed: {', '.join(_RESPONSE_TYPES)}")
    if kind == "text":
        return None
    if kind == "json_object":
        return Guide("json_schema", ANY_OBJECT, "response_format")
    js = v.get("json_schema")
    if not isinstance(js, dict):
        raise bad(f"type json_schema needs a json_schema object ({{\"name\": ..., \"schema\": {{...}}}}), "
                  f"got {json_type(js)}")
    if not isinstance(js.get("name"), str) or not js["name"]:
        raise bad(f"json_schema.name: expected a non-empty string, got {json_type(js.get('name'))}")
    if not isinstance(js.get("schema"), dict):
        raise bad(f"json_schema.schema: expected a JSON Schema object, got {json_type(js.get('schema'))}")
    if js.get("strict") is not None and not isinstance(js["strict"], bool):
        raise bad(f"json_schema.strict: expected true, false or null, got {json_type(js['strict'])}")
    # strict or not, every token is masked with the schema: the output always validates
    return Guide("json_schema", json.dumps(js["schema"]), "response_format")


def _guided_json(v: Any) -> Guide:
    """vLLM's ``guided_json``: a JSON Schema, as an object or as its JSON text."""
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except ValueError as e:
            raise bad_request("guided_json", f"the schema text is not valid JSON: {e}") from None
    if not isinstance(v, dict):
        raise bad_request("guided_json", f"expected a JSON Schema object (or its JSON text), got {json_type(v)}")
    return Guide("json_schema", json.dumps(v), "guided_json")


def _guide_text(name: str, v: Any, kind: str) -> Guide:
    if not isinstance(v, str) or not v:
        raise bad_request(name, f"expected a non-empty string, got {json_type(v)}" + (" (empty)" if v == "" else ""))
    return Guide(kind, v, name)


def parse_guide(body: Mapping[str, Any]) -> Guide | None:
    """The request's one structured-output constraint, or None. Two of them (``response_format``
    other than text counts) are refused: the engine applies one grammar per request."""
    readers = {"response_format": _response_format, "guided_json": _guided_json,
               "guided_regex": lambda v: _guide_text("guided_regex", v, "regex"),
               "guided_grammar": lambda v: _guide_text("guided_grammar", v, "ebnf_grammar")}
    guides = [g for name in GUIDE_FIELDS if body.get(name) is not None
              for g in [readers[name](body[name])] if g is not None]
    if len(guides) > 1:
        names = [g.param for g in guides]
        raise bad_request(names[1], f"{' and '.join(names)} both constrain the output; send at most one of "
                          f"{', '.join(GUIDE_FIELDS)}", code="unsupported_value")
    return guides[0] if guides else None


def parse_stream(body: Mapping[str, Any]) -> tuple[bool, bool]:
    """(stream, include_usage)."""
    stream = _bool(body, "stream")
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if not stream:
        raise bad_request("stream_options", "only allowed when stream is true")
    if not isinstance(opts, dict):
        raise bad_request("stream_options", f"expected an object, got {json_type(opts)}")
    return stream, _bool(opts, "include_usage")


# field -> (is it at its neutral value?, why it is refused otherwise)
_UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "n": (lambda v: v in (None, 1), "only n=1 is supported (one sequence per request)"),
    "best_of": (lambda v: v in (None, 1), "only best_of=1 is supported (one sequence per request)"),
    "echo": (lambda v: v in (None, False), "echo is not supported"),
    "suffix": (lambda v: v in (None, ""), "suffix (insertion) is not supported"),
    "functions": (lambda v: v in (None, []), "the deprecated functions field is not supported; send tools"),
    "function_call": (lambda v: v in (None, "none"), "the deprecated function_call field is not supported; "
                      "send tool_choice"),
    # vLLM's other structured-output fields: a constraint must never be dropped silently
    "guided_choice": (lambda v: v is None, "guided_choice is not supported; use guided_regex "
                      "(the choices joined with |) or guided_grammar"),
    "guided_whitespace_pattern": (lambda v: v is None, "the engine writes compact JSON (no free whitespace); "
                                  "a whitespace pattern is not supported"),
    "structured_outputs": (lambda v: v is None, "structured_outputs is not supported; use response_format, "
                           "guided_json, guided_regex or guided_grammar"),
    "modalities": (lambda v: v in (None, ["text"]), "only the text modality is supported"),
    "audio": (lambda v: v is None, "audio output is not supported"),
    "prediction": (lambda v: v is None, "predicted outputs are not supported"),
}


def check_unsupported(body: Mapping[str, Any]) -> None:
    for name, (neutral, why) in _UNSUPPORTED.items():
        if name in body and not neutral(body[name]):
            raise bad_request(name, f"{json_dumps_short(body[name])}: {why}", code="unsupported_value")


def json_dumps_short(v: Any) -> str:
    try:
        s = json.dumps(v)
    except (TypeError, ValueError):
        s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."
