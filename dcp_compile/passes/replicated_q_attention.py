"""Rewrite each MLA attention into DCP for replicated heads: every rank of the DCP group already
has every head's query (no TP split of the attention), so there is no Q all-gather.

    before: o = mla_attention(q_lat [T,H,R], q_rope [T,H,P], cache, req_to_token, seq_lens, ids, pos, s)
    after:  o, lse = dcp.mla_partial_attention(q_lat, q_rope, cache, *meta, ids, pos, s)   # all H heads, own shard
            buf = wait(all_gather_into_tensor(dcp.pack_partials(o, lse, 1), N, dcp_group))  # [N, T, H, R+w]
            o   = dcp.merge_partials(buf, R)                                                 # [T, H, R]

Assumes: local_metadata ran (it supplies `meta`); every rank of the DCP group runs the same
queries (the same tokens through the same replicated weights: transformers' DeepSeek-V3 TP plan
leaves attention replicated, and a tp_size 1 model is replicated by definition).
Guarantees: every rank ends with the merged output of every head, equal on all ranks; one
all-gather of (out, fp32 LSE) per layer, a visible collective; already-rewritten graphs are left
alone; the merged output has the replaced node's dtype and shape (checked).
Why a pass: the same model code runs replicated or head-split; only the deployment knows which.
The Q all-gather of gather_q_attention would gather N copies of the same heads and attend N
times over them.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from dcp_compile.ops import targets
from dcp_compile.passes import sites
from dcp_compile.passes.base import GraphPass, PassConfig
from dcp_compile.passes.gather_q_attention import group_name, packed_partial_attention
from dcp_compile.passes.graph_utils import call, fake_value

c10d = torch.ops._c10d_functional

STRATEGY = "replicated-q"


class ReplicatedQAttention(GraphPass):
    name = "replicated_q_attention"

    def applies(self, config: PassConfig) -> bool:
        return config.dcp_size > 1 and config.attention_strategy == STRATEGY

    def run(self, gm: fx.GraphModule, config: PassConfig) -> int:
        graph, n = gm.graph, config.dcp_size
        group = group_name(config)

        def rewrite(site: sites.AttentionSite, meta: fx.Node) -> fx.Node:
            packed = packed_partial_attention(graph, site, meta, site.q_latent, site.q_rope, 1)
            gathered = call(graph, c10d.all_gather_into_tensor.default, packed, n, group)
            gathered = call(graph, c10d.wait_tensor.default, gathered)
            return call(graph, targets.MERGE_PARTIALS, gathered, fake_value(site.q_latent).shape[-1])

        return sites.rewrite_attention_sites(graph, self.name, rewrite)
