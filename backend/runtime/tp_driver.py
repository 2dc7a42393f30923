"""Rank 0 of a tensor-parallel engine in this process, ranks 1.. in spawned worker processes.

``TPDriver`` answers what the executor asks of a ``ModelRunner`` (``execute``, ``block_size``,
``num_blocks``, ``kv_cache_bytes``): rank 0 schedules, so before each step it broadcasts the step's
inputs (token ids, attention metadata, logit rows) and the workers run the same step on their
shards and caches; only rank 0 gets logits. Failure is loud and bounded: a worker that is gone makes
the next ``execute`` raise ``EngineError`` (checked before the step, and gloo's broken connection
inside it), and ``shutdown`` stops the workers, then kills any that do not exit. One driver per
process: it owns the default ``torch.distributed`` group while it lives.
"""
from __future__ import annotations

import dataclasses
import datetime
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from backend.runtime import cpu_dtype
from backend.runtime.kv_plan import CPU_RAM_FRACTION, kv_cache_dtypes
from backend.runtime.spec import EngineError, EngineSpec
from backend.runtime.runtimes import StepRunner
from backend.runtime.kv_plan import plan_kv_blocks as runner_plan
from backend.runtime.tp import TPRunner
from backend.runtime.tp_shard import ShardError, check_tp, kv_heads_per_rank
from backend.ops.attention import get_backend

# Workers wait in a broadcast between steps for as long as the engine is idle: the group's timeout
# must not end an idle server. A dead peer is seen sooner, by its closed connection.
_IDLE_TIMEOUT = datetime.timedelta(days=1)
_STOP = "stop"
_PARENT_POLL_S = 1.0
_DEATH_GRACE_S = 2.0     # how long a failed step waits to see which worker exited


def _exit_with_parent(parent: int) -> None:
    """A worker ends when rank 0's process is gone, however it went: the Triton stub's fatal path
    leaves by ``os._exit`` and a supervisor may SIGKILL it, neither of which stops daemon children,
    and a worker idle in a broadcast would otherwise only learn of it from the socket (or never, if
    it is still loading). Polling the parent pid needs no cooperation from the dying process."""
    while True:
        time.sleep(_PARENT_POLL_S)
        if os.getppid() != parent:
            os._exit(1)


def _store_dir() -> str:
    """A fresh folder for this driver's rendezvous file under ``<tmp>/kiln-tp``, named after this
    process. ``shutdown`` removes it; a driver whose process was killed (SIGKILL of a Triton stub, a
    supervisor's kill) cannot, so each new driver first removes the folders of processes that no
    longer exist."""
    root = Path(tempfile.gettempdir()) / "kiln-tp"
    root.mkdir(exist_ok=True)
    for d in root.iterdir():
        pid = d.name.split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(d, ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{os.getpid()}-", dir=root)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:      # another user's process: alive
        return True
    return True


def rank_devices(device: str | torch.device, tp_size: int) -> list[torch.device]:
    """Each rank's device: all on the CPU, or consecutive GPUs from the one named (``cuda:2`` with
    tp 2 -> cuda:2, cuda:3: the GPUs ``backend/serving/placement.py`` gives an engine instance)."""
    device = torch.device(device)
    if device.type == "cpu":
        return [device] * tp_size
    if device.type != "cuda":
        raise EngineError(f"engine.tp_size: {tp_size} runs on cpu or cuda devices; got {str(device)!r}")
    first = device.index or 0
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if first + tp_size > visible:
        raise EngineError(f"engine.tp_size: {tp_size} ranks from GPU {first} need GPUs {first}..{first + tp_size - 1}, "
                          f"but {visible} are visible; allowed: a tp_size and first GPU within the visible GPUs")
    return [torch.device("cuda", first + r) for r in range(tp_size)]


def _backend(device: torch.device) -> str:
    """NCCL between GPUs (one per process), gloo between CPU processes."""
    return "nccl" if device.type == "cuda" else "gloo"


def _to(obj: Any, device: torch.device) -> Any:
    """A step's inputs (tensors, tuples of them, the attention metadata dataclass) on ``device``: a
    GPU rank's tensors travel as CPU copies, since a pickled CUDA tensor names rank 0's GPU."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=False)
    if isinstance(obj, tuple):
        return tuple(_to(o, device) for o in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: _to(getattr(obj, f.name), device)
                                           for f in dataclasses.fields(obj)
                                           if isinstance(getattr(obj, f.name), torch.Tensor)})
    return obj


def _worker(rank: int, tp_size: int, store: str, spec: EngineSpec, num_blocks: int | None, dtype: str | None,
            parent: int, device: str) -> None:
    threading.Thread(target=_exit_with_parent, args=(parent,), name="kiln-tp-parent-watch", daemon=True).start()
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)   # NCCL's communicator and broadcast_object_list use the current GPU
    dist.init_process_group(_backend(dev), init_method=store, rank=rank, world_size=tp_size, timeout=_IDLE_TIMEOUT)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp_size))
    runner = TPRunner(spec, tp_size, rank, num_blocks, dtype=getattr(torch, dtype) if dtype else None, device=dev)
    try:
        while True:
            msg: list = [None]
            dist.broadcast_object_list(msg, src=0)
            if msg[0] == _STOP:
                break
            runner.execute(*_to(msg[0], dev))
    except RuntimeError as exc:   # rank 0 or a peer went away: nothing left to serve
        print(f"kiln tensor-parallel rank {rank}: the group broke ({str(exc).splitlines()[0]}); exiting",
              file=sys.stderr)
        raise SystemExit(1) from None
    finally:
        dist.destroy_process_group()


def plan_kv_blocks(spec: EngineSpec, tp_size: int, dtype: torch.dtype) -> int:
    """``ModelRunner``'s KV plan for one rank's share (KV heads / tp, or the one replicated), on CPU RAM:
    every rank holds the same number of blocks, so that rank 0's block ids are valid everywhere. (On GPUs each rank plans
    from its own free memory once its weights are in, and the ranks take the smallest: ``TPRunner``.)"""
    _, storage = kv_cache_dtypes(spec, dtype, torch.device("cpu"), get_backend("torch", "cpu"))
    heads = kv_heads_per_rank(spec.model.num_kv_heads, tp_size)
    return runner_plan(spec, storage, heads, None, CPU_RAM_FRACTION / tp_size)


class TPDriver(StepRunner):
    """``tp_size`` ranks: this process is rank 0 (and the sampler's), the others are spawned here."""

    def __init__(self, spec: EngineSpec, tp_size: int, num_blocks: int | None = None,
                 dtype: torch.dtype | None = None, start_timeout_s: float = 300.0,
                 device: str | torch.device = "cpu") -> None:
        """``device``: ``cpu`` (every rank; gloo), or the first of ``tp_size`` consecutive GPUs, one per
        rank (NCCL). ``num_blocks`` None: planned from RAM (CPU) or each GPU's free memory."""
        try:
            check_tp(spec.model, spec.quant_format, tp_size, spec.manifest.quantization.group_size)
        except ShardError as exc:
            raise EngineError(f"engine.tp_size: {exc}") from exc
        self.devices = rank_devices(device, tp_size)
        on_gpu = self.devices[0].type == "cuda"
        if dtype is not None:
            self.dtype_choice = cpu_dtype.DtypeChoice(dtype, "dtype=", "the caller's dtype argument")
        elif on_gpu:
            self.dtype_choice = cpu_dtype.DtypeChoice(spec.model.torch_dtype, "model", "GPU: the model's dtype")
        else:   # CPU: float32 unless engine.cpu_dtype asks for bf16 (auto's timing probe is one-rank)
            self.dtype_choice = cpu_dtype.DtypeChoice(torch.bfloat16 if spec.engine.cpu_dtype == "bfloat16"
                                                      else torch.float32, str(spec.engine.cpu_dtype),
                                                      "tensor parallel: float32 unless engine.cpu_dtype is bfloat16")
        dtype = self.dtype_choice.dtype
        if num_blocks is None and not on_gpu:
            num_blocks = plan_kv_blocks(spec, tp_size, dtype)
        if dist.is_initialized():
            raise EngineError("tensor parallelism: this process already has a torch.distributed group; "
                              "one TPDriver per process")
        self.tp_size = tp_size
        self._tmp = _store_dir()
        store = f"file://{Path(self._tmp) / 'store'}"
        ctx = mp.get_context("spawn")    # fork would copy this process's threads and torch state
        name = str(dtype).removeprefix("torch.") if dtype is not None else None
        self.workers = [ctx.Process(target=_worker, args=(r, tp_size, store, spec, num_blocks, name, os.getpid(),
                                                          str(self.devices[r])),
                                    name=f"kiln-tp-rank{r}", daemon=True) for r in range(1, tp_size)]
        for p in self.workers:
            p.start()
        # the ranks share this host's cores (CPU): one thread per core in each would oversubscribe them
        # (5x slower decode steps on 2 cores); restored by shutdown
        self._threads = torch.get_num_threads()
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp_size))
        try:
            if on_gpu:
                torch.cuda.set_device(self.devices[0])
            # the rendezvous waits for every worker; one that dies while loading fails it by timeout
            dist.init_process_group(_backend(self.devices[0]), init_method=store, rank=0, world_size=tp_size,
                                    timeout=datetime.timedelta(seconds=start_timeout_s))
            self.runner = TPRunner(spec, tp_size, 0, num_blocks, dtype=dtype, device=self.devices[0])
        except BaseException:
            self.shutdown()
            raise
        self.device, self.dtype = self.runner.device, self.runner.dtype
        self.block_size, self.num_blocks = self.runner.block_size, self.runner.num_blocks

    @property
    def kv_cache_bytes(self) -> int:
        """Rank 0's share; every rank holds as much."""
        return sum(k.numel() * k.element_size() * 2 for k, _ in self.runner.kv_caches)

    def health(self) -> str | None:
        """None while every worker runs; else which one exited (the executor's ``health`` asks, so a
        worker that dies between requests fails the engine at once, not at the next step)."""
        for r, p in enumerate(self.workers, start=1):
            if not p.is_alive():
                return (f"tensor parallelism: worker rank {r} (pid {p.pid}) exited with code {p.exitcode}; "
                        f"the engine must be restarted")
        return None

    def _check_workers(self) -> None:
        reason = self.health()
        if reason is not None:
            raise EngineError(reason)

    def execute(self, input_ids: torch.Tensor, meta, logits_indices: torch.Tensor,
                capture_hidden_layers: tuple[int, ...] = ()):
        """``ModelRunner.execute`` across the ranks: the inputs go to every worker, logits come back here."""
        self._check_workers()
        try:
            step = (input_ids, meta, logits_indices, capture_hidden_layers)
            dist.broadcast_object_list([_to(step, torch.device("cpu")) if self.device.type == "cuda" else step], src=0)
            return self.runner.execute(input_ids, meta, logits_indices, capture_hidden_layers)
        except RuntimeError as exc:   # gloo: a peer's connection closed mid-step
            # name the rank that died when it did (its exit shows within moments of the broken
            # socket); gloo's own text is a source path and a paragraph of advice
            deadline = time.monotonic() + _DEATH_GRACE_S
            while (reason := self.health()) is None and time.monotonic() < deadline:
                time.sleep(0.01)
            raise EngineError(reason or f"tensor parallelism: a step failed across the ranks "
                              f"({str(exc).splitlines()[0][:300]}); the engine must be restarted") from exc

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the workers (a stop message when all are alive, else nothing to say it to), wait, kill
        what is left, and leave the group: no process and no store file survive this."""
        if dist.is_initialized():
            if all(p.is_alive() for p in self.workers):
                try:
                    dist.broadcast_object_list([_STOP], src=0)
                except RuntimeError:
                    pass
            dist.destroy_process_group()
        for p in self.workers:
            p.join(timeout_s)
            if p.is_alive():
                p.kill()
                p.join(timeout_s)
        shutil.rmtree(self._tmp, ignore_errors=True)
        torch.set_num_threads(self._threads)
