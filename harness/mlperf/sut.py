"""LoadGen system under test: the Triton server's `engine` model over gRPC streaming.

Each query becomes one decoupled streaming request of token ids. The first streamed token is
reported with `lg.FirstTokenComplete` (TTFT), and the final response with
`lg.QuerySamplesComplete` carrying every output token and `n_tokens` (TPOT, tokens/s, accuracy).
Requests are spread round-robin over several gRPC connections (one bidirectional stream each, so
one slow stream does not hold up the others) and sent from a small thread pool so LoadGen's issue
thread never blocks on the network: in Offline it hands over every sample in a single call.
"""
from __future__ import annotations

import itertools
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from harness.mlperf.datasets import Sample
from harness.model_names import DEFAULT

log = logging.getLogger(__name__)

# Triton config data_type -> numpy dtype for the inputs we may send.
_NP = {"TYPE_INT32": np.int32, "TYPE_INT64": np.int64, "TYPE_UINT64": np.uint64,
       "TYPE_FP32": np.float32, "TYPE_BOOL": np.bool_}
OUTPUT_DTYPE = np.int32  # token ids in mlperf_log_accuracy.json; TEST06 and accuracy read int32


@dataclass
class _Pending:
    query_id: int
    sample_index: int
    tokens: list[int] = field(default_factory=list)
    first_sent: bool = False


class TritonSUT:
    """Construct, then pass `issue_queries` / `flush_queries` to `lg.ConstructSUT`.

    `samples` is the QSL's list (index = LoadGen sample index). Generation is greedy with at most
    `max_output_tokens` new tokens, matching the MLPerf reference implementations.
    """

    def __init__(self, url: str, samples: list[Sample], *, max_output_tokens: int,
                 min_output_tokens: int = 1, model_name: str = DEFAULT.engine, num_clients: int = 4,
                 num_workers: int = 4, timeout_s: float = 600.0):
        import tritonclient.grpc as grpcclient

        self._grpc = grpcclient
        self.url, self.model_name, self.samples = url, model_name, samples
        self.max_output_tokens, self.min_output_tokens = max_output_tokens, min_output_tokens
        self.timeout_s = timeout_s
        self._pending: dict[str, _Pending] = {}
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self.errors: list[str] = []
        self.completed = 0
        self._closing = False
        self._ids = itertools.count()
        self._clients = [grpcclient.InferenceServerClient(url) for _ in range(num_clients)]
        cfg = self._clients[0].get_model_config(model_name, as_json=True)["config"]
        self._batched = int(cfg.get("max_batch_size", 0)) > 0
        self._inputs = {i["name"]: i for i in cfg["input"]}
        for name in ("input_ids", "input_lengths", "request_output_len"):
            if name not in self._inputs:
                raise RuntimeError(f"model {model_name!r} at {url} has no input {name!r}: "
                                   f"the SUT needs the engine model of docs/contracts.md section 6")
        for c in self._clients:
            c.start_stream(callback=self._on_response)
        self._next_client = itertools.cycle(range(num_clients))
        self._pool = ThreadPoolExecutor(max_workers=num_workers, thread_name_prefix="sut-issue")

    # ---- request building -------------------------------------------------------------------
    def _tensor(self, name: str, value) -> object:
        spec = self._inputs[name]
        arr = np.asarray(value, dtype=_NP[spec["data_type"]])
        if arr.ndim == 0:
            arr = arr.reshape(1)
        if self._batched:
            arr = arr[None, ...]
        t = self._grpc.InferInput(name, list(arr.shape), spec["data_type"].removeprefix("TYPE_"))
        t.set_data_from_numpy(arr)
        return t

    def _request_inputs(self, sample: Sample) -> list:
        ids = np.asarray(sample.input_ids, dtype=np.int32)
        inputs = [self._tensor("input_ids", ids), self._tensor("input_lengths", len(ids)),
                  self._tensor("request_output_len", self.max_output_tokens)]
        # Optional controls, sent only when the model declares them: greedy decoding and
        # token-by-token streaming are what MLPerf's reference SUTs use.
        optional = {"temperature": 0.0, "streaming": True, "stream": True,
                    "min_tokens": self.min_output_tokens, "min_length": self.min_output_tokens}
        inputs += [self._tensor(k, v) for k, v in optional.items() if k in self._inputs]
        return inputs

    # ---- LoadGen callbacks ------------------------------------------------------------------
    def issue_queries(self, query_samples) -> None:
        for qs in query_samples:
            self._pool.submit(self._send, qs.id, qs.index)

    def flush_queries(self) -> None:
        pass

    def _send(self, query_id: int, sample_index: int) -> None:
        rid = str(next(self._ids))
        with self._lock:
            self._pending[rid] = _Pending(query_id, sample_index)
        try:
            client = self._clients[next(self._next_client)]
            client.async_stream_infer(self.model_name, self._request_inputs(self.samples[sample_index]),
                                      request_id=rid, enable_empty_final_response=True)
        except Exception as e:  # a failed send must still complete the query, or LoadGen hangs
            self._fail(rid, f"send failed: {e}")

    def _on_response(self, result, error) -> None:
        import mlperf_loadgen as lg

        if error is not None:
            if self._closing:  # stop_stream() ends each stream with UNAVAILABLE: not a failure
                return
            # tritonclient does not tell which request an error response belongs to; with no way
            # to attribute it, every pending query is completed and the run is reported failed
            self._fail(None, str(error))
            return
        resp = result.get_response()
        rid = resp.id
        out = result.as_numpy("output_ids")
        final = resp.parameters["triton_final_response"].bool_param if "triton_final_response" in resp.parameters else False
        with self._lock:
            p = self._pending.get(rid)
        if p is None:
            return
        if out is not None and out.size:
            new = out.reshape(-1).tolist()
            p.tokens.extend(new)
            if not p.first_sent:
                p.first_sent = True
                first = np.asarray(new[:1], dtype=OUTPUT_DTYPE)
                lg.FirstTokenComplete([lg.QuerySampleResponse(p.query_id, first.ctypes.data, first.nbytes)])
        if final:
            self._complete(rid)

    def _complete(self, rid: str) -> None:
        import mlperf_loadgen as lg

        with self._lock:
            p = self._pending.pop(rid, None)
        if p is None:
            return
        data = np.asarray(p.tokens, dtype=OUTPUT_DTYPE)
        lg.QuerySamplesComplete([lg.QuerySampleResponse(p.query_id, data.ctypes.data, data.nbytes, len(data))])
        with self._lock:
            self.completed += 1
            self._idle.notify_all()

    def _fail(self, rid: str | None, message: str) -> None:
        log.error("request %s failed: %s", rid, message)
        with self._lock:
            self.errors.append(f"request {rid}: {message}")
            rids = [rid] if rid in self._pending else ([] if rid else list(self._pending))
        for r in rids:  # complete with what we have so LoadGen can finish and report the run
            self._complete(r)

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        with self._lock:
            return self._idle.wait_for(lambda: not self._pending, timeout_s or self.timeout_s)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._closing = True
        for c in self._clients:
            try:
                c.stop_stream()
            finally:
                c.close()


class SampleLibrary:
    """LoadGen QSL over samples already in memory (token ids are small): load/unload are no-ops."""

    def __init__(self, samples: list[Sample], performance_count: int):
        self.samples = samples
        self.performance_count = min(performance_count, len(samples))

    def construct(self):
        import mlperf_loadgen as lg

        return lg.ConstructQSL(len(self.samples), self.performance_count, lambda idx: None, lambda idx: None)
