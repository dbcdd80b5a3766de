"""Start ranks: in-process spawn (CPU/gloo by default) or join a torchrun launch.

Failure behaviour: a rank that raises fails the whole launch with its error; a rank that dies
(a signal, an exit) is a `RankDiedError` naming the rank and the signal; a rank that stalls
makes its peers' collectives fail after `timeout` seconds (the process group's timeout). In
every case the other ranks are stopped, and no helper process is left behind. Spawned ranks
also die with the launcher when it is killed outright (SIGKILL runs none of its cleanup).
"""

from __future__ import annotations

import datetime
import os
import signal
import socket
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from multiprocessing.reduction import ForkingPickler

from dcp_compile.runtime import parallel, parent_death
from dcp_compile.runtime.devices import require_torch_npu

DEFAULT_TIMEOUT_S = 300.0
"""Seconds a collective waits for a stalled peer before failing (torch's default is 30 minutes)."""
MAX_TIMEOUT_S = 365 * 24 * 3600.0
"""A year. Python's timedelta holds neither inf nor 1e300 s, and a deadline centuries out risks
overflowing clocks kept in int64 nanoseconds; no run needs to wait longer for a stalled peer."""


class RankDiedError(RuntimeError):
    """A rank process ended without reporting a result: killed by a signal, or exited."""


class CollectiveTimeoutError(RuntimeError):
    """A rank's collective waited `timeout` seconds for a peer that never joined (a stalled rank)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_backend(backend: str) -> None:
    """HCCL (Ascend) needs torch_npu; say how to get it rather than fail inside the ranks."""
    if backend == "hccl":
        require_torch_npu("the HCCL backend")


def check_timeout(timeout: float) -> datetime.timedelta:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= MAX_TIMEOUT_S:
        raise ValueError(f"timeout must be a finite number of seconds > 0 and at most {MAX_TIMEOUT_S:.0f} (a year), "
                         f"got {timeout!r}")
    return datetime.timedelta(seconds=timeout)


def worker(rank: int, results, world_size: int, port: int, backend: str, timeout: float, fn, args) -> None:
    """A spawned rank (started by parent_death.rank_main): join the world, run fn, report to `results`."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    if backend == "hccl":
        require_torch_npu("the HCCL backend")
        torch.npu.set_device(rank)
    try:
        _init_world(backend, check_timeout(timeout), rank=rank, world_size=world_size)
        results.put((rank, "ok", fn(rank, world_size, *args)))
    except BaseException as exc:  # reported to the parent, which raises
        if "timed out" in str(exc).lower():
            results.put((rank, "timeout", f"{_collective_call(exc)}: {str(exc).splitlines()[0]}"))
        else:
            results.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn, world_size: int, *args, backend: str = "gloo", timeout: float = DEFAULT_TIMEOUT_S):
    """Run fn(rank, world_size, *args) on `world_size` fresh processes; return their results.

    fn must be a module-level function; its return value must be picklable. A collective that
    waits on a stalled peer fails after `timeout` seconds.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    check_backend(backend)
    check_timeout(timeout)
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    port = free_port()
    payload = ForkingPickler.dumps((worker, world_size, port, backend, timeout, fn, args))
    processes = [ctx.Process(target=parent_death.rank_main, args=(rank, os.getpid(), bytes(payload), results), daemon=False)
                 for rank in range(world_size)]
    try:
        for process in processes:  # inside the try: a Ctrl-C between two starts still stops the first
            process.start()
        return _collect(processes, results, world_size)
    finally:
        started = [process for process in processes if process.pid is not None]
        for process in started:
            if process.is_alive():
                process.kill()  # SIGKILL: a stopped (SIGSTOP) rank ignores SIGTERM until continued
        for process in started:
            process.join()
        results.close()


def _collective_call(exc: BaseException) -> str:
    """The code that called into torch.distributed when `exc` was raised."""
    frames = traceback.extract_tb(exc.__traceback__)
    for caller, callee in zip(reversed(frames[:-1]), reversed(frames[1:])):
        if "torch/distributed" in callee.filename.replace("\\", "/") and "torch/distributed" not in caller.filename.replace("\\", "/"):
            return f"{caller.line} ({caller.filename}:{caller.lineno})"
    return "a collective"


def _collect(processes, results, world_size: int) -> list:
    """Results in rank order; the first error, or a rank's death, raises at once."""
    collected: dict[int, object] = {}
    while len(collected) < world_size:
        while not results.empty():
            rank, status, payload = results.get()
            if status != "ok":
                _raise_for_death(processes, collected, rank, payload)
            if status == "error":
                raise RuntimeError(payload)
            if status == "timeout":
                silent = [r for r, p in enumerate(processes) if r not in collected and r != rank and p.is_alive()]
                raise CollectiveTimeoutError(
                    f"rank {rank} timed out in {payload}; ranks that never reached it: {silent or 'none left'} "
                    "(stalled or hung?)"
                )
            collected[rank] = payload
        for rank, process in enumerate(processes):
            if rank not in collected and not process.is_alive() and results.empty():
                raise RankDiedError(_death(rank, process.exitcode))
        time.sleep(0.01)
    return [collected[rank] for rank in range(world_size)]


def _raise_for_death(processes, collected, failed_rank: int, payload: str, grace_s: float = 2.0) -> None:
    """A peer's death makes the others' collectives fail (connection reset): when a rank fails,
    report a rank that died, if one did, as the cause."""
    deadline = time.time() + grace_s
    while time.time() < deadline:
        for rank, process in enumerate(processes):
            if rank != failed_rank and rank not in collected and process.exitcode is not None and process.exitcode < 0:
                raise RankDiedError(f"{_death(rank, process.exitcode)}; rank {failed_rank} then failed: "
                                    f"{payload.splitlines()[0][:200]}")
        if all(p.is_alive() for r, p in enumerate(processes) if r != failed_rank and r not in collected):
            return  # every peer still runs: no death to blame
        time.sleep(0.05)


def _death(rank: int, exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        return f"rank {rank} was killed by {signal.Signals(-exitcode).name}"
    return f"rank {rank} exited with code {exitcode} before reporting a result"


def init_from_env(backend: str | None = None, timeout: float = DEFAULT_TIMEOUT_S) -> tuple[int, int]:
    """Join a torchrun launch (RANK/WORLD_SIZE set); returns (rank, world_size). A collective
    that waits on a stalled peer fails after `timeout` seconds."""
    if "RANK" not in os.environ:
        raise RuntimeError("init_from_env needs a torchrun launch (RANK and WORLD_SIZE unset)")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    check_backend(backend)
    if backend == "nccl":
        if not torch.cuda.is_available() or not dist.is_nccl_available():
            raise RuntimeError("backend 'nccl' asked for, but no CUDA GPU or NCCL is available")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    _init_world(backend, check_timeout(timeout))
    return dist.get_rank(), dist.get_world_size()


def _init_world(backend: str, timeout: datetime.timedelta, **rendezvous) -> None:
    """init_process_group, recording its timeout for the TP and DCP groups built later: read back
    from the backend it may be unknown (the emulated HCCL's Python process group reports none)."""
    dist.init_process_group(backend, timeout=timeout, **rendezvous)
    parallel.record_world_timeout(timeout)
