"""The ``bls`` model's logic: the ensemble's pipeline written as business-logic scripting.

Tokenization runs in-process (the function the preprocessing model uses) and the text is the
engine's own (``output_text``, decoded once there); only the engine is a separate model, called with
``exec(decoupled=True)`` so its responses stream back as they are produced. Each request runs on a
thread of its own because a decoupled ``execute()`` must return at once; the thread ends with the
request, so an idle stub is back to its idle thread count.

Rules that keep Triton 24.10's Python backend safe under cancellation (breaking them crashed the
server or this model's stub within ~150 cancelled streams, or left a thread blocked for ever per
cancelled stream):
* ``execute()`` reads (copies) the inputs and takes the response sender; the thread uses only those
  and ``request.is_cancelled()``: once ``execute()`` returned, Triton releases the request and
  reuses the shared memory its input tensors were in (a late reader saw other requests' bytes).
* The engine never ends an inner request with an error response: its requests carry the
  ``kiln_inband_errors`` parameter, so errors arrive in a final DATA response (``finish_reason``
  "error: ..."). The Python backend drops an error response that reaches an ``exec(decoupled=True)``
  iterator after its first response: the iterator then never ends, its thread blocks for ever and
  the server cannot unload the models at shutdown.
* The inner iterator is always read to its end (the engine's FINAL), and kept for ``GRACE_S``
  afterwards so that this model's threads, holding the GIL, release it (see ``GRACE_S``).
* When the client goes away (``request.is_cancelled()``, checked before every send), the engine is
  told to stop the inner request (a ``stop_request`` with its id): it then ends the iterator with a
  final response (finish_reason "cancelled") within one engine step instead of after
  ``max_tokens``, and the thread returns.
* The client's response sender is used by this request's thread only, never after its FINAL flag,
  and after a cancellation only for the FINAL flag itself (Triton requires it).
* Metric updates go through ``backend.serving.metrics.metrics``' lock: the Python backend keeps a metric's
  pending operation in the metric object and sends it with the GIL released, so two threads
  updating one metric at once race (the first storm after adding bls's counters crashed the server).
* Inner request ids are unguessable (``secrets``): the engine honours a ``stop_request`` only for
  such ids, so no other client can stop a bls request.
* Shutdown needs nothing more here: Triton calls ``finalize()`` only once no request holds this
  model, and it does not count bls streams as in flight, so it goes on to unload the models while
  they run. The engine ends every inner request itself when it should stop serving (the harness's
  drain before its SIGTERM: backend/serving/engine_model/serving_state.py) with an in-band "error: the server is
  shutting down ...", which ``_relay`` sends to the client as its final error; the thread has read
  its iterator to the end and returns, and Triton can unload this model. No stop_request is needed
  (one sent after Triton began unloading the engine is refused by Triton).
"""
from __future__ import annotations

import collections
import secrets
import threading
import time
from typing import Any

import numpy as np

from backend.logs import get_logger
from backend.serving.metrics.acceptance import ACCEPTANCE_OUTPUTS
from backend.serving.conversion.batching import rows, stack_rows
from backend.serving.metrics.perf_metrics import PERF_OUTPUTS
from backend.serving.conversion.convert import InvalidRequest
from backend.serving.engine_model.engine_host import INBAND_ERRORS
from backend.serving.engine_model.engine_outputs import requested_outputs
from backend.serving.metrics.metrics import RequestErrors
from backend.serving.text_models.postprocess import engine_text
from backend.serving.text_models.preprocess import TEXT_MODEL_INPUTS, Preprocessor

__all__ = ["BlsHost", "MAX_IN_FLIGHT", "new_inner_id"]

_LOG = get_logger("serving.bls")

MAX_IN_FLIGHT = 512  # requests streamed at once (one thread each; they mostly wait)
_ENGINE_OUTPUTS = ["output_ids", "output_text", "output_log_probs", "cum_log_probs", "finish_reason"]
# return_perf_metrics: every perf output of the engine, passed through as tensorrtllm_backend's bls does
_PERF = list(ACCEPTANCE_OUTPUTS) + list(PERF_OUTPUTS)
# return_context_logits / return_generation_logits: asked of the engine and passed through only then
_LOGITS = ["context_logits", "generation_logits"]
# return_num_input_tokens / return_num_output_tokens: the engine's counts, only then
_COUNTS = ["num_input_tokens", "num_output_tokens"]
_JOIN_S = 2.0        # finalize: how long to wait for request threads still running
# A finished engine iterator is released by this model's threads no sooner than this after its end.
# It holds the engine's responses (their tensors own NumPy arrays); the stub also keeps it in a map
# until a helper thread of its own processes the iterator's cleanup. If that map held the last
# reference, the helper thread would destroy the tensors without the GIL (Triton 24.10's PbTensor
# destructor does not take it) and corrupt the Python heap: the bls stub then crashed at random under
# a cancellation storm. The cleanup is one IPC round trip queued at the iterator's end (well under a
# second even on a saturated 2-core machine), so 5 s leaves a wide margin.
GRACE_S = 5.0
_SHUTDOWN_GRACE_S = 0.5  # the same at finalize, when nothing else is queued


def new_inner_id() -> str:
    """The request id of an inner engine request: 128 random bits, so only this model can name it
    in a stop_request (the engine refuses stops of short, guessable ids)."""
    return f"bls-{secrets.token_hex(16)}"


class _Reply:
    """The client side of one bls request: its response sender, used by one thread, never after
    the FINAL flag (every method is a no-op once ``open`` is false). A failed send means the client
    went away."""

    def __init__(self, pb: Any, request: Any):
        self.pb = pb
        self.sender = request.get_response_sender()
        self.wanted = requested_outputs(request)
        self.open = True
        self.gone = False

    def send(self, tensors: list, final: bool) -> None:
        if not self.open:
            return
        flags = self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
        self.open = not final  # the flag counts as sent even if the send fails: never send again
        if self.wanted is not None:  # dropped here, with the GIL held (engine_outputs.requested_outputs)
            tensors = [t for t in tensors if t.name() in self.wanted]
        try:
            self.sender.send(self.pb.InferenceResponse(output_tensors=tensors), flags=flags)
        except Exception:  # noqa: BLE001 - the client went away
            self.gone = True

    def error(self, message: str) -> None:
        if not self.open:
            return
        self.open = False
        try:
            self.sender.send(self.pb.InferenceResponse(output_tensors=[], error=self.pb.TritonError(message)),
                             flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception:  # noqa: BLE001 - the client went away
            self.gone = True

    def close(self) -> None:
        """The FINAL flag alone (a cancelled request still needs it, nothing else)."""
        if not self.open:
            return
        self.open = False
        try:
            self.sender.send(flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception:  # noqa: BLE001 - the client went away
            self.gone = True


class BlsHost:
    def __init__(self, pb: Any, engine_dir: str, engine_model: str, *, model_name: str = "tensorrt_llm_bls",
                 instance: str = "0", decoupled: bool = True):
        self.pb = pb
        self.model_name = model_name
        # serving.decoupled: the engine model has the same transaction policy as this one; a
        # non-decoupled engine answers exec() with one response (its model.py refuses streaming)
        self.decoupled = decoupled
        self.pre = Preprocessor(engine_dir)
        self.tok = self.pre.tokenizer
        self.engine_model = engine_model
        self.errors = RequestErrors(pb, model_name, instance)
        self._slots = threading.BoundedSemaphore(MAX_IN_FLIGHT)
        self._threads: set[threading.Thread] = set()
        self._lock = threading.Lock()
        self._closing = False
        self._graveyard: collections.deque = collections.deque()  # (release time, engine iterator)

    def execute(self, requests: list) -> None:
        for request in requests:
            refused = "the bls model is shutting down" if self._closing else None
            if refused is None and not self._slots.acquire(blocking=False):
                refused = f"the bls model has {MAX_IN_FLIGHT} requests in flight; retry later"
            if refused is not None:
                self.errors.count("unavailable")
                _Reply(self.pb, request).error(refused)
                continue
            # the inputs are read here, copied: after execute() returns Triton releases the request
            # and the shared memory its tensors live in is reused (a thread reading them later saw
            # other requests' bytes)
            try:
                tensors = {n: np.array(t.as_numpy(), copy=True) for n in TEXT_MODEL_INPUTS
                           if (t := self.pb.get_input_tensor_by_name(request, n)) is not None}
            except Exception as e:  # noqa: BLE001 - a request that cannot be read still gets its final
                self._slots.release()
                self.errors.count("internal")
                _Reply(self.pb, request).error(f"bls: {type(e).__name__}: {e}")
                continue
            t = threading.Thread(target=self._thread, args=(request, _Reply(self.pb, request), tensors),
                                 name="kiln-bls", daemon=True)
            with self._lock:
                self._threads.add(t)
            t.start()

    def _thread(self, request, out: _Reply, tensors: dict) -> None:
        try:
            self._run(request, out, tensors)
        except Exception:  # noqa: BLE001 - _run ends its request itself; this only logs a bug
            _LOG.exception("bls request thread failed")
        finally:
            self._bury()
            with self._lock:
                self._threads.discard(threading.current_thread())
            self._slots.release()

    def _bury(self, *iterators) -> None:
        """Keep finished engine iterators for GRACE_S (see there); release the ones kept longer, here,
        in a Python thread holding the GIL."""
        now = time.monotonic()
        expired = []
        with self._lock:
            self._graveyard.extend((now + GRACE_S, it) for it in iterators)
            while self._graveyard and self._graveyard[0][0] <= now:
                expired.append(self._graveyard.popleft())
        del expired

    def _run(self, request, out: _Reply, tensors: dict) -> None:
        pb = self.pb
        try:
            # one prepared request per row (NVIDIA's --batch-inputs); the engine answers row by row
            preps = [self.pre.prepare(r) for r in rows(tensors, self.model_name)]
        except InvalidRequest as e:
            self.errors.count("invalid_request")
            out.error(str(e))
            return
        except Exception as e:  # noqa: BLE001 - a bug must still end the request with one final
            _LOG.exception("bls: preprocessing failed")
            self.errors.count("internal")
            out.error(f"bls: {type(e).__name__}: {e}")
            return
        inner_id = new_inner_id()
        batch = len(preps)
        wanted = (_ENGINE_OUTPUTS + (["batch_index"] if batch > 1 else [])
                  + (_PERF if any(p.values["return_perf_metrics"] for p in preps) else [])
                  + [n for n in _LOGITS + _COUNTS if any(p.values["return_" + n] for p in preps)])
        engine_inputs = stack_rows([p.engine_tensors() for p in preps],
                                   {"input_ids": 0, "stop_words_list": -1, "bad_words_list": -1})
        for flag in ("return_" + n for n in _COUNTS):  # bls-only: not among the preprocessing outputs
            engine_inputs[flag] = np.array([[p.values[flag]] for p in preps], dtype=bool)
        inner = pb.InferenceRequest(
            model_name=self.engine_model, requested_output_names=wanted, request_id=inner_id,
            inputs=[pb.Tensor(k, v) for k, v in engine_inputs.items()],
            parameters={INBAND_ERRORS: True})
        try:
            responses = inner.exec(decoupled=True) if self.decoupled else [inner.exec()]
        except Exception as e:  # noqa: BLE001 - e.g. the engine model is not ready
            _LOG.warning("bls: engine request %s failed: %s", inner_id, e)
            self.errors.count("engine")
            out.error(f"bls: {type(e).__name__}: {e}")
            return
        state = {"stopped": False, "stops": [], "rows_left": batch}
        try:
            # read to the end in every case: the engine's FINAL releases the inner request's state
            for resp in responses:
                self._relay(request, out, resp, inner_id, state)
        except Exception as e:  # noqa: BLE001 - a bug: end the request, stop the engine, still drain
            _LOG.exception("bls: relaying engine request %s failed", inner_id)
            self.errors.count("internal")
            out.error(f"bls: {type(e).__name__}: {e}")
            if not state["stopped"]:
                state["stops"].append(self._stop_engine(inner_id))
            try:
                for _ in responses:
                    pass
            except Exception:  # noqa: BLE001 - nothing more can be done for it
                pass
        out.close()  # the engine ended without a final data response: the FINAL flag still goes out
        self._bury(responses, *state["stops"])

    def _relay(self, request, out: _Reply, resp, inner_id: str, state: dict) -> None:
        """One engine response -> at most one response to the client."""
        pb = self.pb
        if not out.open:
            return  # answered (or cancelled): only waiting for the engine's final
        if not state["stopped"] and (out.gone or request.is_cancelled()):
            # the client went away: stop the engine (frees its blocks, ends the iterator within a
            # step), give Triton the FINAL flag it needs and send nothing else
            state["stopped"] = True
            self.errors.count("cancelled")
            out.close()
            state["stops"].append(self._stop_engine(inner_id))
            return
        if resp.has_error():  # only a first response can be one (errors come in-band after it)
            self.errors.count("engine")
            out.error(resp.error().message())
            return
        get = lambda n: pb.get_output_tensor_by_name(resp, n)  # noqa: E731
        if get("output_ids") is None:  # a flags-only final from the engine
            return
        reason = get("finish_reason").as_numpy().reshape(-1)[0]
        reason = reason.decode("utf-8", "replace") if isinstance(reason, bytes) else str(reason)
        if reason.startswith("error: "):
            self.errors.count("engine")
            out.error(reason[len("error: "):])
            return
        if reason == "cancelled":  # stopped inside the engine (e.g. its shutdown): not a normal end
            self.errors.count("cancelled")
            out.error("request cancelled")
            return
        # the engine's text (decoded once, there); non-streamed it holds the prompt's text too unless
        # exclude_input_in_output, as output_ids does (engine_outputs.py)
        text = engine_text(get("output_text").as_numpy())
        # 1-D, one string per beam, as NVIDIA's postprocessing (its clients read output[0] as the text)
        tensors = [pb.Tensor("text_output", np.array([text.encode("utf-8")], dtype=object)),
                   pb.Tensor("output_log_probs", get("output_log_probs").as_numpy().astype(np.float32)),
                   pb.Tensor("cum_log_probs", get("cum_log_probs").as_numpy().astype(np.float32))]
        # present exactly when the client set return_perf_metrics (the engine adds them then)
        tensors += [pb.Tensor(n, t.as_numpy()) for n in _PERF + _LOGITS + _COUNTS if (t := get(n)) is not None]
        if reason:  # the engine fills finish_reason only on a row's last response
            state["rows_left"] -= 1
        if (b := get("batch_index")) is not None:  # a request of several rows: say which one
            tensors.append(pb.Tensor("batch_index", b.as_numpy()))
        out.send(tensors, final=state["rows_left"] == 0)

    def _stop_engine(self, inner_id: str):
        """tensorrtllm_backend's stop: the engine stops the request with this id and answers with a
        FINAL flag; the stopped request then sends its own final (finish_reason "cancelled").
        Returns the stop's iterator (for ``_bury``), or None."""
        pb = self.pb
        if not self.decoupled:  # a non-decoupled engine has no stop request; the request runs to its end
            return None
        stop = pb.InferenceRequest(model_name=self.engine_model, requested_output_names=[], request_id=inner_id,
                                   inputs=[pb.Tensor("stop_request", np.array([[True]]))])
        try:
            responses = stop.exec(decoupled=True)
            for resp in responses:
                if resp.has_error():
                    _LOG.warning("bls: stopping engine request %s: %s", inner_id, resp.error().message())
            return responses
        except Exception as e:  # noqa: BLE001 - the engine then runs it to its end: slower, still ends
            _LOG.warning("bls: could not stop engine request %s: %s", inner_id, e)
            return None

    def num_active(self) -> int:
        with self._lock:
            return len(self._threads)

    def shutdown(self) -> None:
        """Refuse new requests and give running ones a moment (Triton unloads a model once no
        request holds it, so normally none is left)."""
        self._closing = True
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            t.join(_JOIN_S / max(1, len(threads)))
        # Triton unloads a model once no request holds it: the stub's helper thread has only the
        # last iterators' cleanups left, a few IPC round trips; then release them here, with the GIL
        with self._lock:
            recent = bool(self._graveyard) and self._graveyard[-1][0] - GRACE_S > time.monotonic() - _SHUTDOWN_GRACE_S
        if recent:
            time.sleep(_SHUTDOWN_GRACE_S)
        with self._lock:
            self._graveyard.clear()
        self.errors.close()  # now, not while the stub's interpreter shuts down (segfaults there)
