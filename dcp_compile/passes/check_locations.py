"""Guard every KV write with a range check on its locations (debug-checks mode only).

    before: mla_kv_write(cache, latent, rope, loc)
    after:  loc2 = dcp.check_locations(loc, rows(cache), N, I); mla_kv_write(cache, latent, rope, loc2)

Assumes: the cache argument carries a fake value whose first dim is the rows per rank.
Guarantees: a location outside the pool raises IndexError before anything is written; the
checked copy feeds the write, so the check cannot be dead-code eliminated or reordered after it.
Why a pass: the check is a property of the deployment (debug or not), not of the model.
"""

from __future__ import annotations

import torch.fx as fx

from dcp_compile.passes import sites
from dcp_compile.passes.base import GraphPass, PassConfig
from dcp_compile.passes.graph_utils import call, fake_value
from dcp_compile.ops import targets


class CheckLocations(GraphPass):
    name = "check_locations"

    def applies(self, config: PassConfig) -> bool:
        return config.debug_checks

    def run(self, gm: fx.GraphModule, config: PassConfig) -> int:
        writes = sites.find_kv_writes(gm.graph) + sites.find_kv_writes(gm.graph, sharded=True)
        rewritten = 0
        for site in writes:
            if isinstance(site.loc, fx.Node) and site.loc.target is targets.CHECK_LOCATIONS:
                continue
            rows = fake_value(site.cache).shape[0]
            with gm.graph.inserting_before(site.node):
                checked = call(gm.graph, targets.CHECK_LOCATIONS, site.loc, rows, config.dcp_size, config.interleave)
            site.node.replace_input_with(site.loc, checked)
            rewritten += 1
        return rewritten
