"""Build each rank's local attention metadata once per graph, shared by every MLA layer.

    before: a1 = mla_attention(..., req_to_token, seq_lens, ...); a2 = mla_attention(...same...)
    after:  meta = dcp.local_metadata(req_to_token, seq_lens, r, N, I)   # before a1, once
            a1, a2 unchanged (gather_q_attention consumes `meta`)

Assumes: every attention over the same (req_to_token, seq_lens) inputs sees the same layout.
Guarantees: one local_metadata node per distinct metadata input pair, placed before its first
user; running the pass again adds nothing.
Why a pass: the local view depends on r and N, which model code must not know.
"""

from __future__ import annotations

import torch.fx as fx

from dcp_compile.passes import sites
from dcp_compile.passes.base import GraphPass, PassConfig
from dcp_compile.passes.graph_utils import call
from dcp_compile.ops import targets


class LocalMetadata(GraphPass):
    name = "local_metadata"

    def applies(self, config: PassConfig) -> bool:
        return config.dcp_size > 1

    def run(self, gm: fx.GraphModule, config: PassConfig) -> int:
        existing = sites.find_local_metadata(gm.graph)
        added = 0
        for site in sites.find_attention_sites(gm.graph):
            key = (site.req_to_token, site.seq_lens)
            if key in existing:
                continue
            with gm.graph.inserting_before(site.node):
                existing[key] = call(gm.graph, targets.LOCAL_METADATA, site.req_to_token, site.seq_lens,
                                     config.dcp_rank, config.dcp_size, config.interleave)
            added += 1
        return added
