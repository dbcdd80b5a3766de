"""The host-fed inputs of a graph lowered to FIA, and what an NPU graph bakes in of them."""

from __future__ import annotations

import torch.fx as fx

from dcp_compile.lowering.npu.lower_attention import fia_op
from dcp_compile.runtime.host_inputs import HOST_INPUT, HostFeed, host_placeholders
from dcp_compile.runtime.host_metadata import RankHostMetadata


class FIAFeed(HostFeed):
    """FIA's lengths and block table for each step. An NPU graph bakes FIA's host lists into the
    tiling it captures: `graph_updates` gives them for `NPUGraph.update(cpu_update_input=...)`,
    one dict per FIA call in graph order, keyed by FIA's argument names (docs/ascend.md §9.3)."""

    def __init__(self, gm: fx.GraphModule, dcp_rank: int):
        table = next(n for n in host_placeholders(gm.graph) if n.meta[HOST_INPUT].kind == "block_table")
        super().__init__(gm.graph, dcp_rank, rows=table.meta["val"].shape[0])
        self.fia_args = [
            {name: value[0].meta[HOST_INPUT].kind for name, value in node.kwargs.items()
             if isinstance(value, (list, tuple)) and value and isinstance(value[0], fx.Node)}
            for node in gm.graph.nodes if node.op == "call_function" and node.target is fia_op()
        ]
        """Per FIA call, in order: {FIA argument: the host length kind it takes}."""

    def graph_updates(self, host: RankHostMetadata) -> list[dict]:
        lists = {"local_len": list(host.local_seq_lens), "local_prefix_len": list(host.local_prefix_lens),
                 "cumulative_query_len": host.cumulative_query_lens}
        return [{argument: lists[kind] for argument, kind in call.items()} for call in self.fia_args]
