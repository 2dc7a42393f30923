"""The executor's loop thread builds the engine too: one thread does all of its torch work.

PyTorch's CPU kernels run their intra-op parallelism on OpenMP (libgomp), and libgomp keeps one
team of worker threads for EVERY thread that has started a parallel region. Once those threads
outnumber the cores, libgomp stops letting idle workers spin between regions (its "throttled" spin
count): every parallel region then wakes its workers through the kernel. A decode step starts
hundreds of small regions (FBGEMM's fp16 GEMM runs each linear as one), so that costs more than
the GEMMs. Loading an engine on the caller's thread (Triton's stub main thread, a test, ``python -m
backend.generate``) and then stepping it on a loop thread made exactly two teams: measured on the
2-core development VM (AVX2 EPYC, 2026-11-27), FBGEMM's fp16 qkv+down pair at 3 rows took 898 us
on the loop thread against 255 us when the loop thread owned the only team, 2001 against 736 us at
18 rows. The fp8 SmolLM2 executor alone, 32 MT-bench prompts 16 at a time, loaded on the main
thread and stepped on its loop thread: 72 output tok/s; loaded by its loop thread: 104-116; served
by Triton at 16 streams: 53-66 before, 78-93 after.

So the thread that will run the loop also loads the model, and the caller only waits for it (its
exceptions are raised on the caller's thread, as a constructor's should be). The caller's thread
must then not run large torch ops of its own on the engine's behalf (``submit`` does none).

A process that exits while the loop thread is inside a step (a script's last ``generate`` returns
once every request's final event is out, before the step that sent them has finished) aborted
with "terminate called without an active exception" (exit code 134), now and then (Python stops
a daemon thread that is still running at finalization abruptly). So every started loop is stopped
and joined at interpreter exit (``stop_at_exit``), before finalization.
"""
from __future__ import annotations

import atexit
import threading
import weakref
from typing import Callable, Protocol


class Stoppable(Protocol):
    def shutdown(self) -> None: ...


_RUNNING: "weakref.WeakSet[Stoppable]" = weakref.WeakSet()


def stop_at_exit(owner: Stoppable) -> None:
    """Call ``owner.shutdown()`` at interpreter exit unless it has been collected by then."""
    _RUNNING.add(owner)


def stopped(owner: Stoppable) -> None:
    """``owner`` has shut down: nothing to do for it at exit."""
    _RUNNING.discard(owner)


@atexit.register
def _stop_running() -> None:
    for owner in list(_RUNNING):
        owner.shutdown()


def start_built(build: Callable[[], None], loop: Callable[[], None], name: str) -> threading.Thread:
    """Start a daemon thread that runs ``build()`` and then ``loop()``; return it once ``build``
    has returned. If ``build`` raises, the thread ends and the exception is raised here."""
    ready = threading.Event()
    failed: list[BaseException] = []

    def run() -> None:
        try:
            build()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, who raises it
            failed.append(exc)
            return
        finally:
            ready.set()
        loop()

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    ready.wait()
    if failed:
        thread.join()
        raise failed[0]
    return thread
