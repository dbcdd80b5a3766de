"""Shard KV writes by token: each rank writes only the locations it owns, at local rows.

    before: mla_kv_write(cache, latent, rope, loc)
    after:  sharded_kv_write(cache, latent, rope, loc, r, N, I, None)   # rope_cache: the split layout's

Assumes: `cache` is this rank's shard of the pool (apply() resharded it before capture).
Guarantees: every location != 0 is written by exactly one rank of the DCP group; the op keeps
mutates_args, so dead-code elimination cannot drop it.
Why a pass: model code stays DCP-agnostic; only the deployment knows N, r and I.
"""

from __future__ import annotations

import torch.fx as fx

from dcp_compile.passes import sites
from dcp_compile.passes.base import GraphPass, PassConfig
from dcp_compile.passes.graph_utils import call
from dcp_compile.ops import targets


class ShardKVWrite(GraphPass):
    name = "shard_kv_write"

    def applies(self, config: PassConfig) -> bool:
        return config.dcp_size > 1

    def run(self, gm: fx.GraphModule, config: PassConfig) -> int:
        writes = sites.find_kv_writes(gm.graph)
        for site in writes:
            with gm.graph.inserting_before(site.node):
                call(gm.graph, targets.SHARDED_KV_WRITE, site.cache, site.latent, site.rope, site.loc,
                     config.dcp_rank, config.dcp_size, config.interleave, None)
        for site in writes:
            gm.graph.erase_node(site.node)
        return len(writes)
