"""Lower attention over the KV pool to FlashInfer's batch MLA kernel (fa3).

    before: o, lse = dcp.mla_partial_attention(q_lat [T,H,R], q_rope, cache, *local_meta, ids, pos, s)
            (at dcp_size 1: o = dcp.mla_attention(q_lat, q_rope, cache, req_to_token, seq_lens, ids, pos, s))
    after (decode, T == B; or any graph at dcp_size 1):
            o, lse = dcp_flashinfer.mla_paged_attention(q_lat, q_rope, cache, plan_id)
                     plan: every local key of a row; causal (queries aligned to the end) at dcp_size 1
    after (verify, short extend under DCP: T != B, at most 16 queries a row):
            o, lse = dcp_flashinfer.mla_paged_attention(q_lat, q_rope, cache, plan_id)
                     plan: the local keys before the row's first query, no mask
            o, lse = dcp.window_attention(o, lse, q_lat, q_rope, cache, *local_meta, ids, pos, s, 16)

The plan (lowering/flashinfer/plans.py) is made on the host from the step's host metadata before
the graph runs or replays, once for every layer of the graph; the graph holds only its id.
gm.meta['dcp_flashinfer_plans'] lists the plans of the graph, for the backend and the graph
runner.

Verify's causal mask is by global position. FlashInfer's causal mask aligns queries to the end of
the keys, which on a shard is wrong (a rank holds some of the draft tokens' keys, not all), so
under DCP the pass splits as lower_npu_attention does: the keys before a row's first query are
visible to all its queries (one unmasked FlashInfer call) and the <= k keys at or after it go
through window attention (a small Triton kernel on CUDA), merged by LSE. At dcp_size 1 the keys
are the whole sequence, and FlashInfer's own causal mask is exact.

Assumes: rewrite_attention ran (dcp_size > 1) or the graph is the canonical one (dcp_size 1);
pages map onto whole local blocks (runtime/layout.local_block_size: FlashInfer's page size);
the queries of a row are the last query_lens[b] positions of its sequence, grouped by row
(RequestTable's batches), which debug mode checks against the plan (dcp_flashinfer.check_plan).
Guarantees: every attention over the pool in a gather-q graph runs FlashInfer; out and lse keep
mla_partial_attention's contract (out in q's dtype, fp32 natural-log lse).
Why a pass: the kernel depends on the deployment (a Hopper GPU with FlashInfer), not the model.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from dcp_compile.lowering.flashinfer import ensure_ops
from dcp_compile.passes import sites
from dcp_compile.passes.base import GraphPass, PassConfig
from dcp_compile.passes.graph_utils import call, fake_value, replace_attention
from dcp_compile.runtime import layout
from dcp_compile.runtime.host_metadata import block_table_width

aten = torch.ops.aten
MAX_WINDOW_QUERY_TOKENS = 16
"""Verify and extend rows under DCP carry at most this many queries here (window attention's
window); longer chunks take the gather-kv strategy."""


def flashinfer_block_size(config: PassConfig) -> int:
    return layout.require_local_block_size(config.page_size, config.dcp_size, config.interleave,
                                           "the FlashInfer lowering (its CSR page list)")


class LowerFlashInferAttention(GraphPass):
    name = "lower_flashinfer_attention"

    def applies(self, config: PassConfig) -> bool:
        return config.kernels == "flashinfer" and config.attention_strategy == "gather-q"

    def run(self, gm: fx.GraphModule, config: PassConfig) -> int:
        ensure_ops()
        from dcp_compile.lowering.flashinfer.plans import FlashInferPlan, PlanSpec

        graph = gm.graph
        found = sites.find_pool_attention(graph, config.dcp_size)
        if not found:
            return 0
        block_size = flashinfer_block_size(config)
        plans: dict[PlanSpec, FlashInferPlan] = {}
        checked: set[int] = set()
        for site in found:
            tokens, heads, rank_dim = fake_value(site.q_latent).shape
            rows, width = fake_value(site.req_to_token).shape
            decode = tokens == rows
            split = config.dcp_size > 1 and not decode
            if split and tokens > MAX_WINDOW_QUERY_TOKENS * rows:
                raise ValueError(f"the FlashInfer lowering serves at most {MAX_WINDOW_QUERY_TOKENS} query tokens per row "
                                 f"under DCP; this graph has {tokens} tokens over {rows} rows: longer chunks go through "
                                 "the gather-kv strategy")
            cache = fake_value(site.cache)
            spec = PlanSpec(keys="prefix" if split else "all", causal=config.dcp_size == 1 and not decode, rows=rows,
                            tokens=tokens, heads=heads, rank_dim=rank_dim, rope_dim=fake_value(site.q_rope).shape[-1],
                            block_size=block_size, blocks_per_row=block_table_width(width, config.page_size),
                            sm_scale=site.sm_scale, dtype=fake_value(site.q_latent).dtype, device=cache.device)
            plan = plans.get(spec) or plans.setdefault(spec, FlashInferPlan(spec))
            with graph.inserting_before(site.node):
                out, lse = self._attention(graph, site, plan, config, split, checked, width)
            replace_attention(graph, site.node, site.returns_lse, out, lse, self.name)
        gm.meta["dcp_flashinfer_plans"] = [plan.id for plan in plans.values()]
        return len(found)

    @staticmethod
    def _attention(graph, site, plan, config: PassConfig, split: bool, checked: set[int], width: int):
        q_latent, q_rope = site.q_latent, site.q_rope
        if fake_value(q_rope).dtype != fake_value(q_latent).dtype:
            q_rope = call(graph, aten._to_copy.default, q_rope, dtype=fake_value(q_latent).dtype)
        if config.debug_checks and plan.id not in checked:
            checked.add(plan.id)
            q_latent = call(graph, torch.ops.dcp_flashinfer.check_plan.default, q_latent, site.req_to_token, site.seq_lens,
                            site.q_seq_ids, site.q_positions, plan.id, config.dcp_rank, config.dcp_size, config.interleave)
        attention = call(graph, torch.ops.dcp_flashinfer.mla_paged_attention.default, q_latent, q_rope, site.cache, plan.id)
        out, lse = (call(graph, operator.getitem, attention, i) for i in range(2))
        if split:
            window = call(graph, torch.ops.dcp.window_attention.default, out, lse, q_latent, q_rope, site.cache,
                          site.page_table, site.local_lens, site.key_positions, site.q_seq_ids, site.q_positions,
                          site.sm_scale, min(MAX_WINDOW_QUERY_TOKENS, width))
            out, lse = (call(graph, operator.getitem, window, i) for i in range(2))
        return out, lse
