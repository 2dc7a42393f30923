"""SamplingParams: validation errors name the field, the value and what is allowed (pure Python)."""
import math

import pytest

from backend.engine.sampling_params import MAX_LOGPROBS, SamplingParams


def test_defaults_are_valid_and_greedy_flag():
    SamplingParams().validate(room=100, vocab_size=1000)
    assert SamplingParams(temperature=0.0).greedy
    assert not SamplingParams().greedy


@pytest.mark.parametrize("changes, field, allowed", [
    ({"temperature": -0.1}, "temperature", ">= 0"),
    ({"temperature": math.nan}, "temperature", "finite"),
    ({"temperature": math.inf}, "temperature", "finite"),
    ({"top_p": 0.0}, "top_p", "(0, 1]"),
    ({"top_p": 1.5}, "top_p", "(0, 1]"),
    ({"top_k": -1}, "top_k", ">= 0"),
    ({"top_k": 1001}, "top_k", "0..1000"),
    ({"min_p": -0.5}, "min_p", "[0, 1]"),
    ({"min_p": 1.01}, "min_p", "[0, 1]"),
    ({"max_tokens": 0}, "max_tokens", "1..50"),
    ({"max_tokens": 51}, "max_tokens", "1..50"),
    ({"max_tokens": -3}, "max_tokens", "1..50"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens", "0..max_tokens (4)"),
    ({"min_tokens": -1}, "min_tokens", "0..max_tokens"),
    ({"repetition_penalty": 0.0}, "repetition_penalty", "> 0"),
    ({"presence_penalty": 2.5}, "presence_penalty", "[-2.0, 2.0]"),
    ({"frequency_penalty": -2.01}, "frequency_penalty", "[-2.0, 2.0]"),
    ({"logprobs": MAX_LOGPROBS + 1}, "logprobs", f"0..{MAX_LOGPROBS}"),
    ({"logprobs": -1}, "logprobs", "0.."),
    ({"seed": -1}, "seed", "2**64-1"),
    ({"seed": 2**64}, "seed", "2**64-1"),
    ({"seed": 1.5}, "seed", "integer"),
    ({"stop_token_ids": (5, 1000)}, "stop_token_ids", "0..999"),
    ({"stop_token_ids": (-1,)}, "stop_token_ids", "0..999"),
    ({"bad_token_ids": ((),)}, "bad_token_ids", "non-empty"),
    ({"bad_token_ids": ((3, 4000),)}, "bad_token_ids", "0..999"),
    ({"max_tokens": True}, "max_tokens", "integer"),
    ({"top_k": 2.0}, "top_k", "integer"),
    ({"ignore_eos": 1}, "ignore_eos", "true or false"),
    ({"priority": "high"}, "priority", "integer"),
])
def test_invalid_values_name_field_value_and_allowed(changes, field, allowed):
    params = SamplingParams(**changes)
    with pytest.raises(ValueError) as exc:
        params.validate(room=50, vocab_size=1000)
    msg = str(exc.value)
    assert msg.startswith(f"sampling.{field}: "), msg
    assert allowed in msg, msg
    assert "\n" not in msg
    value = changes[field]
    if not isinstance(value, tuple):             # lists quote the offending element instead
        assert repr(value) in msg, msg


def test_no_room_to_generate_is_explained():
    with pytest.raises(ValueError, match=r"sampling\.max_tokens: .*no room to generate"):
        SamplingParams(max_tokens=1).validate(room=0)


def test_boundaries_are_accepted():
    SamplingParams(temperature=0.0, top_p=1.0, top_k=1000, min_p=1.0, max_tokens=50, min_tokens=50,
                   presence_penalty=-2.0, frequency_penalty=2.0, logprobs=MAX_LOGPROBS,
                   seed=2**64 - 1, stop_token_ids=(0, 999), bad_token_ids=((999,),)
                   ).validate(room=50, vocab_size=1000)
    # Without a vocabulary only the sign of token ids is checked.
    SamplingParams(stop_token_ids=(10**6,), top_k=10**6).validate(room=16)


def test_lists_are_stored_as_tuples_so_params_stay_frozen_and_hashable():
    p = SamplingParams(stop_token_ids=[1, 2], bad_token_ids=[[3, 4], [5]])
    assert p.stop_token_ids == (1, 2)
    assert p.bad_token_ids == ((3, 4), (5,))
    hash(p)
    with pytest.raises(AttributeError):
        p.temperature = 0.5  # type: ignore[misc]


def test_replace_keeps_other_fields_and_rejects_unknown_names():
    p = SamplingParams(temperature=0.7, seed=3)
    q = p.replace(max_tokens=9)
    assert (q.temperature, q.seed, q.max_tokens) == (0.7, 3, 9)
    with pytest.raises(ValueError, match=r"unknown field\(s\) temprature; allowed: .*temperature"):
        p.replace(temprature=1.0)


def test_logit_bias_is_validated_and_stored_as_pairs():
    p = SamplingParams(logit_bias={3: 1.5, 9: -2})
    assert p.logit_bias == ((3, 1.5), (9, -2))
    p.validate(16, vocab_size=10)
    for bad, fragment in ((((12, 1.0),), "token ids allowed: 0..9"), (((3, float("nan")),), "finite"),
                          (((3,),), "pair")):
        with pytest.raises(ValueError, match=f"sampling.logit_bias: .*{fragment}"):
            SamplingParams(logit_bias=bad).validate(16, vocab_size=10)
