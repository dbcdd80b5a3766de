"""Remove what the rewrites left dead and recompile the module.

Guarantees: every node that writes state survives, whether its result is read or not: mutating
op overloads (KV writes), in-place methods and functions (a model's `self.counter.add_(1)`,
`buf.index_copy_(...)`), `out=` calls and item assignments; pure nodes with no users go.
FX's own rule would drop the in-place methods, since it treats every call_method as pure.
"""

from __future__ import annotations

import torch.fx as fx

from dcp_compile.passes.base import GraphPass, PassConfig
from dcp_compile.passes.graph_utils import keeps_state


class Cleanup(GraphPass):
    name = "cleanup"

    def run(self, gm: fx.GraphModule, config: PassConfig) -> int:
        before = len(gm.graph.nodes)
        gm.graph.eliminate_dead_code(is_impure_node=keeps_state)
        gm.recompile()
        return before - len(gm.graph.nodes)
