"""Process groups: a TP group with DCP groups inside it.

Rank convention (one, used everywhere):
- TP groups are consecutive blocks of `tp_size` world ranks; tp_rank = rank % tp_size.
- Inside a TP group, DCP groups are consecutive blocks of `dcp_size` TP ranks;
  dcp_rank = tp_rank % dcp_size.
- TP rank t owns heads [t*H/T, (t+1)*H/T). A DCP group therefore gathers a contiguous range of
  heads, and peer j's heads sit at [j*H/T, (j+1)*H/T) of the gathered tensor.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}
_GROUPS_WORLD: list = [None]
"""The default process group the cached groups belong to: after destroy_process_group and a new
init_process_group, they are dead and are made anew."""


@dataclass(frozen=True)
class ParallelState:
    tp_size: int = 1
    tp_rank: int = 0
    dcp_size: int = 1
    dcp_rank: int = 0
    tp_group_name: str | None = None
    dcp_group_name: str | None = None


_WORLD_TIMEOUT: list = [None, None]
"""[world group, the timeout its launcher passed to init_process_group]: record_world_timeout's."""


def record_world_timeout(timeout: datetime.timedelta) -> None:
    """Keep the timeout just given to init_process_group, for the TP and DCP groups built on this
    world later (dist.new_group does not inherit it: a subgroup gets torch's default of 30 minutes).
    The launchers (dcp_compile.runtime.launch) call it; a rank that calls init_process_group itself
    should too, where its backend does not report its timeout (see world_timeout)."""
    _WORLD_TIMEOUT[:] = [dist.distributed_c10d._get_default_group(), timeout]


def group_timeout(group: dist.ProcessGroup) -> datetime.timedelta | None:
    """The timeout a process group's collectives wait for a peer, as its backend reports it (None
    where it does not: gloo, NCCL and torch_npu's HCCL do; a Python process group may not)."""
    for device_type in group._device_types:
        try:
            return group._get_backend(torch.device(device_type)).options._timeout
        except (AttributeError, RuntimeError):
            continue
    return None


def world_timeout() -> datetime.timedelta:
    """The world group's timeout: the one recorded for it (record_world_timeout), else its
    backend's report. Neither is an error rather than torch's 30 minutes for every subgroup."""
    world = dist.distributed_c10d._get_default_group()
    if _WORLD_TIMEOUT[0] is world:
        return _WORLD_TIMEOUT[1]
    timeout = group_timeout(world)
    if timeout is None:
        raise RuntimeError(
            f"the world process group's timeout is unknown: its backend {dist.get_backend(world)!r} does not report "
            "it and it was not recorded. Start the ranks with dcp_compile.runtime.launch (spawn, init_from_env), "
            "call dcp_compile.runtime.parallel.record_world_timeout(timeout) after init_process_group, or pass "
            "timeout= to parallel.build; else the TP and DCP groups would wait torch's default of 30 minutes for a "
            "stalled peer"
        )
    return timeout


def _group(ranks: list[int], timeout: datetime.timedelta | None) -> dist.ProcessGroup:
    """new_group is collective over the world, so every rank creates every block in one order.
    The group waits `timeout` for a stalled peer, by default the world group's (world_timeout)."""
    world = dist.distributed_c10d._get_default_group()
    if _GROUPS_WORLD[0] is not world:
        _GROUPS.clear()
        _GROUPS_WORLD[0] = world
    timeout = timeout if timeout is not None else world_timeout()
    key = (tuple(ranks), timeout)
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(ranks, timeout=timeout)
    return _GROUPS[key]


def _blocks(ranks: list[int], size: int) -> list[list[int]]:
    return [ranks[i : i + size] for i in range(0, len(ranks), size)]


def validate_sizes(tp_size: int, dcp_size: int, world_size: int) -> None:
    if dcp_size < 1:
        raise ValueError(f"dcp_size must be >= 1, got {dcp_size}")
    if tp_size < 1 or world_size % tp_size:
        raise ValueError(f"tp_size {tp_size} must be >= 1 and divide the world size {world_size}")
    if tp_size % dcp_size:
        raise ValueError(
            f"dcp_size {dcp_size} must divide tp_size {tp_size}: DCP groups live inside a TP group "
            f"(allowed: {[d for d in range(1, tp_size + 1) if tp_size % d == 0]})"
        )


def build(tp_size: int, dcp_size: int = 1, timeout: datetime.timedelta | None = None) -> ParallelState:
    """Create (or reuse) the TP and DCP groups for this rank. Collective: call on every rank.
    Their collectives fail after `timeout` waiting for a peer: by default the world group's."""
    if not dist.is_initialized():
        validate_sizes(tp_size, dcp_size, 1)
        return ParallelState(tp_size=1, tp_rank=0, dcp_size=1, dcp_rank=0)
    world, rank = dist.get_world_size(), dist.get_rank()
    validate_sizes(tp_size, dcp_size, world)
    tp_name = dcp_name = None
    for tp_ranks in _blocks(list(range(world)), tp_size):
        tp_group = _group(tp_ranks, timeout) if tp_size > 1 else None
        for dcp_ranks in _blocks(tp_ranks, dcp_size):
            dcp_group = _group(dcp_ranks, timeout) if dcp_size > 1 else None
            if rank in dcp_ranks and dcp_group is not None:
                dcp_name = dcp_group.group_name
        if rank in tp_ranks and tp_group is not None:
            tp_name = tp_group.group_name
    tp_rank = rank % tp_size
    return ParallelState(tp_size, tp_rank, dcp_size, tp_rank % dcp_size, tp_name, dcp_name)



def build_replicated(dcp_size: int, timeout: datetime.timedelta | None = None) -> ParallelState:
    """Groups for a model whose attention is replicated (tp_size 1: every rank has every head):
    DCP groups are consecutive blocks of `dcp_size` world ranks, dcp_rank = rank % dcp_size.
    Collective: call on every rank."""
    if not dist.is_initialized():
        validate_sizes(dcp_size, dcp_size, 1)
        return ParallelState()
    world, rank = dist.get_world_size(), dist.get_rank()
    if dcp_size < 1 or world % dcp_size:
        raise ValueError(f"dcp_size {dcp_size} must be >= 1 and divide the world size {world} (replicated heads: the DCP "
                         "groups are blocks of the world)")
    dcp_name = None
    for dcp_ranks in _blocks(list(range(world)), dcp_size):
        group = _group(dcp_ranks, timeout) if dcp_size > 1 else None
        if rank in dcp_ranks and group is not None:
            dcp_name = group.group_name
    return ParallelState(1, 0, dcp_size, rank % dcp_size, None, dcp_name)
