"""Start ranks: in-process spawn (CPU/gloo by default) or join a torchrun launch."""

from __future__ import annotations

import os
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_backend(backend: str) -> None:
    """HCCL (Ascend) needs torch_npu; say how to get it rather than fail inside the ranks."""
    if backend == "hccl":
        from dcp_compile.lowering.npu import require_torch_npu

        require_torch_npu("the HCCL backend")


def _worker(rank: int, world_size: int, port: int, backend: str, fn, args, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    if backend == "hccl":
        torch.npu.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world_size)
    try:
        results[rank] = ("ok", fn(rank, world_size, *args))
    except BaseException as exc:  # reported to the parent, which raises
        results[rank] = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        raise
    finally:
        dist.destroy_process_group()


def spawn(fn, world_size: int, *args, backend: str = "gloo"):
    """Run fn(rank, world_size, *args) on `world_size` fresh processes; return their results.

    fn must be a module-level function; its return value must be picklable.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    check_backend(backend)
    manager = mp.get_context("spawn").Manager()
    results = manager.dict()
    try:
        mp.spawn(_worker, args=(world_size, free_port(), backend, fn, args, results), nprocs=world_size, join=True)
    except mp.ProcessRaisedException as exc:
        errors = [v[1] for v in results.values() if v[0] == "error"]
        raise RuntimeError(errors[0] if errors else str(exc)) from None
    return [results[r][1] for r in range(world_size)]


def init_from_env(backend: str | None = None) -> tuple[int, int]:
    """Join a torchrun launch (RANK/WORLD_SIZE set); returns (rank, world_size)."""
    if "RANK" not in os.environ:
        raise RuntimeError("init_from_env needs a torchrun launch (RANK and WORLD_SIZE unset)")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    check_backend(backend)
    if backend == "nccl":
        if not torch.cuda.is_available() or not dist.is_nccl_available():
            raise RuntimeError("backend 'nccl' asked for, but no CUDA GPU or NCCL is available")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size()
