"""Check each attention's query metadata against its sequence lengths (debug-checks mode only).

    before: mla_attention(..., req_to_token, seq_lens, q_seq_ids, q_positions, s)
    after:  pos = dcp.check_metadata(req_to_token, seq_lens, q_seq_ids, q_positions, out_loc)   # once, first
            mla_attention(..., req_to_token, seq_lens, q_seq_ids, pos, s)

Assumes: nothing about the mode; decode, verify and extend all satisfy 0 <= position < seq_len.
Guarantees: positions outside [0, seq_len) of their request, seq_lens wider than the page table,
row ids out of range, negative page-table entries, and a row with seq_len 0 whose tokens write KV
(out_loc, the graph's KV write locations when they are one per query token: a real row taken
for padding) raise ValueError before the first KV write; one check per distinct metadata.
Why a pass: a debug property of the deployment, not of the model.
"""

from __future__ import annotations

import torch.fx as fx

from dcp_compile.passes import sites
from dcp_compile.passes.base import GraphPass, PassConfig
from dcp_compile.passes.graph_utils import call, fake_value, maybe_same_shape
from dcp_compile.ops import targets


class CheckMetadata(GraphPass):
    name = "check_metadata"

    def applies(self, config: PassConfig) -> bool:
        return config.debug_checks

    def run(self, gm: fx.GraphModule, config: PassConfig) -> int:
        checked: dict[tuple, fx.Node] = {}
        rewritten = 0
        writes = sites.find_kv_writes(gm.graph) + sites.find_kv_writes(gm.graph, sharded=True)
        for site in sites.find_attention_sites(gm.graph):
            if isinstance(site.q_positions, fx.Node) and site.q_positions.target is targets.CHECK_METADATA:
                continue
            key = (site.req_to_token, site.seq_lens, site.q_seq_ids, site.q_positions)
            if key not in checked:
                tokens = fake_value(site.q_positions).shape
                out_loc = next((w.loc for w in writes if maybe_same_shape(fake_value(w.loc).shape, tokens)), None)
                with gm.graph.inserting_before(sites.first_kv_write(gm.graph, site.node, writes, (*key, out_loc))):
                    checked[key] = call(gm.graph, targets.CHECK_METADATA, *key, out_loc)
                rewritten += 1
            site.node.replace_input_with(site.q_positions, checked[key])
        return rewritten
