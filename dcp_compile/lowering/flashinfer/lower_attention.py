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
Guarantees: every attention over the pool in a gather-q or replicated-q graph runs FlashInfer,
but for a site past its plan's capacity (serves), a verify or extend site where verify_attention is
'folded' (the folded Triton kernel's), or, under replicated-q, a chunk longer than the split
serves (paged.PagedAttentionPass), which the back end's general kernels take; out and lse keep
mla_partial_attention's contract (out in q's dtype, fp32 natural-log lse).
Why a pass: the kernel depends on the deployment (a Hopper GPU with FlashInfer), not the model.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from dcp_compile.lowering import paged
from dcp_compile.lowering.flashinfer import ensure_ops
from dcp_compile.lowering.flashinfer.plans import PLAN_INPUT, PLAN_SPECS, PlanSpec
from dcp_compile.passes.base import PassConfig
from dcp_compile.passes.graph_utils import call, fake_value
from dcp_compile.runtime import layout


MAX_WORK_ITEMS = 16384
"""fa3 MLA's plan capacity (flashinfer 0.7.4, mla/_batch_mla/_backends/_fa_common.py,
_FA_MAX_WORK_ITEMS): its plan raises "FA MLA needs at least N work items" past it."""


def work_items_bound(tokens, rows, heads):
    """An upper bound on fa3's work items for `tokens` queries over `rows` rows, without a branch
    (a graph symbolic in the batch shape guards only on the bound itself): per row, its query
    rows x heads in tiles of 128 where a row averages over 64 of them, else 64, as
    _fa_plan_work_count counts them, plus one tile a row for the ceil. Where a row averages at
    most 64, ceil(T x H / 64) + B <= 2B + 1 <= ceil(T x H / 128) + 2B."""
    return -(-tokens * heads // 128) + 2 * rows


def flashinfer_block_size(page_size: int, dcp_size: int, interleave: int) -> int:
    return layout.require_local_block_size(page_size, dcp_size, interleave, "the FlashInfer lowering (its CSR page list)")


class LowerFlashInferAttention(paged.PagedAttentionPass):
    name = "lower_flashinfer_attention"
    reader = "the FlashInfer lowering under DCP"
    reads_block_table = False  # its plan reads the host's table

    def __init__(self, fold_verify: bool = False):
        self.fold_verify = fold_verify

    def prepare(self, gm: fx.GraphModule) -> None:
        ensure_ops()
        self._plans: dict[PlanSpec, fx.Node] = {}

    def block_size(self, config: PassConfig) -> int:
        return flashinfer_block_size(config.page_size, config.dcp_size, config.interleave)

    def split(self, config: PassConfig, site) -> bool:
        return config.dcp_size > 1  # at dcp_size 1 FlashInfer's own causal mask is exact

    def serves(self, config: PassConfig, site) -> bool:
        """At most MAX_WORK_ITEMS tiles of query rows x heads (a bound on fa3's plan count), or its
        plan refuses the step; a site past it (a prefill of 8 x 16k tokens at 64 heads) stays for
        the back end's general kernels, as a verify or extend site does where verify_attention is
        'folded'."""
        tokens, heads, _ = fake_value(site.q_latent).shape
        rows = fake_value(site.req_to_token).shape[0]
        if self.fold_verify and tokens != rows:  # verify_attention='folded': the Triton kernel's (lower_kernels.py)
            return False
        return work_items_bound(tokens, rows, heads) <= MAX_WORK_ITEMS

    def kernel(self, graph, site, q_latent, q_rope, decode, host, block_table, block_size):
        _, heads, rank_dim = fake_value(q_latent).shape
        split = site.key_positions is not None  # under DCP (gather_q_attention's partial attention)
        # Sizes 0: the plan is sized by each step (plans.FlashInferFeed), so the graph may be symbolic.
        spec = PlanSpec(keys="prefix" if split and not decode else "all", causal=not split and not decode,
                        rows=0, tokens=0, heads=heads, rank_dim=rank_dim, rope_dim=fake_value(q_rope).shape[-1],
                        block_size=block_size, blocks_per_row=0, sm_scale=site.sm_scale,
                        dtype=fake_value(q_latent).dtype, device=host.device)
        if spec not in self._plans:
            self._plans[spec] = host.tensor(PLAN_INPUT, len(self._plans), (1,), torch.int32)
        attention = call(graph, torch.ops.dcp_flashinfer.mla_paged_attention.default, q_latent, q_rope, site.cache,
                         self._plans[spec])
        return tuple(call(graph, operator.getitem, attention, i) for i in range(2))

    def finish(self, gm: fx.GraphModule, config: PassConfig) -> int:
        if self._plans:
            gm.meta[PLAN_SPECS] = list(self._plans)
        return 0
