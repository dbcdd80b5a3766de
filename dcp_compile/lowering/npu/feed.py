"""The host-fed inputs of a graph lowered to FIA, and what an NPU graph bakes in of them."""

from __future__ import annotations

import torch
import torch.fx as fx

from dcp_compile.lowering.npu.lower_attention import fia_ops
from dcp_compile.runtime import devices
from dcp_compile.runtime.host_inputs import HOST_INPUT, HostFeed
from dcp_compile.lowering.npu import pieces as batch_pieces
from dcp_compile.ops.targets import WINDOW_QUERIES
from dcp_compile.runtime.host_metadata import RankHostMetadata

KV_LENGTH_KINDS = ("local_len", "local_prefix_len", "piece_prefix_len")
"""The host length kinds FIA takes as KV lengths (`actual_seq_lengths_kv`, v2 `actual_seq_kvlen`)."""


class FIAFeed(HostFeed):
    """FIA's lengths and block table for each step. An NPU graph bakes FIA's host lists into the
    tiling it captures: `graph_updates` gives them for `NPUGraph.update(cpu_update_input=...)`,
    one dict per FIA call of this graph, in graph order, keyed by FIA's argument names
    (docs/ascend.md §9.3). A compile region's graph runs once per call of the region; the step's
    update list holds its dicts once per run, in the order the step ran its graphs
    (runtime/host_inputs.HostSlot.runs).

    While the device captures, FIA is given KV lengths of at least 1: a graph runner captures on
    a fully padded batch, whose lengths are all 0, and FIA's tiling depends on how the lengths
    split (vllm-ascend captures with lengths >= 1). Every replay's update then sets the step's
    real lengths, 0 for padded rows included; the masking of rows without keys reads device
    tensors, not these lengths, so no result changes."""

    def __init__(self, gm: fx.GraphModule, dcp_rank: int):
        super().__init__(gm.graph, dcp_rank)
        self.fia_args = [
            {name: value[0].meta[HOST_INPUT].kind for name, value in node.kwargs.items()
             if isinstance(value, (list, tuple)) and value and isinstance(value[0], fx.Node)}
            for node in gm.graph.nodes if node.op == "call_function" and node.target in fia_ops()
        ]
        """Per FIA call, in order: {FIA argument: the host length kind it takes}."""
        self.rows_of_equal_queries = any("query_len" in call.values() for call in self.fia_args)
        """Whether its FIA calls take BSND verify rows (npu_verify='mask'): S = T / B queries each."""
        fia_keys = [node.args[1].meta["val"] for node in gm.graph.nodes
                    if node.op == "call_function" and node.target in fia_ops() and len(node.args) > 1]
        self.pool_blocks = min((key.shape[0] for key in fia_keys), default=None)
        """The local blocks of the KV shard FIA reads: a block id of the host table must be below it."""
        self.pieces = sum(1 for i in self.inputs if i.kind == "piece_cumulative_query_len")
        """The pieces of its split FIA calls (lower_attention.max_pieces of the graph's shape; 0: none)."""
        examples = (n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder")
        self.device = next((v.device for v in examples if isinstance(v, torch.Tensor) and v.device.type != "cpu"),
                           torch.device("npu"))
        """The device FIA runs on (whose capture values() checks for)."""

    def prepare(self, host: RankHostMetadata) -> None:
        # FIA reads the KV through this table alone (the native lowering reads no page table on
        # the device): a block past the shard would be read on hardware, so every step is checked
        # here, replays included (the model's own check runs only when it is called).
        table = host.block_table
        if self.pool_blocks is not None and table is not None and table.numel() and int(table.max()) >= self.pool_blocks:
            raise IndexError(f"the host block table names local block {int(table.max())}, but the KV shard FIA reads "
                             f"holds {self.pool_blocks} blocks: the request table hands out locations past the pool")
        # A step of such rows runs the graph lowered with the split (NPULowering.step_options): only
        # a replay of a device graph captured for rows of equal counts can get here with others.
        if self.rows_of_equal_queries and len(set(host.query_lens)) > 1:
            raise ValueError(f"this graph was lowered for rows of equal query counts (npu_verify='mask', captured for "
                             f"a verify step of k tokens a row); this batch has query counts {list(host.query_lens)}: "
                             "replay a captured graph only for batches of its tokens per row")

    def lists(self, host: RankHostMetadata) -> dict[str, list[int]]:
        """The pieces of the split FIA calls (pieces.py), padded to the graph's count
        with pieces of no query and no key (FIA's TND lengths may repeat: docs/ascend.md §5.3)."""
        if not self.pieces:
            return {}
        pieces = batch_pieces.pieces(host)
        if len(pieces) > self.pieces:
            raise ValueError(f"this batch cuts into {len(pieces)} pieces of <= {WINDOW_QUERIES} queries; the graph was "
                             f"lowered for {self.pieces}")
        extra = self.pieces - len(pieces)
        tokens = sum(host.query_lens)
        token_piece = [piece for piece, (_, _, count) in enumerate(pieces) for _ in range(count)]
        cumulative = [first + count for _, first, count in pieces]
        return {"piece_cumulative_query_len": cumulative + [tokens] * extra,
                "piece_prefix_len": batch_pieces.piece_prefix_lens(host, pieces) + [0] * extra,
                "piece_row": [row for row, _, _ in pieces] + [0] * extra,
                "token_piece": token_piece}

    def values(self, host: RankHostMetadata) -> list:
        values = super().values(host)
        if not devices.capturing(self.device):
            return values
        # The host ints FIA takes only: the device tensor of every row's lengths (the native
        # lowering's masks) keeps the true values.
        return [max(1, value) if host_input.kind in KV_LENGTH_KINDS and host_input.index is not None else value
                for value, host_input in zip(values, self.inputs)]

    def graph_updates(self, host: RankHostMetadata) -> list[dict]:
        lists = {"local_len": list(host.local_seq_lens), "local_prefix_len": list(host.local_prefix_lens),
                 "cumulative_query_len": host.cumulative_query_lens, "query_len": list(host.query_lens),
                 **self.lists(host)}
        return [{argument: lists[kind] for argument, kind in call.items()} for call in self.fia_args]
