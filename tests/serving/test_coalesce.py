"""Coalesced responses (backend/serving/engine_model/engine_outputs.py ``merge_outputs``): the responses of one stream
that waited for the responder, joined, must equal the one response that would have carried all their
tokens, output by output, whatever the request asked for.

The streams here are the engine model's real ``Stream`` objects fed real ``TokenEvent``s and a real
engine ``Request``; no Triton objects are involved (the response is made from these outputs
afterwards). The real server runs the same code in every serving test. Last, the response is made
with the outputs its request asked for only.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from backend.engine.events import TokenEvent
from backend.engine.request import Request
from backend.engine.sampling_params import SamplingParams
from backend.serving.engine_model.engine_outputs import MERGE_RULES, merge_outputs
from backend.serving.engine_model.engine_request import EngineRequest
from backend.serving.engine_model.engine_stream import Stream

PROMPT = [11, 12, 13, 14, 15, 16]
VOCAB = 7
TOP = 2


def _request(**asks) -> EngineRequest:
    asks.setdefault("return_log_probs", False)
    return EngineRequest(prompt_ids=PROMPT, sampling={}, streaming=True, stop_strings=(), **asks)


EVERYTHING = dict(return_log_probs=True, return_perf_metrics=True, return_context_logits=True,
                  return_generation_logits=True, return_num_input_tokens=True, return_num_output_tokens=True,
                  top_logprobs=TOP)


def _events(n_events: int, per_event: int, seed: int = 0) -> list[TokenEvent]:
    """Events like the executor's for a request that asked for everything."""
    g = torch.Generator().manual_seed(seed)
    engine_req = Request("r", PROMPT, SamplingParams(max_tokens=64))
    engine_req.num_new_blocks, engine_req.num_reused_blocks = 3, 1
    engine_req.first_token_time = engine_req.last_token_time = engine_req.arrival_time + 0.5
    out, tok = [], 100
    for e in range(n_events):
        ids = list(range(tok, tok + per_event))
        tok += per_event
        # dyadic log-probs: sums in any order are exact, so joined and whole totals compare equal
        lps = [(-0.25 * (t - 99), [(t, -0.25 * (t - 99)), (t + 1, -3.0)]) for t in ids]
        out.append(TokenEvent("r", ids, lps, request=engine_req,
                              context_logits=torch.randn(len(PROMPT), VOCAB, generator=g) if e == 0 else None,
                              generation_logits=torch.randn(per_event, VOCAB, generator=g)))
    return out


def _stream(**asks) -> Stream:
    return Stream("r", "t", None, None, _request(**asks), None, 0.0)


def _responses(events: list[TokenEvent], groups: list[int], asks: dict, final_reason: str = "length"):
    """The outputs of one response per group of events (``groups``: events per response); the last
    response is final. Context ids continue from the tokens sent before, as the detokenizer's do."""
    st = _stream(**asks)
    out, i, context = [], 0, PROMPT[-4:]
    for k, n in enumerate(groups):
        ids = []
        for ev in events[i:i + n]:
            st.record(ev, 1.0 + i)
            ids += ev.token_ids
        i += n
        last = k == len(groups) - 1
        # each response's text, as the detokenizer's chunks have it (a multi-byte character in it)
        text = "".join(f"<{t}\u00e9>" for t in ids)
        out.append(st.outputs(ids, context, 0, final_reason if last else "", text,
                              draft=(4 * (k + 1), 3 * (k + 1))))
        context = (context + ids)[-4:]
    return out


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert np.array_equal(a[name], b[name]), name


@pytest.mark.parametrize("asks", [{}, EVERYTHING, dict(return_log_probs=True, top_logprobs=TOP)],
                         ids=["plain", "everything", "logprobs"])
@pytest.mark.parametrize("groups", [[1, 1, 1, 1], [2, 1, 1], [3, 1]])
def test_joined_responses_equal_the_one_response_of_all_their_tokens(asks, groups):
    events = _events(4, per_event=2)
    parts = _responses(events, groups, asks)
    whole = _responses(events, [4], asks)[0]
    # the perf figures are the last response's, like the finish reason: a joined response is that one
    whole.update({k: parts[-1][k] for k in ("acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens")
                  if k in whole})
    _same(merge_outputs(parts), whole)
    assert merge_outputs(parts)["output_ids"].shape == (1, 1, 8)
    assert merge_outputs(parts)["output_text"][0, 0].decode() == "".join(f"<{t}\u00e9>" for t in range(100, 108))


def test_every_output_a_stream_can_send_has_a_rule():
    outputs = _responses(_events(1, per_event=1), [1], EVERYTHING)[0]
    assert set(outputs) <= set(MERGE_RULES), sorted(set(outputs) - set(MERGE_RULES))


def test_a_final_without_tokens_joins_the_data_before_it():
    """An in-band error (``kiln_inband_errors``) or an empty final after tokens still in the queue."""
    events = _events(2, per_event=1)
    parts = _responses(events, [1, 1], EVERYTHING, final_reason="")   # neither ends the stream
    st = _stream(**EVERYTHING)
    final = st.outputs([], [], 0, "error: engine failure", draft=(0, 0))
    merged = merge_outputs(parts + [final])
    assert merged["output_ids"].tolist() == [[[100, 101]]] and merged["sequence_length"].tolist() == [[2]]
    assert merged["finish_reason"].tolist() == [[b"error: engine failure"]]
    assert merged["generation_logits"].shape == (1, 1, 2, VOCAB)          # the empty part's [1, 1, 0, 0] left out
    assert merged["output_top_ids"].shape == (1, 1, 2, TOP)


def test_only_the_last_part_may_end_the_stream():
    parts = _responses(_events(2, per_event=1), [1, 1], {})
    ended = dict(parts[0], finish_reason=np.array([[b"stop"]], dtype=object))
    with pytest.raises(AssertionError, match="only the last part"):
        merge_outputs([ended, parts[1]])
    cut = dict(parts[0], text_trim=np.array([[3]], np.int32))
    with pytest.raises(AssertionError, match="only the last part"):
        merge_outputs([cut, parts[1]])


class _Recording:
    """Stands in for triton_python_backend_utils (what is under test is which tensors we make; the real
    module runs in every serving test): records the names of the tensors a response was made with."""

    class Tensor:
        def __init__(self, name, value):
            self.name_, self.value = name, value

    class InferenceResponse:
        def __init__(self, output_tensors, error=None):
            self.names = [t.name_ for t in output_tensors]


def test_a_response_carries_only_the_outputs_its_request_asked_for():
    """The sender would drop the others with the GIL released (engine_outputs.requested_outputs): a
    joined response's new arrays freed that way corrupted the stub's heap."""
    from backend.serving.engine_model.engine_outputs import error_response, make_response, requested_outputs

    outputs = merge_outputs(_responses(_events(2, per_event=1), [1, 1], {}))
    wanted = frozenset({"output_ids", "finish_reason", "not_an_output"})
    assert make_response(_Recording, outputs, wanted).names == ["output_ids", "finish_reason"]
    assert make_response(_Recording, outputs, None).names == list(outputs)
    assert error_response(_Recording, "boom", inband=True, wanted=wanted).names == ["output_ids", "finish_reason"]

    class Request:
        def __init__(self, names):
            self.names = names

        def requested_output_names(self):
            return self.names
    assert requested_outputs(Request(["output_ids", "sequence_length"])) == {"output_ids", "sequence_length"}
    assert requested_outputs(Request([])) is None
