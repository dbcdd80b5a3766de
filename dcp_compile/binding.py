"""The binding step: a config and a KV pool bound to one kernel back end, every 'auto' resolved.

    binding = bind(config, pool, model)      # every check that needs the back end, in one order
    binding.shard_pool(dcp_rank, kv_keep)    # the pool as this rank's shard, in the back end's layout

apply() (dcp_compile/api.py), each front end (dcp_compile/hf/model.py) and the dump's shape-only
capture (dcp_compile/debug/fake_capture.py) bind through here, so they resolve the same back end,
refuse the same configs with the same errors, and lay the pool out the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from dcp_compile.config import DCPConfig
from dcp_compile.lowering import registry
from dcp_compile.lowering.base import Lowering
from dcp_compile.runtime.kv_pool import MLAKVPool
from dcp_compile.strategy import REPLICATED_Q


@dataclass(frozen=True)
class Binding:
    """What bind() decided; the pool is not resharded yet (shard_pool)."""

    config: DCPConfig
    """The config with `kernels` the back end's name and every 'auto' the back end and pool decide resolved."""
    lowering: Lowering
    """The back end, configured with the config's options for it."""
    pool: MLAKVPool
    strategies: tuple[str, ...]
    """The attention strategies to compile, one backend each."""

    def shard_pool(self, dcp_rank: int, kv_keep: str = "memory") -> None:
        """Reallocate the pool as rank `dcp_rank`'s shard of the DCP group, held as the back end
        lays it out. Before any KV is written (the pool raises otherwise)."""
        self.pool.reshard(self.config.dcp_size, dcp_rank, self.config.interleave, kv_keep)
        self.pool.use_layout(self.lowering.kv_layout)


def bind(config: DCPConfig, pool: MLAKVPool, model: nn.Module | None = None, *, replicated: bool = False) -> Binding:
    """Bind `config` to the back end its `kernels` names for `pool` (for 'auto', the one for the
    pool's device), check both, resolve the 'auto's and prepare the back end.

    model: what the back end's checks read of the model (e.g. its local head count), if any.
    replicated: every rank runs every head (the replicated-q strategy, which every back end's
    partial attention serves: gather-q's over the local shard, for the rank's own heads).
    Raises, before anything is allocated or built, for a config the back end cannot serve."""
    lowering = registry.resolve(config.kernels, pool, config)
    lowering = lowering.configured(registry.options_for(lowering, config.options))  # an option it does not read raises
    lowering = lowering.configured(lowering.resolve_options(pool))
    config = config.replace(kernels=lowering.name, options=lowering.options)
    if config.inner_compile == "auto":
        config = config.replace(inner_compile=lowering.inner_compile(pool))
    if config.fuse_projections == "auto":
        config = config.replace(fuse_projections="on" if lowering.fuse_projections(pool) else "off")
    lowering.check(pool, config, model)
    lowering.prepare(pool, config)
    if replicated:
        strategies = (REPLICATED_Q,) if config.dcp_size > 1 else ("gather-q",)
    else:
        strategies = lowering.strategies(config.dcp_size)
    return Binding(config, lowering, pool, strategies)
