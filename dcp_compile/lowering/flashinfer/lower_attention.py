"""Lower attention over the KV pool to FlashInfer's batch MLA kernel (fa3).

    before: o, lse = dcp.mla_partial_attention(q_lat [T,H,R], q_rope, cache, *local_meta, ids, pos, s)
            (at dcp_size 1: o = dcp.mla_attention(q_lat, q_rope, cache, req_to_token, seq_lens, ids, pos, s))
    after (decode, T == B; or any graph at dcp_size 1):
            o, lse = dcp_flashinfer.mla_paged_attention(q_lat, q_rope, cache, plan)
                     plan: every local key of a row; causal (queries aligned to the end) at dcp_size 1
    after (verify, short extend under DCP: T != B, at most 16 queries a row):
            o, lse = dcp_flashinfer.mla_paged_attention(q_lat, q_rope, cache, plan)
                     plan: the local keys before the row's first query, no mask
            o, lse = dcp.window_attention(o, lse, q_lat, q_rope, cache, *local_meta, ids, pos, s, 16)

`plan` is a host-fed graph input (`dcp_flashinfer_plan_<i>`, lowering/paged.HostPlaceholders),
one per kind of plan the graph needs, shared by every layer; the graph's FlashInferFeed plans
it from each step's host metadata before the graph runs or replays (plans.py). gm.meta holds
the plans' specs. Why the split under DCP: docs/paged-lowerings.md.

Assumes: gather_q_attention ran (dcp_size > 1) or the graph is the canonical one (dcp_size 1);
pages map onto whole local blocks (FlashInfer's page size); the queries of a row are the last
query_lens[b] positions of its sequence, grouped by row (RequestTable's batches), which debug
mode checks (dcp.check_host_metadata).
Guarantees: every attention over the pool in a gather-q graph runs FlashInfer; out and lse keep
mla_partial_attention's contract (out in q's dtype, fp32 natural-log lse).
Why a pass: the kernel depends on the deployment (a Hopper GPU with FlashInfer), not the model.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from dcp_compile.lowering import paged
from dcp_compile.lowering.flashinfer import ensure_ops
from dcp_compile.lowering.flashinfer.plans import PLAN_INPUT, PLAN_SPECS, PlanSpec, kv_indices_size
from dcp_compile.passes.base import PassConfig
from dcp_compile.passes.graph_utils import call, fake_value
from dcp_compile.runtime import layout


def flashinfer_block_size(page_size: int, dcp_size: int, interleave: int) -> int:
    return layout.require_local_block_size(page_size, dcp_size, interleave, "the FlashInfer lowering (its CSR page list)")


class LowerFlashInferAttention(paged.PagedAttentionPass):
    name = "lower_flashinfer_attention"
    reader = "the FlashInfer lowering under DCP"

    def prepare(self, gm: fx.GraphModule) -> None:
        ensure_ops()
        self._plans: dict[PlanSpec, fx.Node] = {}

    def block_size(self, config: PassConfig) -> int:
        return flashinfer_block_size(config.page_size, config.dcp_size, config.interleave)

    def split(self, config: PassConfig, site) -> bool:
        return config.dcp_size > 1  # at dcp_size 1 FlashInfer's own causal mask is exact

    def kernel(self, graph, site, q_latent, q_rope, decode, host, block_table, block_size):
        tokens, heads, rank_dim = fake_value(q_latent).shape
        split = site.key_positions is not None  # under DCP (gather_q_attention's partial attention)
        spec = PlanSpec(keys="prefix" if split and not decode else "all", causal=not split and not decode,
                        rows=host.rows, tokens=tokens, heads=heads, rank_dim=rank_dim,
                        rope_dim=fake_value(q_rope).shape[-1], block_size=block_size, blocks_per_row=host.blocks,
                        sm_scale=site.sm_scale, dtype=fake_value(q_latent).dtype, device=host.device)
        if spec not in self._plans:
            self._plans[spec] = host.tensor(PLAN_INPUT, len(self._plans), (kv_indices_size(spec),), torch.int32)
        attention = call(graph, torch.ops.dcp_flashinfer.mla_paged_attention.default, q_latent, q_rope, site.cache,
                         self._plans[spec])
        return tuple(call(graph, operator.getitem, attention, i) for i in range(2))

    def finish(self, gm: fx.GraphModule, config: PassConfig) -> int:
        if self._plans:
            gm.meta[PLAN_SPECS] = list(self._plans)
        return 0
