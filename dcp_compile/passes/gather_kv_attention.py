"""Rewrite each MLA attention into the gather-kv strategy: all-gather this batch's KV rows from
every shard, then attend with this rank's own heads over all of them. No merge is needed.

    before: o = mla_attention(q_lat, q_rope, cache, req_to_token, seq_lens, ids, pos, s)
    after:  rows = dcp.gather_local_rows(cache, *local_meta[:2])                  # [B, L, D]
            rows = wait(all_gather_into_tensor(rows, N, dcp_group)).view(N*B*L, D)
            o, _ = dcp.mla_partial_attention(q_lat, q_rope, rows, *gathered_meta, ids, pos, s)

Assumes: local_metadata ran; `gathered_meta` (one per graph, inserted here) indexes the gathered
rows in rank order, which all_gather_into_tensor guarantees.
Guarantees: numerically the same attention as dcp_size=1; each rank keeps its own heads; the
collective is a visible node; already-rewritten graphs (no mla_attention) are left alone.
Why a pass: for long chunks over short prefixes, moving the KV is cheaper than moving Q and
partials; the cost model picks the strategy per batch and each strategy is its own graph.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from dcp_compile.passes import sites
from dcp_compile.passes.base import GraphPass, PassConfig
from dcp_compile.passes.graph_utils import call, fake_value
from dcp_compile.passes.gather_q_attention import group_name
from dcp_compile.ops import targets

c10d = torch.ops._c10d_functional


class GatherKVAttention(GraphPass):
    name = "gather_kv_attention"

    def applies(self, config: PassConfig) -> bool:
        return config.dcp_size > 1 and config.attention_strategy == "gather-kv"

    def run(self, gm: fx.GraphModule, config: PassConfig) -> int:
        graph, n = gm.graph, config.dcp_size
        group = group_name(config)
        gathered: dict[tuple, list[fx.Node]] = {}

        def rewrite(site: sites.AttentionSite, meta: fx.Node) -> fx.Node:
            key = (site.req_to_token, site.seq_lens)
            row_dim = fake_value(site.cache).shape[-1]
            if key not in gathered:
                gathered_meta = call(graph, targets.GATHERED_KV_METADATA, *key, n, config.interleave)
                gathered[key] = [call(graph, operator.getitem, gathered_meta, i) for i in range(3)]
            local_page, local_lens = (call(graph, operator.getitem, meta, i) for i in range(2))
            rows = call(graph, targets.GATHER_LOCAL_ROWS, site.cache, local_page, local_lens)
            rows = call(graph, c10d.wait_tensor.default, call(graph, c10d.all_gather_into_tensor.default, rows, n, group))
            rows = call(graph, torch.ops.aten.view.default, rows, [-1, row_dim])  # N*B*L rows; B may be symbolic
            partial = call(graph, targets.PARTIAL_ATTENTION, site.q_latent, site.q_rope, rows, *gathered[key],
                           site.q_seq_ids, site.q_positions, site.sm_scale)
            return call(graph, operator.getitem, partial, 0)

        return sites.rewrite_attention_sites(graph, self.name, rewrite)
