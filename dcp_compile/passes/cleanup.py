"""Remove what the rewrites left dead and recompile the module.

Guarantees: mutating ops (KV writes) survive, since their schemas are mutable and FX treats them
as impure; pure nodes with no users go.
"""

from __future__ import annotations

import torch.fx as fx

from dcp_compile.passes.base import GraphPass, PassConfig


class Cleanup(GraphPass):
    name = "cleanup"

    def run(self, gm: fx.GraphModule, config: PassConfig) -> int:
        before = len(gm.graph.nodes)
        gm.graph.eliminate_dead_code()
        gm.recompile()
        return before - len(gm.graph.nodes)
