"""The ``bls`` model's logic: the ensemble's pipeline written as business-logic scripting.

Tokenization and detokenization run in-process (the same functions the preprocessing and
postprocessing models use); only the engine is a separate model, called with
``exec(decoupled=True)`` so its responses stream back as they are produced. Each request runs on a
worker thread because a decoupled ``execute()`` must return at once.
"""
from __future__ import annotations

import itertools
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from backend.serving.acceptance import ACCEPTANCE_OUTPUTS
from backend.serving.convert import InvalidRequest
from backend.serving.postprocess import postprocess
from backend.serving.preprocess import TEXT_INPUT_NAMES, Preprocessor

__all__ = ["BlsHost", "MAX_IN_FLIGHT"]

MAX_IN_FLIGHT = 512  # worker threads: one per request being streamed (they mostly wait)
_ENGINE_OUTPUTS = ["output_ids", "context_ids", "text_trim", "output_log_probs", "finish_reason"]


def _ids(resp_tensor) -> list[int]:
    return [] if resp_tensor is None else resp_tensor.as_numpy().reshape(-1).tolist()


class BlsHost:
    def __init__(self, pb: Any, engine_dir: str, engine_model: str):
        self.pb = pb
        self.pre = Preprocessor(engine_dir)
        self.tok = self.pre.tokenizer
        self.engine_model = engine_model
        self.pool = ThreadPoolExecutor(max_workers=MAX_IN_FLIGHT, thread_name_prefix="kiln-bls")
        self._ids = itertools.count()

    def execute(self, requests: list) -> None:
        for request in requests:
            self.pool.submit(self._run, request)

    def _final_error(self, sender, message: str) -> None:
        pb = self.pb
        sender.send(pb.InferenceResponse(output_tensors=[], error=pb.TritonError(message)),
                    flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _run(self, request) -> None:
        pb = self.pb
        sender = request.get_response_sender()
        try:
            tensors = {n: t.as_numpy() for n in TEXT_INPUT_NAMES
                       if (t := pb.get_input_tensor_by_name(request, n)) is not None}
            prep = self.pre.prepare(tensors)
        except InvalidRequest as e:
            self._final_error(sender, str(e))
            return
        except Exception as e:  # noqa: BLE001 - a bug must still end the request with one final
            self._final_error(sender, f"bls: {type(e).__name__}: {e}")
            return
        inner_id = f"bls-{os.getpid()}-{next(self._ids)}"
        wanted = _ENGINE_OUTPUTS + (list(ACCEPTANCE_OUTPUTS) if prep.values["return_perf_metrics"] else [])
        inner = pb.InferenceRequest(
            model_name=self.engine_model, requested_output_names=wanted, request_id=inner_id,
            inputs=[pb.Tensor(k, v) for k, v in prep.engine_tensors().items()])
        echo, sent_final = prep.echo_text, False
        try:
            for resp in inner.exec(decoupled=True):
                if sent_final:
                    continue  # drain whatever the engine still sends after its final
                if request.is_cancelled():  # the client went away: stop the engine, free its blocks
                    self._stop_engine(inner_id)
                    sent_final = True
                    try:
                        self._final_error(sender, "request cancelled")
                    except Exception:  # noqa: BLE001
                        pass
                    continue
                if resp.has_error():
                    self._final_error(sender, resp.error().message())
                    sent_final = True
                    continue
                get = lambda n: pb.get_output_tensor_by_name(resp, n)  # noqa: E731
                if get("output_ids") is None:  # a flags-only final from the engine
                    continue
                trim = int(get("text_trim").as_numpy().reshape(-1)[0])
                text = postprocess(self.tok, _ids(get("output_ids")), _ids(get("context_ids")), trim, echo)
                echo = ""
                reason = get("finish_reason").as_numpy().reshape(-1)[0]
                final = bool(reason)  # the engine fills finish_reason only on its last response
                lp = get("output_log_probs").as_numpy().astype(np.float32).reshape(-1)
                out = [pb.Tensor("text_output", np.array([text.encode("utf-8")], dtype=object)),
                       pb.Tensor("output_log_probs", lp)]
                # present exactly when the client set return_perf_metrics (the engine adds them then)
                out += [pb.Tensor(n, t.as_numpy()) for n in ACCEPTANCE_OUTPUTS if (t := get(n)) is not None]
                sender.send(pb.InferenceResponse(output_tensors=out),
                            flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0)
                sent_final = final
            if not sent_final:
                sender.send(flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception as e:  # noqa: BLE001
            if not sent_final:
                try:
                    self._final_error(sender, f"bls: {type(e).__name__}: {e}")
                except Exception:  # noqa: BLE001 - client gone
                    pass

    def _stop_engine(self, inner_id: str) -> None:
        pb = self.pb
        stop = pb.InferenceRequest(model_name=self.engine_model, requested_output_names=[], request_id=inner_id,
                                   inputs=[pb.Tensor("stop_request", np.array([True]))])
        for _ in stop.exec(decoupled=True):
            pass

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
