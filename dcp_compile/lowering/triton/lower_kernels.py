"""Select kernels: swap dcp:: ops for their Triton lowerings (dcp_triton::, same schema).

    before: dcp.mla_partial_attention(...); dcp.sharded_kv_write(...); dcp.mla_attention(...)
    after:  dcp_triton.mla_partial_attention(...); dcp_triton.sharded_kv_write(...);
            dcp_triton.mla_partial_attention(..., key_positions=arange(L).expand(B, L), ...)[0]
    with fold_verify, an attention over the pool in a gather-q or replicated-q graph takes
    dcp_triton.mla_folded_partial_attention instead (same arguments and contract: the tokens in
    any order), whose launcher folds verify's shapes and runs the per-query kernel for the others.

Assumes: the DCP rewrites ran (or were switched off); what is left of the canonical ops has the
unsharded meaning, which the Triton kernels serve with dcp_size 1.
Guarantees: each swapped node keeps its arguments, users and fake value; ops with no Triton
kernel keep the torch reference. It lowers graphs whose KV cache lives on one of `devices`
(None: any device, the CPU under TRITON_INTERPRET=1 too): a paged lowering that serves attention
over the pool itself runs it after its own pass, for what is left (KV writes, metadata, pack,
merge, window attention; on an NPU under triton-ascend).
Why a pass: the kernel choice depends on the device and the deployment, and a visible target in
the graph says which kernel runs.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from dcp_compile.lowering.triton.ops import LAUNCHERS, triton_op
from dcp_compile.lowering.base import POOL_STRATEGIES
from dcp_compile.passes import sites
from dcp_compile.passes.base import GraphPass, PassConfig
from dcp_compile.passes.graph_utils import call, fake_value, size_of

aten = torch.ops.aten


def _graph_device(graph: fx.Graph) -> torch.device | None:
    for site in sites.find_kv_writes(graph) + sites.find_kv_writes(graph, sharded=True):
        return fake_value(site.cache).device
    return None


class LowerKernels(GraphPass):
    name = "lower_kernels"

    def __init__(self, devices: tuple[str, ...] | None = None, fold_verify: bool = False):
        self.devices = devices
        self.fold_verify = fold_verify

    def _attention_op(self, config: PassConfig):
        """The partial-attention op of an attention over the pool: the folded kernel's where it
        folds verify and the graph reads the pool in place (its launcher takes decode to the
        per-query kernel by the step's shapes: a graph symbolic in the batch guards on no T == B)."""
        if self.fold_verify and config.attention_strategy in POOL_STRATEGIES:
            return triton_op("mla_folded_partial_attention")
        return triton_op("mla_partial_attention")

    def run(self, gm: fx.GraphModule, config: PassConfig) -> int:
        graph = gm.graph
        device = _graph_device(graph)
        if self.devices is not None and (device is None or device.type not in self.devices):
            return 0
        lowered = 0
        swaps = {getattr(torch.ops.dcp, name).default: triton_op(name) for name in LAUNCHERS}
        for node in list(graph.nodes):
            if node.op == "call_function" and node.target in swaps:
                node.target = swaps[node.target]
                if node.target == triton_op("mla_partial_attention"):
                    node.target = self._attention_op(config)
                lowered += 1
        for site in sites.find_kv_writes(graph):
            with graph.inserting_before(site.node):
                call(graph, triton_op("sharded_kv_write"), site.cache, site.latent, site.rope, site.loc, 0, 1, 1, None)
            graph.erase_node(site.node)
            lowered += 1
        for site in sites.find_attention_sites(graph):
            width = fake_value(site.req_to_token).shape[1]
            with graph.inserting_before(site.node):
                columns = call(graph, aten.arange.default, width, dtype=fake_value(site.req_to_token).dtype, device=device)
                positions = call(graph, aten.expand.default, columns, [size_of(graph, site.req_to_token, 0), width])
                partial = call(graph, self._attention_op(config), site.q_latent, site.q_rope, site.cache,
                               site.req_to_token, site.seq_lens, positions, site.q_seq_ids, site.q_positions, site.sm_scale)
                out = call(graph, operator.getitem, partial, 0)
            site.node.replace_all_uses_with(out)
            graph.erase_node(site.node)
            lowered += 1
        return lowered
