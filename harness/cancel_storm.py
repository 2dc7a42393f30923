"""Cancellation storm against a running Triton server: many gRPC streams closed by their client
after the first chunk, mixed with normal requests that must still complete.

``cancel_storm(srv, cancels=1000, concurrency=64)`` is the full size (for a soak run);
``tests/serving/test_cancel_storm.py`` calls it smaller. Loopback only: ``srv`` is a
``harness.serving_server.TritonServer`` (anything with ``grpc_url`` and ``proc``).

Each of ``concurrency`` worker threads owns one synchronous ``tritonclient.grpc`` client and takes
tickets until ``cancels`` streams were cancelled: a ticket opens a stream, sends one long greedy
request and, after its first chunk, closes the stream with ``stop_stream(cancel_requests=True)``
(what a client that goes away does); every ``normal_every``-th ticket is instead a short request read
to its final response, which must carry no error. ``snapshot(srv, model)`` reads a model stub's
thread count and RSS from ``/proc`` so that a caller can compare idle values before and after.

Command line (starts its own server on free ports, warms the stub with a small storm, measures
its idle threads and RSS, runs the storm, settles, measures again; prints a JSON report with the
first-chunk wait percentiles; exit code 1 on failure):
``python -m harness.cancel_storm build/<stem>/model_repository --cancels 1000 --concurrency 64``
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import queue
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from harness.model_names import DEFAULT

__all__ = ["StormReport", "StubSnapshot", "cancel_storm", "snapshot", "wait_threads", "main"]

LONG_PROMPT = "Write a very long story about a dragon who learns to fly."
SHORT_PROMPT = "The capital of France is"


@dataclasses.dataclass
class StormReport:
    cancelled: int = 0          # streams closed by their client after the first chunk
    completed: int = 0          # normal requests that ended with a final response and no error
    errors: list[str] = dataclasses.field(default_factory=list)   # streams that got an error
    unanswered: int = 0         # streams with no first chunk (normal: no final) within the timeout
    seconds: float = 0.0
    # seconds from sending to the first chunk (cancelled) or the final response (normal), answered only
    waits: list[float] = dataclasses.field(default_factory=list, repr=False)

    def wait_summary(self) -> dict[str, float]:
        """p50 / p99 / max of :attr:`waits` (tells a slow queue from a stream that was lost)."""
        if not self.waits:
            return {}
        w = sorted(self.waits)
        pick = lambda q: round(w[min(len(w) - 1, int(q * len(w)))], 2)  # noqa: E731
        return {"p50_s": pick(0.50), "p99_s": pick(0.99), "max_s": round(w[-1], 2)}

    def ok(self) -> bool:
        return not self.errors and self.unanswered == 0


@dataclasses.dataclass(frozen=True)
class StubSnapshot:
    pid: int
    threads: int
    rss_kb: int


def _inputs(text: str, max_tokens: int, min_tokens: int) -> list:
    import tritonclient.grpc as g
    out = []
    for name, arr, dt in (("text_input", np.array([[text.encode()]], dtype=object), "BYTES"),
                          ("max_tokens", np.array([[max_tokens]], np.int32), "INT32"),
                          ("min_tokens", np.array([[min_tokens]], np.int32), "INT32"),
                          ("temperature", np.array([[0.0]], np.float32), "FP32"),
                          ("stream", np.array([[True]]), "BOOL")):
        inp = g.InferInput(name, list(arr.shape), dt)
        inp.set_data_from_numpy(arr)
        out.append(inp)
    return out


def _is_final(result) -> bool:
    p = result.get_response().parameters.get("triton_final_response")
    return p is not None and p.bool_param


def _one(client, model: str, inputs: list, normal: bool, timeout_s: float) -> tuple[str, float]:
    """One ticket on ``client``'s own stream: ('completed' | 'first chunk' | 'unanswered' |
    'error: ...', seconds until that outcome)."""
    q: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    outcome = "unanswered"
    t0 = time.monotonic()
    try:
        client.async_stream_infer(model, inputs, enable_empty_final_response=True)
        end = t0 + timeout_s
        while True:
            try:
                result, error = q.get(timeout=max(0.0, end - time.monotonic()))
            except queue.Empty:
                break
            if error is not None:
                outcome = f"error: {error}"
                break
            if not normal:
                outcome = "first chunk"
                break
            if _is_final(result):
                outcome = "completed"
                break
    except Exception as e:  # noqa: BLE001 - a broken stream is a finding, not a storm crash
        outcome = f"error: {type(e).__name__}: {e}"
    finally:
        # a cancelling ticket closes its stream mid-generation, like a client that goes away
        waited = time.monotonic() - t0
        client.stop_stream(cancel_requests=outcome != "completed")
    return outcome, waited


def _worker(url: str, model: str, tickets, report: StormReport, lock: threading.Lock,
            normal_every: int, long_inputs: list, short_inputs: list, timeout_s: float, deadline: float) -> None:
    import tritonclient.grpc as g
    client = g.InferenceServerClient(url)
    try:
        for ticket in tickets:
            if time.monotonic() > deadline:
                return
            normal = normal_every > 0 and ticket % normal_every == normal_every - 1
            outcome, waited = _one(client, model, short_inputs if normal else long_inputs, normal, timeout_s)
            with lock:
                if outcome in ("completed", "first chunk"):
                    report.waits.append(waited)
                if outcome == "completed":
                    report.completed += 1
                elif outcome == "first chunk":
                    report.cancelled += 1
                elif outcome == "unanswered":
                    report.unanswered += 1
                else:
                    report.errors.append(outcome)
    finally:
        client.close()


class _Tickets:
    """Ticket numbers, until ``cancels`` cancelling tickets were handed out (shared by the workers)."""

    def __init__(self, cancels: int, normal_every: int):
        self.cancels, self.normal_every = cancels, normal_every
        self._n = self._c = 0
        self._lock = threading.Lock()

    def __iter__(self):
        while True:
            with self._lock:
                if self._c >= self.cancels:
                    return
                n = self._n
                self._n += 1
                if not (self.normal_every > 0 and n % self.normal_every == self.normal_every - 1):
                    self._c += 1
            yield n


def cancel_storm(srv: Any, *, cancels: int = 1000, concurrency: int = 64, model: str = DEFAULT.bls,
                 normal_every: int = 4, cancel_tokens: int = 200, timeout_s: float = 120.0,
                 budget_s: float = 3600.0, inputs: tuple[list, list] | None = None) -> StormReport:
    """``cancels`` client-cancelled streams at ``concurrency`` against ``model``, plus one normal
    request after every ``normal_every - 1`` cancelled ones (0: none). A cancelled request asks for
    ``cancel_tokens`` tokens (min_tokens too), far more than it gets before its client leaves.
    ``timeout_s`` bounds the wait for one stream's first chunk (a normal request's final);
    ``budget_s`` bounds the whole storm (tickets not started by then are skipped). ``inputs``:
    (cancelled request's, normal request's) InferInputs for a model without the text inputs of
    ``ensemble``/``bls`` (e.g. ``engine`` with token ids)."""
    long_inputs, short_inputs = inputs or (_inputs(LONG_PROMPT, cancel_tokens, cancel_tokens),
                                           _inputs(SHORT_PROMPT, 4, 4))
    report = StormReport()
    lock = threading.Lock()
    tickets = _Tickets(cancels, normal_every)
    start = time.monotonic()
    threads = [threading.Thread(target=_worker, name=f"storm-{i}", daemon=True,
                                args=(srv.grpc_url, model, iter(tickets), report, lock, normal_every,
                                      long_inputs, short_inputs, timeout_s, start + budget_s))
               for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(budget_s + timeout_s + 30)
    report.seconds = time.monotonic() - start
    return report


def snapshot(srv: Any, model: str = DEFAULT.bls) -> StubSnapshot:
    """Thread count and RSS of ``model``'s Python backend stub (one instance)."""
    from harness.serving_server import stub_processes
    pids = [pid for pid, name in stub_processes(srv.proc.pid).items() if name == model]
    if len(pids) != 1:
        raise RuntimeError(f"expected one stub process of model {model!r}, found {pids}")
    pid = pids[0]
    threads = len(list(Path(f"/proc/{pid}/task").iterdir()))
    rss = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
               if line.startswith("VmRSS"))
    return StubSnapshot(pid, threads, rss)


def wait_threads(srv: Any, most: int, *, model: str = DEFAULT.bls, timeout_s: float = 30.0) -> StubSnapshot:
    """Poll ``model``'s stub until it has at most ``most`` threads or ``timeout_s`` passed; return
    the last snapshot (the caller judges it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        snap = snapshot(srv, model)
        if snap.threads <= most or time.monotonic() > deadline:
            return snap
        time.sleep(0.25)


def _settle(srv: Any, model: str, timeout_s: float) -> None:
    """Let the bls model drop the engine iterators it keeps for GRACE_S after a stream ended, then
    send one normal request (a finished iterator is released on the next request's way through)."""
    import tritonclient.grpc as g
    from backend.serving.text_models.bls import GRACE_S
    time.sleep(GRACE_S + 0.5)
    client = g.InferenceServerClient(srv.grpc_url)
    try:
        outcome, _ = _one(client, model, _inputs(SHORT_PROMPT, 4, 4), True, timeout_s)
    finally:
        client.close()
    if outcome != "completed":
        raise RuntimeError(f"a normal request to {model!r} on an idle server ended with {outcome!r}")


def main(argv: list[str] | None = None) -> int:
    from harness.serving_server import TritonServer
    ap = argparse.ArgumentParser(prog="python -m harness.cancel_storm", description=__doc__.split("\n\n")[0])
    ap.add_argument("model_repository")
    ap.add_argument("--model", default=DEFAULT.bls)
    ap.add_argument("--cancels", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--normal-every", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=600.0,
                    help="seconds one stream may wait for its first chunk (a normal request for its "
                         "final) before it counts as unanswered (default 600: on 2 cores a stream "
                         "queued behind 63 long ones waits minutes; lost is what this looks for)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="storms in a row on the same server, each followed by an idle measurement: RSS "
                         "that grows every round is a leak, RSS that stays after the first is memory "
                         "the allocator keeps for the next burst")
    ap.add_argument("--exit-timeout", type=int, default=10)
    args = ap.parse_args(argv)
    srv = TritonServer(args.model_repository, exit_timeout=args.exit_timeout).start()
    failure, idle, rounds = None, None, []
    try:
        # Idle is measured warm, as tests/serving/test_cancel_storm.py does: after a small storm and
        # the grace period, so that lazily started threads and allocator arenas are counted as idle.
        warm = cancel_storm(srv, cancels=8, concurrency=8, model=args.model, timeout_s=args.timeout)
        if not warm.ok():
            raise RuntimeError(f"the warm-up storm failed: {warm}")
        _settle(srv, args.model, args.timeout)
        idle = wait_threads(srv, 10**6, model=args.model)
        for _ in range(max(1, args.rounds)):
            report = cancel_storm(srv, cancels=args.cancels, concurrency=args.concurrency, model=args.model,
                                  normal_every=args.normal_every, timeout_s=args.timeout)
            failure = srv.failure()
            if failure is not None:
                break
            wait_threads(srv, idle.threads, model=args.model)
            _settle(srv, args.model, args.timeout)
            after = wait_threads(srv, idle.threads, model=args.model)
            rounds.append((report, after))
            if not report.ok():
                break
    finally:
        t0 = time.monotonic()
        code = srv.stop()
        stop_s = time.monotonic() - t0

    def summary(r: StormReport) -> dict:
        d = dataclasses.asdict(r)
        d.pop("waits")
        d["errors"] = d["errors"][:20]
        d["wait"] = r.wait_summary()
        return d
    out = {"rounds": [{"report": summary(r), "stub_after": dataclasses.asdict(a)} for r, a in rounds],
           "server_failure": failure, "stub_idle_warm": dataclasses.asdict(idle), "exit_code": code,
           "stop_seconds": round(stop_s, 2)}
    print(json.dumps(out, indent=2))
    ok = len(rounds) == max(1, args.rounds) and all(r.ok() for r, _ in rounds)
    return 0 if ok and failure is None and code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
