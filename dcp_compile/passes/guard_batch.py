"""Guard each attention's batch metadata, in every mode: what attention reads lies in the pool.

    before: kv_write(cache, latent, rope, out_loc) ... mla_attention(q, q_rope, cache, req_to_token, seq_lens, ids, pos, s)
    after:  table, lens, ids2, loc2 = dcp.guard_batch(req_to_token, seq_lens, ids, out_loc, capacity)  # once, first
            kv_write(cache, latent, rope, loc2) ... mla_attention(q, q_rope, cache, table, lens, ids2, pos, s)

capacity is the pool's logical capacity (its rows per rank over the DCP group). On a device the
guard sets that device's error flags (runtime/guards.py); it is a registered side effect, so
dead-code elimination keeps it where a lowering reads none of its outputs (paged kernels read
host block tables).

Assumes: the canonical graph (this pass runs before the DCP rewrites); out_loc is the KV write
locations where they may be one per query token (a symbolic graph's sizes cannot be told equal
before run time: the guard checks the padded rows where they are).
Guarantees: every kernel after it reads page-table entries inside the pool and lengths and row
ids in range, whatever the batch; a violation raises on the CPU (every rank alike) and sets a
device flag elsewhere (raised at the next step), so a bad batch is never silently served. The
guard comes before the graph's first KV write, so a batch refused on the CPU has written nothing;
the writes of out_loc read the guard's copy, in which a padded row's token writes location 0, so
on a device such a token cannot overwrite a live request's KV either. One guard per distinct
metadata; a guarded site is not guarded again.
Why a pass: which reads are safe depends on the deployment's pool, not on the model.
"""

from __future__ import annotations

import operator

import torch.fx as fx

from dcp_compile.passes import sites
from dcp_compile.passes.base import GraphPass, PassConfig
from dcp_compile.passes.graph_utils import call, fake_value, maybe_same_shape
from dcp_compile.runtime import layout
from dcp_compile.ops import targets



def _guarded(node) -> bool:
    return (isinstance(node, fx.Node) and node.target is operator.getitem and isinstance(node.args[0], fx.Node)
            and node.args[0].target is targets.GUARD_BATCH)


class GuardBatch(GraphPass):
    name = "guard_batch"

    def run(self, gm: fx.GraphModule, config: PassConfig) -> int:
        graph = gm.graph
        writes = sites.find_kv_writes(graph)
        guarded: dict[tuple, fx.Node] = {}
        for site in sites.find_attention_sites(graph):
            if _guarded(site.req_to_token):
                continue
            key = (site.req_to_token, site.seq_lens, site.q_seq_ids)
            if key not in guarded:
                tokens = fake_value(site.q_seq_ids).shape
                out_loc = next((w.loc for w in writes if maybe_same_shape(fake_value(w.loc).shape, tokens)), None)
                rows = fake_value(site.cache).shape[0]
                capacity = layout.logical_capacity(rows, config.dcp_size, config.interleave)
                with graph.inserting_before(sites.first_kv_write(graph, site.node, writes, (*key, out_loc))):
                    guard = call(graph, targets.GUARD_BATCH, *key, out_loc, capacity)
                    guarded[key] = tuple(call(graph, operator.getitem, guard, i) for i in range(4))
                if out_loc is not None:
                    for write in writes:
                        if write.loc is out_loc:
                            write.node.replace_input_with(out_loc, guarded[key][3])
            table, lens, ids, _ = guarded[key]
            site.node.replace_input_with(site.req_to_token, table)
            site.node.replace_input_with(site.seq_lens, lens)
            site.node.replace_input_with(site.q_seq_ids, ids)
        return len(guarded)
