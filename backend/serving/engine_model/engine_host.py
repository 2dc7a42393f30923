"""The engine model's logic: a Kiln executor behind Triton's decoupled Python backend.

Rules (the serving contract):
* ``execute()`` only converts and enqueues; it never waits for tokens.
* The executor's callback thread computes each response's outputs; one responder thread
  (``responder.py``, ``serving.response_thread``) makes the response and sends it, in the order
  queued, so the loop never waits for a send's round trip to the server (47% of its time with a
  model that costs almost nothing: ``docs/perf/serving-ceiling-profile.json``); a stream's tokens that
  come while its previous response still waits join it (``serving.coalesce_responses``). Exactly one
  thread makes, sends and drops responses' Python-backend objects: responses made on the loop and sent
  by a responder aborted Triton 24.10's stub (boost ``lock_exception``, 739280e..a81b105); four sending
  threads, and later joined responses, corrupted its heap ("malloc(): unaligned fastbin chunk"), the
  latter through ``send()`` freeing unrequested outputs without the GIL (``engine_outputs.requested_outputs``).
* Every request gets exactly one FINAL response: the last data response carries the FINAL flag; a
  bad request, an executor error or a cancellation by its client gets an error response with the
  FINAL flag. A request stopped by a ``stop_request`` ends like tensorrtllm_backend's: a normal
  final response (what was generated so far) with ``finish_reason`` "cancelled".
* A request whose parameters hold ``kiln_inband_errors: true`` (the bls model's) never gets an
  error response: its errors come as a final data response with ``finish_reason`` "error: <message>".
  Triton 24.10's Python backend drops an error response that reaches an ``exec(decoupled=True)``
  iterator after its first response, so the caller would wait for ever (one blocked thread per
  such request, and a server that cannot unload the models at shutdown).
* A poller thread checks ``request.is_cancelled()`` (client closed the stream or cancelled) and
  cancels the request in the executor, which frees its KV blocks. A send that fails (client gone)
  cancels too.
  Neither happens for an ``ensemble`` step on Triton 24.10 (measured: ``is_cancelled()`` of the
  request and of the response sender stay false and ``send()`` keeps succeeding after the
  ensemble's client went away), so ensemble clients stop by id (below; tests/serving/test_ensemble_cancel.py).
* A ``stop_request`` (tensorrtllm_backend's control request) stops the running requests with the same
  Triton request id, but only an id of at least ``MIN_STOP_ID_LEN`` characters: a short id is
  guessable, so anyone could stop someone else's request. Clients that stop by id start the request
  with an unguessable id (a UUID); closing the stream cancels a request for everyone.
* Shutdown: Triton tells a model nothing until finalize(), which comes only once no request holds
  it, and waits at most --exit-timeout-secs for that (then exits 1 and crashes on the way out). So
  the poller watches ``serving_state`` (the harness's drain request before its SIGTERM): once the
  engine should stop, new requests are refused and every running one ends at once, with an error if nothing was sent yet or it is bls's (in-band), else like a stop (a normal
  final, finish_reason "cancelled"): Triton 24.10's ensemble never releases a request whose
  decoupled step sends an error while a later step (postprocessing) is still running, and that
  request would hold the server for the whole exit timeout. bls's and the ensemble's requests end
  with their engine requests.
"""
from __future__ import annotations

import itertools
import os
import threading
import time
from functools import partial
from typing import Any, Callable

from backend.bundle import load_bundle
from backend.logs import for_request, get_logger
from backend.serving.metrics.acceptance import draft_counts
from backend.serving.conversion.convert import EngineLimits, InvalidRequest
from backend.serving.conversion.detok import CONTEXT_TOKENS, StreamDetokenizer
from backend.serving.engine_model.engine_outputs import (error_response, make_response, merge_outputs, requested_outputs,
                                            send_empty_final, send_error)
from backend.serving.engine_model.engine_stream import INBAND_ERRORS, Stream, chosen_logprobs, inband_errors
from backend.serving.engine_model.row_group import RowGroup
from backend.serving.engine_model.engine_request import is_stop_request, parse_engine_request, request_rows
from backend.serving.metrics.metrics import ServingMetrics
from backend.serving.engine_model.responder import Responder
from backend.serving.engine_model.serving_state import ServingState
from backend.serving.engine_model.settings import DEFAULTS, ServingSettings
from backend.serving.conversion.tokenizer import load_tokenizer

__all__ = ["EngineHost", "INBAND_ERRORS", "MIN_STOP_ID_LEN", "chosen_logprobs"]

_LOG = get_logger("serving.engine")

POLL_S = 0.5           # cancellation check period: each check is an IPC round trip per request,
                       # which at 64 streams on 2 cores costs more than a late cancel
STATS_EVERY_S = 0.5    # gauge refresh period while requests run (each one also refreshes them
                       # just before its final response)
MIN_STOP_ID_LEN = 16   # a stop_request may name only a request id at least this long (a UUID is 36)


class EngineHost:
    def __init__(self, pb: Any, engine_dir: str, *, device: str = "cpu", settings: ServingSettings = DEFAULTS,
                 model_name: str = "engine", instance: str = "0", version: str = "1",
                 nv_instance: str | None = None,
                 executor_factory: Callable[..., Any] | None = None,
                 on_fatal: Callable[[str], None] | None = None, decoupled: bool = True):
        """``device``: where the executor runs (``auto``: the GPU when there is one). ``settings``
        (``settings.py``): ``step_timeout_s`` > 0: a step running longer counts as a hung engine;
        ``stream_interval``; ``response_thread``, ``coalesce_responses``: the responder's
        (``responder.py``). When the engine fails (its loop thread died, or a step hung) every
        in-flight request gets a final error, new ones are refused, and ``on_fatal(reason)`` runs
        (the Triton model exits its stub)."""
        self.pb = pb
        # a request with batch size B > 1 is answered row by row: only a decoupled model may
        self.decoupled = decoupled
        self.step_timeout_s = settings.step_timeout_s
        self.on_fatal = on_fatal
        self.failed: str | None = None
        bundle = load_bundle(engine_dir)  # engine.json read once: format, fields, files and their sha256
        self.limits = EngineLimits.from_engine(bundle.engine)
        self.vocab_size = bundle.model.vocab_size
        self.end_ids = tuple(bundle.model.eos_token_ids)   # never in a text, special tokens kept or not
        self.tok = load_tokenizer(engine_dir)
        self.interval = settings.stream_interval
        if device == "auto":  # the rendered default: the GPU when there is one
            import torch
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if executor_factory is None:
            from backend.engine.executor import Executor as executor_factory  # noqa: N813 (heavy: torch)
        self.executor = executor_factory(bundle, device=device)  # the checked bundle: not read again
        from backend.engine.sampling_params import SamplingParams
        self._params = SamplingParams
        # nv_trt_llm_* beside kiln_*: labelled with the model's version (and nv_instance, when the
        # model runs several instances, so their executors' series stay apart)
        self.model_name = model_name
        self.metrics = ServingMetrics(pb, model_name, instance, version=version, nv_instance=nv_instance)
        runner = getattr(self.executor, "runner", None)
        choice = runner.dtype_choice if runner is not None else None
        if choice is not None:   # what this engine computes in and why (a stand-in executor has none)
            self.metrics.compute_dtype(choice.as_dict())
        self._metrics_lock = threading.Lock()
        self._ids = itertools.count()
        self._prefix = f"{model_name}-{instance}-{os.getpid()}-"
        self._active: dict[str, Stream] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.responder = Responder(settings.response_thread, coalesce=settings.coalesce_responses)
        self.serving = ServingState(model_name)
        self.draining: str | None = None  # set for good once the engine should stop serving (serving_state)
        self.refresh_metrics()  # the pool's size etc. from the start, not from the first poll
        self._poller = threading.Thread(target=self._poll, name="kiln-engine-poller", daemon=True)
        self._poller.start()

    # ---- execute: convert and enqueue only -----------------------------------------------------
    def execute(self, requests: list) -> None:
        for request in requests:
            try:
                self._enqueue(request)
            except Exception as e:  # noqa: BLE001 - a bug here must still end the request, not the model
                for_request(_LOG, request.request_id() or "-").exception("could not enqueue the request")
                self.metrics.errors.count("internal")
                self._send_error(request.get_response_sender(), f"engine: {type(e).__name__}: {e}",
                                 inband_errors(request), request)

    def _enqueue(self, request) -> None:
        sender = request.get_response_sender()
        if is_stop_request(self.pb, request):
            self._stop_request(request.request_id(), sender)
            return
        inband = inband_errors(request)
        if self.failed is not None or self.draining is not None:
            self.metrics.errors.count("unavailable")
            self._send_error(sender, f"engine unavailable: {self.failed or self.draining}", inband, request)
            return
        try:
            reqs = [parse_engine_request(r, self.limits, self.vocab_size, self.tok)
                    for r in request_rows(self.pb, request, self.model_name, self.decoupled)]
            params = [self._params(**r.sampling) for r in reqs]
        except (InvalidRequest, ValueError, TypeError) as e:
            self.metrics.errors.count("invalid_request")
            self._send_error(sender, str(e), inband, request)
            return
        # every row is checked before any starts: a bad row refuses the whole request
        group = RowGroup(len(reqs)) if len(reqs) > 1 else None
        for i, (req, p) in enumerate(zip(reqs, params)):
            self._start(request, sender, req, p, inband, group, i)

    def _start(self, request, sender, req, params, inband: bool, group: RowGroup | None, row: int) -> None:
        rid = self._prefix + str(next(self._ids))
        decoder = (self.tok if req.skip_special_tokens else
                   self.tok.keeping_special(self.end_ids + tuple(params.stop_token_ids)))
        st = Stream(rid, request.request_id(), request, sender, req,
                    StreamDetokenizer(decoder, req.prompt_ids, req.stop_strings, self.interval, req.stop_ids),
                    time.monotonic(), inband=inband, group=group, row=row, wanted=requested_outputs(request))
        with self._lock:
            self._active[rid] = st
        try:
            self.executor.submit(req.prompt_ids, params, request_id=rid,
                                 on_event=lambda ev, st=st: self._on_event(st, ev))
        except Exception as e:  # noqa: BLE001 - ValueError from SamplingParams.validate, or a stopped executor
            with self._lock:
                self._active.pop(rid, None)
            with st.lock:
                if not st.done:
                    st.done = True
                    self.metrics.errors.count("invalid_request" if isinstance(e, ValueError) else "unavailable")
                    if group is None or group.close():  # a row's error ends its whole request
                        # through the responder: an earlier row's responses may still be queued there
                        self._queue_error(st, str(e) if isinstance(e, ValueError) else f"engine: {e}")

    def _stop_request(self, triton_id: str, sender) -> None:
        if not triton_id:
            self.metrics.errors.count("invalid_request")
            self._send_error(sender, "stop_request needs the request id of the request to stop")
            return
        if len(triton_id) < MIN_STOP_ID_LEN:
            # a short id is guessable: honouring it would let any client stop anyone's request
            self.metrics.errors.count("invalid_request")
            self._send_error(sender, f"stop_request refused: request id {triton_id!r} is shorter than "
                             f"{MIN_STOP_ID_LEN} characters, so anyone could guess it; to stop a request by "
                             "id, start it with an unguessable id such as a UUID (closing its stream cancels "
                             "it too)")
            return
        with self._lock:
            targets = [st for st in self._active.values() if st.triton_id == triton_id]
        for st in targets:
            with st.lock:
                if st.done or st.cancel_asked:
                    continue
                st.cancel_asked, st.cancel_by = True, "stop"
            self.executor.cancel(st.rid)
        send_empty_final(self.pb, sender)

    # ---- executor thread -----------------------------------------------------------------------
    def _on_event(self, st: Stream, ev: Any) -> None:
        with st.lock:
            if st.done:
                return
            if st.group is not None and st.group.closed:
                # another row's error ended the request (nothing may follow its FINAL): stop this row
                self._retire(st)
                self.executor.cancel(st.rid)
                return
            self.metrics.tokens(st.record(ev, time.monotonic()))
            if getattr(ev, "error", None):
                for_request(_LOG, st.rid).error("engine error: %s", ev.error)
                self._finish(st, error=f"engine error: {ev.error}", kind="engine")
                return
            if ev.finished and ev.finish_reason == "cancelled" and st.cancel_by == "client":
                self._finish(st, error="request cancelled", kind="cancelled")
                return
            # cancelled otherwise (a stop_request, or the engine shutting down): a normal final
            # response with what was generated, finish_reason "cancelled" (tensorrtllm_backend's stop)
            chunk = st.detok.push(list(ev.token_ids), bool(ev.finished))
            if chunk is None:
                return
            # finish_reason is non-empty exactly on the final response (the bls model relies on it)
            reason = ("stop" if chunk.stop else ev.finish_reason or "finished") if chunk.finished else ""
            if chunk.stop and not ev.finished:
                st.cancel_asked, st.cancel_by = True, "text"  # the text is complete; free the blocks
                self.executor.cancel(st.rid)
            if chunk.finished:
                if reason == "cancelled":
                    self.metrics.errors.count("cancelled")
                self._retire(st)  # before the FINAL response: its sender sees metrics that count it
            if st.req.streaming:
                self._send(st, chunk.ids, chunk.context, chunk.trim, reason, chunk.finished, chunk.text)
            else:
                st.ids.extend(chunk.ids)
                st.text += chunk.text
                st.trim = chunk.trim
                if chunk.finished and st.req.exclude_input_in_output:
                    self._send(st, st.ids, st.req.prompt_ids[-CONTEXT_TOKENS:], st.trim, reason, True, st.text)
                elif chunk.finished:  # NVIDIA's non-streamed output_ids: the prompt, then the new ids
                    # the prompt's text is decoded here, once; the generated text is the chunks'
                    self._send(st, st.req.prompt_ids + st.ids, [], st.trim, reason, True,
                               self.tok.decode(st.req.prompt_ids) + st.text)

    def _send(self, st: Stream, ids, context, trim, reason, final, text: str = "") -> None:
        """Called with st.lock held: takes the response's outputs now (st's pending log-probs and
        logits go with them); the responder makes the response and sends it."""
        if st.group is not None:  # the request ends (FINAL flag) with the response ending its last row
            final = final and (st.group.closed or st.group.row_finished())
        draft = draft_counts(self.executor, st.rid) if st.req.return_perf_metrics else None
        outputs = st.outputs(ids, context, trim, reason, text, draft)
        st.sent = True
        on_error = None if final else partial(self._undelivered, st)
        # a part: when st's previous response still waits for the responder, these tokens join it
        self.responder.send_part(st.rid, st.sender, outputs, partial(self._response, st.wanted),
                                 self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0, on_error)

    def _response(self, wanted: frozenset[str] | None, parts: list[dict]) -> Any:
        """The Triton response carrying ``parts`` (numpy outputs of one stream's consecutive
        responses, joined), the outputs its request asked for only, made on the responder's thread."""
        return make_response(self.pb, merge_outputs(parts), wanted)

    def _undelivered(self, st: Stream, e: BaseException) -> None:
        """A non-final response could not be sent: the client went away, so stop generating for it.
        On the responder's thread (or inline, under st.lock: it is reentrant)."""
        for_request(_LOG, st.rid).info("response not delivered (%s); cancelling", e)
        with st.lock:
            if st.done or st.cancel_asked:
                return
            st.cancel_asked, st.cancel_by = True, "client"
        self.executor.cancel(st.rid)

    def _queue_error(self, st: Stream, message: str) -> None:
        """st's FINAL error response, behind its earlier responses."""
        self.responder.send(st.sender, partial(error_response, self.pb, message, st.inband, st.wanted),
                            self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL, key=st.rid)

    def _finish(self, st: Stream, error: str, kind: str) -> None:
        """Called with st.lock held. Ends st with an error as its FINAL response (in-band for a
        request that asked for it) and counts it under ``kind`` (first: a client that sees the request
        gone from the gauges ``_retire`` publishes also sees it counted)."""
        self.metrics.errors.count(kind)
        self._retire(st)
        if st.group is not None and not st.group.close():
            return  # another row's error, or the last row's FINAL, already ended the request
        if st.inband:
            self._send(st, [], [], 0, f"error: {error}", True)
        else:
            self._queue_error(st, error)

    def _retire(self, st: Stream) -> None:
        """Called with st.lock held, BEFORE st's final response is sent: forgets st and publishes
        its metrics (latencies, and the executor totals its steps added to), so that a client
        holding its final response reads metrics that include its request."""
        st.done = True
        with self._lock:
            self._active.pop(st.rid, None)
        ttft = st.first - st.arrival if st.first else None
        tpot = (st.last - st.first) / (st.n_tokens - 1) if st.first and st.n_tokens > 1 else None
        try:
            self.metrics.request_done(ttft, tpot)
        except Exception:  # noqa: BLE001 - metrics must never cost a request its final response
            pass
        self.refresh_metrics()

    def _send_error(self, sender, message: str, inband: bool = False, request=None) -> None:
        send_error(self.pb, sender, message, inband, requested_outputs(request) if inband and request else None)

    # ---- poller: cancellation and gauges -------------------------------------------------------
    def _poll(self) -> None:
        next_stats = 0.0
        while not self._stop.wait(POLL_S):
            with self._lock:
                streams = list(self._active.values())
            if self.serving.drain_dir:  # a file check, no IPC (serving_state.py says why)
                self._check_serving(streams)
            for st in streams:
                # under the stream's lock: once its FINAL response is sent Triton releases the
                # request, and asking a released request is_cancelled() crashes the server
                with st.lock:
                    if st.done or st.cancel_asked or not st.request.is_cancelled():
                        continue
                    st.cancel_asked, st.cancel_by = True, "client"
                self.executor.cancel(st.rid)
            if time.monotonic() >= next_stats:
                next_stats = time.monotonic() + STATS_EVERY_S
                self.refresh_metrics()
            reason = self.executor.health(self.step_timeout_s)
            if reason is not None:
                self._fail(reason)
                return

    def _check_serving(self, streams: list[Stream]) -> None:
        """Once the engine should stop serving (``serving_state``: the harness's drain before it stops
        the server): refuse new requests and end the running ones now, not at max_tokens past
        Triton's exit timeout (the module docstring says why one that already sent a response ends
        like a stop, not with an error); with none left, the drain is acknowledged."""
        self.draining = self.serving.stopped()
        if self.draining is None:
            return
        if not streams:
            self.serving.idle()
        for st in streams:
            with st.lock:
                if st.done or st.cancel_by == "shutdown":
                    continue
                st.cancel_asked, st.cancel_by = True, "shutdown"
                if st.inband or not st.sent:
                    self._finish(st, error=self.draining, kind="unavailable")
            # frees its blocks; a request not ended above gets its final ("cancelled") within a step
            self.executor.cancel(st.rid)

    def _fail(self, reason: str) -> None:
        """The engine cannot serve any more: end everything in flight with an error, then hand
        over to ``on_fatal`` (a hung device step cannot be interrupted from Python)."""
        self.failed = reason
        _LOG.critical("engine failed: %s; ending %d in-flight requests", reason, self.num_active())
        try:
            self.metrics.engine_failed()
        except Exception:  # noqa: BLE001 - metrics must never stop the failure handling
            pass
        with self._lock:
            streams = list(self._active.values())
        for st in streams:
            with st.lock:
                if not st.done:
                    self._finish(st, error=f"engine failure: {reason}", kind="engine")
        # the final errors must be out before on_fatal ends the process (not waited for beyond this)
        self.responder.flush(timeout=10.0)
        if self.on_fatal is not None:
            self.on_fatal(reason)

    def refresh_metrics(self) -> None:
        # Read and publish under one lock (the poller and the executor thread both call this): a
        # snapshot taken earlier can then never overwrite a later one.
        try:
            with self._metrics_lock:
                self.metrics.update({**self.executor.stats(), "responses_sent": self.responder.responses,
                                     "response_parts": self.responder.parts})
        except Exception:  # noqa: BLE001 - metrics must never take the model down
            _LOG.exception("metrics update failed")

    def num_active(self) -> int:
        with self._lock:
            return len(self._active)

    def shutdown(self) -> None:
        self._stop.set()
        self._poller.join(timeout=5)
        self.executor.shutdown()  # pending requests get their final (cancelled) events first
        with self._lock:
            leftover = list(self._active.values())
        for st in leftover:
            with st.lock:
                if not st.done:
                    self._finish(st, error="the engine model is shutting down", kind="unavailable")
        self.responder.close(timeout=10.0)  # every FINAL out before Triton's finalize() returns
        self.metrics.close()  # now, not while the stub's interpreter shuts down (segfaults there)
