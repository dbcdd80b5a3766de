"""Rewrite each MLA attention into DCP: Q all-gather, local partial attention, one packed
all-to-all carrying out + fp32 LSE, and the LSE merge.

    before: o = mla_attention(q_lat [T,H,R], q_rope [T,H,P], cache, req_to_token, seq_lens, ids, pos, s)
    after:  q   = wait(all_gather_into_tensor(cat(q_lat, q_rope), N, dcp_group))   # [N*T, H, R+P]
            q   = q.view(N, T, H, R+P).transpose(0, 1).reshape(T, N*H, R+P)        # peer-major heads
            o, lse = dcp.mla_partial_attention(q[..., :R], q[..., R:], cache, *meta, ids, pos, s)
            buf = wait(all_to_all_single(dcp.pack_partials(o, lse, N), dcp_group))  # [N, T, H, R+w]
            o   = dcp.merge_partials(buf, R)                                        # [T, H, R]

Assumes: local_metadata ran (it supplies `meta`); the DCP group holds the N TP ranks whose heads
are gathered, in rank order (runtime/parallel.py).
Guarantees: each rank ends with exactly its own heads; the collectives are visible graph nodes;
an already-rewritten site (no mla_attention left) is not touched again; q_latent and q_rope keep
their dtypes through the gather (the cat promotes, the slices are cast back), and the merged
output has the replaced node's dtype and shape (checked).
Why a pass: the exchange pattern is the same for every MLA model, and keeping the collectives
in the graph lets later passes fuse, overlap and measure them.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from dcp_compile.passes import sites
from dcp_compile.passes.base import GraphPass, PassConfig
from dcp_compile.passes.graph_utils import call, fake_value
from dcp_compile.ops import targets

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def group_name(config: PassConfig) -> str:
    if config.dcp_group_name is None:
        raise RuntimeError("DCP attention rewrites need a DCP process group name when dcp_size > 1")
    return config.dcp_group_name


def _as_dtype(graph: fx.Graph, node: fx.Node, dtype: torch.dtype) -> fx.Node:
    """The gathered q is one tensor in the promoted dtype of q_latent and q_rope (a model may keep
    rope in fp32); each part goes back to its own dtype, exactly, so the partial attention sees
    what dcp_size=1 sees and returns q_latent's dtype."""
    if fake_value(node).dtype == dtype:
        return node
    return call(graph, aten._to_copy.default, node, dtype=dtype)


def packed_partial_attention(graph: fx.Graph, site: sites.AttentionSite, meta: fx.Node, q_latent: fx.Node,
                             q_rope: fx.Node, parts: int) -> fx.Node:
    """The site's partial attention over the rank's shard (its local metadata `meta`), out and lse
    packed for `parts` destinations (dcp.pack_partials)."""
    local = [call(graph, operator.getitem, meta, i) for i in range(3)]
    partial = call(graph, targets.PARTIAL_ATTENTION, q_latent, q_rope, site.cache, *local,
                   site.q_seq_ids, site.q_positions, site.sm_scale)
    out, lse = (call(graph, operator.getitem, partial, i) for i in range(2))
    return call(graph, targets.PACK_PARTIALS, out, lse, parts)


class GatherQAttention(GraphPass):
    name = "gather_q_attention"

    def applies(self, config: PassConfig) -> bool:
        return config.dcp_size > 1 and config.attention_strategy == "gather-q"

    def run(self, gm: fx.GraphModule, config: PassConfig) -> int:
        graph, n = gm.graph, config.dcp_size
        group = group_name(config)

        def rewrite(site: sites.AttentionSite, meta: fx.Node) -> fx.Node:
            _, heads, rank_dim = fake_value(site.q_latent).shape
            row_dim = rank_dim + fake_value(site.q_rope).shape[-1]
            q = call(graph, aten.cat.default, [site.q_latent, site.q_rope], -1)
            q = call(graph, c10d.wait_tensor.default, call(graph, c10d.all_gather_into_tensor.default, q, n, group))
            # -1 for the token count: a symbolic graph's is a SymInt, which no node argument may hold.
            q = call(graph, aten.view.default, q, [n, -1, heads, row_dim])
            q = call(graph, aten.transpose.int, q, 0, 1)
            q = call(graph, aten.reshape.default, q, [-1, n * heads, row_dim])
            q_latent = _as_dtype(graph, call(graph, aten.slice.Tensor, q, -1, 0, rank_dim), fake_value(site.q_latent).dtype)
            q_rope = _as_dtype(graph, call(graph, aten.slice.Tensor, q, -1, rank_dim, row_dim), fake_value(site.q_rope).dtype)
            packed = packed_partial_attention(graph, site, meta, q_latent, q_rope, n)
            exchanged = call(graph, c10d.all_to_all_single.default, packed, [1] * n, [1] * n, group)
            exchanged = call(graph, c10d.wait_tensor.default, exchanged)
            return call(graph, targets.MERGE_PARTIALS, exchanged, rank_dim)

        return sites.rewrite_attention_sites(graph, self.name, rewrite)
