"""The executor: one loop thread that owns the device and runs in-flight batching.

``step() = schedule -> prepare inputs -> run model -> sample (or verify drafts) -> update -> emit``.

Threading contract (the Triton Python backend relies on it):
* ``submit`` validates and queues from the caller's thread (errors raise there, nothing is queued);
* every event, including callbacks given to ``submit(on_event=...)``, is delivered from the loop
  thread; each request gets exactly one event with ``finished=True`` (length, stop, cancelled, error);
* ``cancel`` is asynchronous: the loop aborts the request before its next step and frees its blocks;
* an exception inside a step fails the requests of that step with an error event; the loop goes on.

A step is run by one of two peer loops, both over the same request table (``request_table.py``:
handles, generators, guides, cancels, and the one place a token is delivered) and the same runner:
``sync_loop.py`` (speculative decoding runs there) or, with overlap scheduling
(``engine.overlap_scheduling``: auto = on for CUDA without speculation), ``overlap.py``: the host
schedules and prepares step n+1 while the device runs step n, and learns step n's tokens one step
late through one asynchronous copy; same tokens, same events.
"""
from __future__ import annotations

import itertools
import threading
import time
from typing import Any, Callable, Sequence

import torch

from backend.engine.events import GenerationResult, RequestHandle, TokenEvent
from backend.engine.inputs import InputPreparer
from backend.engine.kv_cache import BlockManager
from backend.engine.kv_groups import GroupedBlockManager
from backend.engine.loop_thread import start_built, stop_at_exit, stopped
from backend.engine.overlap import OverlapLoop, wants_overlap
from backend.engine.request import Request, RequestStatus
from backend.engine.request_table import RequestTable
from backend.engine.sampler import Sampler, make_generator
from backend.engine.sampling_params import SamplingParams
from backend.engine.scheduler import Scheduler
from backend.engine.speculator_seam import Speculator
from backend.engine.sync_loop import SyncLoop
from backend.logs import get_logger
from backend.runtime.spec import EngineError, load_engine_spec
from backend.runtime.runtimes import runner_class

_LOG = get_logger("engine.executor")


def _tp_driver(spec, device: str, dtype: torch.dtype | None, speculative: bool):
    """engine.tp_size > 1: rank 0 here, workers spawned (backend/runtime/tp_driver.py); on the CPU with
    gloo, or on GPUs ``device``, ``device``+1, ... with NCCL."""
    tp = spec.engine.tp_size
    if speculative:
        raise EngineError(f"engine.tp_size: {tp} with speculative decoding is not implemented; "
                          f"pass speculative=False or tp_size 1")
    from backend.runtime.tp_driver import TPDriver   # lazy: spawns processes, only when asked for
    return TPDriver(spec, tp, dtype=dtype, device=device)


def kv_pools(runner, prefix_caching: bool, speculating: bool) -> BlockManager | GroupedBlockManager:
    """The block manager of the runner's KV pool, or of its two (the sliding layers' own: kv_groups.py)."""
    full = BlockManager(runner.num_blocks, runner.block_size, prefix_caching,
                        # an EAGLE draft attends to the whole context: with one, the window frees nothing
                        None if speculating else runner.kv_window)
    if runner.window_kv is None:
        return full
    window, blocks = runner.window_kv   # (the draft reads the full layers' blocks, which stay)
    return GroupedBlockManager(full, BlockManager(blocks, runner.block_size, prefix_caching, window))


class Executor:
    def __init__(self, bundle_path, device: str = "cpu", dtype: torch.dtype | str | None = None,
                 speculator: Speculator | None = None, start: bool = True,
                 weights: dict[str, torch.Tensor] | None = None, verify_hashes: bool = True,
                 speculative: bool = True, **engine_overrides: Any) -> None:
        """``bundle_path``: a bundle folder, or a ``backend.bundle.Bundle`` already read (and checked).
        ``engine_overrides`` replace ``engine.json`` engine keys (e.g. ``max_kv_tokens=4096``).
        ``weights`` reuses tensors already loaded from this bundle (several executors, one copy).
        ``start=False`` runs no thread: the caller drives ``step()`` (``generate`` does it).
        ``verify_hashes`` checks every bundle file's sha256 against engine.json first.
        ``speculative=False`` keeps a bundle's EAGLE draft unused (otherwise it is attached).
        With ``start``, the loop thread itself loads the engine (``backend/engine/loop_thread.py``
        says why) while this thread waits; load errors are raised here either way."""
        self._thread: threading.Thread | None = None
        build = (lambda: self._build(bundle_path, device, dtype, speculator, weights, verify_hashes,
                                     speculative, engine_overrides))
        if start:
            self._thread = start_built(build, self._loop, "kiln-executor")
            stop_at_exit(self)
        else:
            build()

    def _build(self, bundle_path, device: str, dtype: torch.dtype | str | None, speculator: Speculator | None,
               weights: dict[str, torch.Tensor] | None, verify_hashes: bool, speculative: bool,
               engine_overrides: dict[str, Any]) -> None:
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        self.spec = load_engine_spec(bundle_path, engine_overrides, verify_hashes=verify_hashes)
        speculating = speculator is not None or (speculative and self.spec.manifest.speculative is not None)
        runtime = self.spec.engine.runtime
        if runtime != "native" and self.spec.engine.tp_size > 1:
            raise EngineError(f"engine.runtime {runtime}: the graph is one device's (engine.tp_size "
                              f"{self.spec.engine.tp_size}); allowed: engine.runtime native, or tp_size 1")
        if runtime == "tensorrt" and speculating:   # onnx-reference runs draft.onnx (backend/speculative/draft_onnx.py)
            raise EngineError(f"engine.runtime {runtime}: the EAGLE draft has no plan yet; allowed: engine.runtime "
                              f"native or onnx-reference, or speculative=False")
        if self.spec.engine.tp_size > 1:
            self.runner = _tp_driver(self.spec, device, dtype, speculating)
        else:   # engine.runtime: backend/runtime/runtimes.py (the graph runtimes are imported only when chosen)
            try:
                cls = runner_class(runtime)
            except ValueError as exc:
                raise EngineError(str(exc)) from exc
            self.runner = cls(self.spec, device=device, dtype=dtype, weights=weights)
        eng, cfg = self.spec.engine, self.spec.model   # typed, defaults resolved (backend/bundle.py)
        self.max_seq_len = eng.max_seq_len
        self.max_input_len = eng.max_input_len
        self.vocab_size = cfg.vocab_size
        self.block_manager = kv_pools(self.runner, eng.enable_prefix_caching, speculating)
        try:
            self.scheduler = Scheduler(self.block_manager, eng.max_batch_size, eng.max_num_tokens,
                                       eng.scheduler_policy, eng.enable_chunked_prefill,
                                       max_seq_len=self.max_seq_len, eos_token_ids=cfg.eos_token_ids)
        except ValueError as exc:
            raise EngineError(str(exc)) from exc
        self.sampler = Sampler(cfg.eos_token_ids)
        self.device = self.runner.device
        self.table = RequestTable(self.scheduler)
        self.speculator = speculator
        draft = self.spec.manifest.speculative
        if speculator is None and speculative and draft is not None and draft.method == "eagle3":
            from backend.engine.speculator_seam import attach  # draft-less bundles never import the method
            attach(self)
        # Room in each block-table row for a full sequence plus draft tokens being verified.
        max_blocks = -(-(self.max_seq_len + 64) // self.runner.block_size)
        # Given the block manager, the preparer refreshes only block-table rows that changed.
        self.inputs = InputPreparer(self.runner.block_size, max_blocks, self.device,
                                    block_manager=self.block_manager)
        self.sync = SyncLoop(self.table, self.inputs, self.runner, self.sampler, self.speculator)
        self.overlap = self._overlap_loop(self.speculator)

        self._lock = self.table.lock             # guards the scheduler between threads
        self._wake = threading.Condition(self._lock)
        self._guide_compiler = None
        self._ids = itertools.count()
        self._stop = False
        self._started = time.monotonic()
        self._dead: str | None = None            # why the loop thread ended, if it failed

    @property
    def speculator(self) -> Speculator | None:
        return self._speculator

    @speculator.setter
    def speculator(self, spec: Speculator | None) -> None:
        """Attach or drop a speculator (``attach``, benchmarks, tests) while no step runs. The loop is
        chosen again: the overlapped one cannot serve a speculator, so attaching one after
        construction must not leave it running (it would bypass the speculator: no drafts at all)."""
        if "overlap" in self.__dict__:           # after construction (the constructor chooses once)
            loop = self._overlap_loop(spec)      # raises (nothing changed) when true was asked for
            if self.overlap is not None:
                self.overlap.drain()
            self.overlap = loop
            self.sync.speculator = spec
        self._speculator = spec

    def _overlap_loop(self, speculator: Speculator | None) -> OverlapLoop | None:
        """The overlapped loop when ``engine.overlap_scheduling`` asks for it with this speculator."""
        if wants_overlap(self.spec.engine.overlap_scheduling, self.device, speculator is not None):
            return OverlapLoop(self.table, self.inputs, self.runner, self.sampler)
        return None

    # -- public API ---------------------------------------------------------------------------
    def submit(self, prompt_token_ids: Sequence[int], params: SamplingParams | None = None,
               request_id: str | None = None,
               on_event: Callable[[TokenEvent], None] | None = None) -> RequestHandle:
        """Validate and queue one request. Raises ValueError (nothing queued) on bad input."""
        params = params or SamplingParams()
        prompt = list(prompt_token_ids)
        if not prompt:
            raise ValueError("prompt_token_ids: empty; allowed: at least one token id")
        bad = next((t for t in prompt if not isinstance(t, int) or not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt_token_ids: {bad!r} is not a token id; allowed: 0..{self.vocab_size - 1}")
        if len(prompt) > self.max_input_len:
            raise ValueError(f"prompt_token_ids: {len(prompt)} tokens; allowed: at most "
                             f"engine.max_input_len = {self.max_input_len}")
        params.validate(self.max_seq_len - len(prompt), self.vocab_size)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        # compiled here, on the caller's thread: a slow or bad grammar never stalls the loop
        guide = self._new_guide(params.guide) if params.guide is not None else None
        req = Request(rid, prompt, params)
        handle = RequestHandle(rid, prompt, on_event)
        with self._lock:
            if self._dead is not None:
                raise EngineError(f"the engine loop has failed ({self._dead}); restart the server")
            if self._stop:
                raise RuntimeError("executor is shut down")
            generator = make_generator(params.seed, self.device) if params.seed is not None else None
            self.table.add(req, handle, guide, generator)   # raises ValueError before anything is queued
            self._wake.notify()
        return handle

    def _new_guide(self, guide: tuple[str, str]):
        if self._guide_compiler is None:
            from backend.engine.guided import GuideCompiler  # only engines that serve guided requests
            self._guide_compiler = GuideCompiler(self.spec.path / "tokenizer" / "tokenizer.json",
                                                 self.spec.model.eos_token_ids, self.vocab_size)
        return self._guide_compiler.guide(*guide)

    def cancel(self, request_id: str) -> None:
        """Abort a request wherever it is; its final event says ``cancelled``. Unknown ids are ignored."""
        with self._lock:
            self.table.cancel(request_id)
            self._wake.notify()

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
                 | None = None) -> list[GenerationResult]:
        """Submit all prompts, wait for all; results in prompt order."""
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"generate: {len(plist)} sampling params for {len(prompts)} prompts")
        handles = [self.submit(p, sp) for p, sp in zip(prompts, plist)]
        if self._thread is None:  # manual stepping mode (tests): drive the loop here
            while not all(h.finished for h in handles):
                self.step()
        return [h.result() for h in handles]

    def stats(self) -> dict[str, Any]:
        with self._lock:
            s = self.scheduler.stats()
        elapsed = time.monotonic() - self._started
        if self.speculator is not None and self.speculator.stats is not None:
            s.update(self.speculator.stats.as_dict())
        s.update({"generated_tokens_per_s": s["generated_tokens"] / elapsed if elapsed > 0 else 0.0,
                  "ttft_s": list(self.table.ttft), "tpot_s": list(self.table.tpot),
                  "step_errors": self.table.step_errors, "kv_cache_bytes": self.runner.kv_cache_bytes,
                  "device": str(self.device)})
        return s

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the loop; requests still unfinished get a final ``cancelled`` event."""
        stopped(self)
        with self._lock:
            self._stop = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        elif self.overlap is not None:
            self.overlap.drain()         # manual stepping left a step in flight: its tokens are owed
        with self._lock:
            pending = list(self.scheduler.requests)
        for rid in pending:
            self.table.abort(rid, RequestStatus.FINISHED_ABORTED, None)
        self.runner.shutdown()     # tensor parallelism: stop the worker processes (elsewhere a no-op)

    def __enter__(self) -> "Executor":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # -- loop ---------------------------------------------------------------------------------
    def health(self, stuck_after_s: float = 0.0) -> str | None:
        """None while the engine can serve; else why not: the loop thread failed, or (with
        ``stuck_after_s`` > 0) one step has run longer than that (a hung device or kernel), or the
        runner reports itself broken (a tensor-parallel worker process that exited)."""
        if self._dead is not None:
            return f"the engine loop failed: {self._dead}"
        reason = self.runner.health()
        if reason is not None:
            return reason
        started = self.table.step_started
        if stuck_after_s > 0 and started is not None and time.monotonic() - started > stuck_after_s:
            return f"one engine step has run for more than {stuck_after_s:g} s"
        return None

    def _loop(self) -> None:
        try:
            while True:
                with self._lock:
                    while (not self._stop and not self.table.cancels and not self.scheduler.has_unfinished()
                           and (self.overlap is None or self.overlap.pending is None)):
                        self._wake.wait()
                    stop = self._stop
                if stop:
                    if self.overlap is not None:
                        self.overlap.drain()
                    return
                self.step()
        except BaseException as exc:  # noqa: BLE001 - a bug outside a step (scheduler, bookkeeping)
            self._dead = f"{type(exc).__name__}: {exc}"
            _LOG.critical("the engine loop failed; ending every request with an error", exc_info=True)
            self.table.fail_all(f"engine failure: {self._dead}")

    def step(self) -> int:
        """Run one iteration. Returns the number of sequences scheduled (0 = nothing to do)."""
        loop = self.overlap if self.overlap is not None else self.sync
        return loop.step()


__all__ = ["Executor", "GenerationResult", "RequestHandle", "TokenEvent"]
