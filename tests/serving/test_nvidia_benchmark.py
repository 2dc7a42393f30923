"""benchmark_core_model.py: concurrent async_infer to tensorrt_llm over HTTP and gRPC.

Replays NVIDIA's tensorrtllm_backend client script request for request against the real Triton
server (shared prompts, expected answers and request building: tests/serving/nvidia_clients.py).
"""
from __future__ import annotations

import queue
from functools import partial
from typing import Any

import numpy as np
import pytest

from tests.serving.nvidia_clients import (BENCH_N, BENCH_RANDOM, STREAM_TIMEOUT, protocol_client, client_module, tensor)

pytestmark = [pytest.mark.slow, pytest.mark.server]


# ---- benchmark_core_model.py -------------------------------------------------------------------

def _bench_requests(refs) -> list[dict]:
    """8 requests: dataset prompts (tokenizer ids, pad/end = the tokenizer's) and, at BENCH_RANDOM,
    the synthetic workload's ids (np.random.randint(0, 2**31 - 1), pad_id 0, end_id 1)."""
    rng = np.random.default_rng(420)
    out, prompts = [], iter(refs.bench)
    for i in range(8):
        if i in BENCH_RANDOM:
            ids = rng.integers(0, 2**31 - 1, size=12 + i, dtype=np.int32)
            out.append(dict(ids=ids, pad=0, end=1, ref=None))
        else:
            ref = next(prompts)
            out.append(dict(ids=np.array(ref.prompt_ids, dtype=np.int32), pad=refs.eos, end=refs.eos, ref=ref))
    return out


def _bench_inputs(mod, req: dict) -> list:
    ids = req["ids"]
    return [tensor(mod, "input_ids", ids[None, :]),
            tensor(mod, "input_lengths", np.array([[len(ids)]], dtype=np.int32)),
            tensor(mod, "request_output_len", np.array([[BENCH_N]], dtype=np.int32)),
            tensor(mod, "pad_id", np.array([[req["pad"]]], dtype=np.int32)),
            tensor(mod, "end_id", np.array([[req["end"]]], dtype=np.int32))]


def _check_bench_success(req: dict, name0: str, shape0: list[int], output_ids: np.ndarray) -> None:
    ref, L = req["ref"], len(req["ids"])
    assert name0 == "output_ids", name0          # extract_print_stats: outputs[0].shape[2]
    assert len(shape0) == 3 and shape0[:2] == [1, 1], shape0
    assert shape0[2] - L == BENCH_N, (shape0, L)
    assert output_ids[0, 0].tolist() == ref.prompt_ids + ref.ids


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_benchmark_core_model(nd_server, refs, protocol):
    mod = client_module(protocol)
    reqs = _bench_requests(refs)
    client = protocol_client(nd_server, protocol)
    try:
        outcomes: dict[int, tuple[Any, Any]] = {}
        if protocol == "http":
            futures = [client.async_infer("tensorrt_llm", _bench_inputs(mod, r), request_id=str(i))
                       for i, r in enumerate(reqs)]
            for i, f in enumerate(futures):
                try:
                    outcomes[i] = (f.get_result(), None)
                except mod.InferenceServerException as e:  # noqa: PERF203
                    outcomes[i] = (None, e)
        else:
            got: queue.Queue = queue.Queue()
            for i, r in enumerate(reqs):
                client.async_infer("tensorrt_llm", _bench_inputs(mod, r),
                                   callback=partial(lambda i, result, error: got.put((i, result, error)), i),
                                   request_id=str(i))
            for _ in reqs:
                i, result, error = got.get(timeout=STREAM_TIMEOUT)
                outcomes[i] = (result, error)
        assert sorted(outcomes) == list(range(len(reqs)))
        for i, req in enumerate(reqs):
            result, error = outcomes[i]
            if req["ref"] is None:
                assert result is None and error is not None, f"request {i}: random ids were accepted"
                assert "vocabulary" in str(error), f"request {i}: {error}"
                continue
            assert error is None, f"request {i}: {error}"
            if protocol == "http":
                resp = result.get_response()
                assert resp["id"] == str(i), resp.get("id")
                name0, shape0 = resp["outputs"][0]["name"], [int(d) for d in resp["outputs"][0]["shape"]]
            else:
                assert result.get_response().id == str(i)
                resp = result.get_response(as_json=True)
                assert resp["id"] == str(i)
                name0, shape0 = resp["outputs"][0]["name"], [int(d) for d in resp["outputs"][0]["shape"]]
            _check_bench_success(req, name0, shape0, result.as_numpy("output_ids"))
        # the server keeps serving: the warm-up request (request_output_len shortened)
        res = client.infer("tensorrt_llm", _bench_inputs(mod, reqs[0]))
        assert res.as_numpy("output_ids")[0, 0].tolist() == reqs[0]["ref"].prompt_ids + reqs[0]["ref"].ids
    finally:
        client.close()


