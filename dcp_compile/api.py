"""dcp_compile.apply: reshard a model's KV pool and compile it with the DCP passes."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from dcp_compile.backend import DCPBackend
from dcp_compile.config import DCPConfig
from dcp_compile.passes.manager import check_pass_names
from dcp_compile.runtime import parallel
from dcp_compile.runtime.kv_pool import CapacityReport, MLAKVPool


@dataclass
class DCPState:
    """What apply() did to a model: its config, layout, KV pool and per-graph pass reports."""

    config: DCPConfig
    parallel: parallel.ParallelState
    backend: DCPBackend
    kv_pool: MLAKVPool

    @property
    def capacity(self) -> CapacityReport:
        return self.kv_pool.report()

    def pass_summary(self) -> dict[str, int]:
        """Sites rewritten per pass, summed over every graph captured so far."""
        total: dict[str, int] = {}
        for report in self.backend.reports:
            for name, sites in report.summary().items():
                total[name] = total.get(name, 0) + sites
        return total


def _check_model(model: nn.Module) -> tuple[MLAKVPool, parallel.ParallelState]:
    pool = getattr(model, "kv_pool", None)
    if not isinstance(pool, MLAKVPool):
        raise ValueError(
            f"{type(model).__name__} has no MLA sites: dcp_compile needs a model with a `kv_pool` "
            "(dcp_compile.runtime.MLAKVPool) whose attention calls dcp_compile.ops.mla_kv_write and "
            "mla_attention (see the README, 'Writing a model for dcp_compile')"
        )
    state = getattr(model, "parallel", None)
    if not isinstance(state, parallel.ParallelState):
        raise ValueError(f"{type(model).__name__} has no `parallel` (dcp_compile.runtime.ParallelState) attribute")
    return pool, state


def apply(model: nn.Module, dcp_size: int = 1, *, config: DCPConfig | None = None, kv_keep: str = "memory",
          **config_fields) -> nn.Module:
    """Shard `model`'s latent KV cache over `dcp_size` ranks of its TP group and compile it.

    Collective: call on every rank. Call before any KV is written (the pool is reallocated).
    kv_keep='memory' keeps the rows per rank and grows the logical capacity N-fold;
    kv_keep='capacity' keeps the logical capacity and shrinks the rows. With dcp_size=1 the
    result is the plain compiled model, the baseline every DCP run is compared with.
    Returns the compiled module; `dcp_compile.state(result)` tells what was done.
    """
    config = config.replace(dcp_size=dcp_size, **config_fields) if config else DCPConfig(dcp_size=dcp_size, **config_fields)
    check_pass_names(config.disabled_passes)
    pool, current = _check_model(model)
    world = dist.get_world_size() if dist.is_initialized() else 1
    parallel.validate_sizes(current.tp_size, config.dcp_size, world)
    if config.dcp_size > 1 and not dist.is_initialized():
        raise RuntimeError(f"dcp_size {config.dcp_size} needs torch.distributed initialised with >= {config.dcp_size} ranks")
    layout = parallel.build(current.tp_size, config.dcp_size)
    pool.reshard(layout.dcp_size, layout.dcp_rank, config.interleave, kv_keep)
    backend = DCPBackend(config, layout)
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=False)
    model._dcp_state = DCPState(config, layout, backend, pool)
    return compiled


def state(compiled: nn.Module) -> DCPState:
    """The DCPState of a module returned by apply()."""
    inner = getattr(compiled, "_orig_mod", compiled)
    if not hasattr(inner, "_dcp_state"):
        raise ValueError("this module was not produced by dcp_compile.apply")
    return inner._dcp_state
