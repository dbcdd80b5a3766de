"""Rewrite each MLA attention into DCP for replicated heads: every rank of the DCP group already
has every head's query (no TP split of the attention), so there is no Q all-gather.

    before: o = mla_attention(q_lat [T,H,R], q_rope [T,H,P], cache, req_to_token, seq_lens, ids, pos, s)
    after (N = 2, or H not divisible by N):
            o, lse = dcp.mla_partial_attention(q_lat, q_rope, cache, *meta, ids, pos, s)   # all H heads, own shard
            buf = wait(all_gather_into_tensor(dcp.pack_partials(o, lse, 1), N, dcp_group))  # [N, T, H, R+w]
            o   = dcp.merge_partials(buf, R)                                                 # [T, H, R]
    after (N > 2, H divisible by N): each rank merges H/N heads, then the merged heads are gathered
            buf = wait(all_to_all_single(dcp.pack_partials(o, lse, N), dcp_group))         # [N, T, H/N, R+w]
            own = dcp.merge_partials(buf, R)                                                # [T, H/N, R]
            o   = wait(all_gather_into_tensor(own, N, dcp_group)), heads back in order       # [T, H, R]

A rank receives (N - 1) x T x H x (R + w) values through the all-gather of partials, and
(N - 1) / N x T x H x (2R + w) through the all-to-all and the all-gather of merged heads: the same
at N = 2 (where one collective is cheaper), 2 to 4 times less at N = 4 to 8.

Assumes: local_metadata ran (it supplies `meta`); every rank of the DCP group runs the same
queries (the same tokens through the same replicated weights: transformers' DeepSeek-V3 TP plan
leaves attention replicated, and a tp_size 1 model is replicated by definition).
Guarantees: every rank ends with the merged output of every head, equal on all ranks; the
collectives are visible graph nodes; already-rewritten graphs are left alone; the merged output
has the replaced node's dtype and shape (checked).
Why a pass: the same model code runs replicated or head-split; only the deployment knows which.
The Q all-gather of gather_q_attention would gather N copies of the same heads and attend N
times over them.
"""

from __future__ import annotations


import torch
import torch.fx as fx

from dcp_compile.ops import targets
from dcp_compile.passes import sites
from dcp_compile.passes.base import GraphPass, PassConfig
from dcp_compile.passes.gather_q_attention import group_name, packed_partial_attention
from dcp_compile.passes.graph_utils import call, fake_value

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

STRATEGY = "replicated-q"


def exchanges_heads(dcp_size: int, heads: int) -> bool:
    """Whether the partials go through an all-to-all and the merged heads through an all-gather
    (N > 2 and H divisible by N), rather than one all-gather of every head's partials."""
    return dcp_size > 2 and heads % dcp_size == 0


class ReplicatedQAttention(GraphPass):
    name = "replicated_q_attention"

    def applies(self, config: PassConfig) -> bool:
        return config.dcp_size > 1 and config.attention_strategy == STRATEGY

    def run(self, gm: fx.GraphModule, config: PassConfig) -> int:
        graph, n = gm.graph, config.dcp_size
        group = group_name(config)

        def rewrite(site: sites.AttentionSite, meta: fx.Node) -> fx.Node:
            _, heads, rank_dim = fake_value(site.q_latent).shape
            if not exchanges_heads(n, heads):
                packed = packed_partial_attention(graph, site, meta, site.q_latent, site.q_rope, 1)
                gathered = call(graph, c10d.all_gather_into_tensor.default, packed, n, group)
                gathered = call(graph, c10d.wait_tensor.default, gathered)
                return call(graph, targets.MERGE_PARTIALS, gathered, rank_dim)
            packed = packed_partial_attention(graph, site, meta, site.q_latent, site.q_rope, n)
            exchanged = call(graph, c10d.all_to_all_single.default, packed, [1] * n, [1] * n, group)
            own = call(graph, targets.MERGE_PARTIALS, call(graph, c10d.wait_tensor.default, exchanged), rank_dim)
            gathered = call(graph, c10d.wait_tensor.default, call(graph, c10d.all_gather_into_tensor.default, own, n, group))
            # [N*T, H/N, R], rank r's rows holding heads r*H/N ...: back to [T, H, R] (-1: a SymInt token count)
            gathered = call(graph, aten.view.default, gathered, [n, -1, heads // n, rank_dim])
            gathered = call(graph, aten.transpose.int, gathered, 0, 1)
            return call(graph, aten.reshape.default, gathered, [-1, heads, rank_dim])

        return sites.rewrite_attention_sites(graph, self.name, rewrite)
