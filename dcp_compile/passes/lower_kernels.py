"""Select kernels: swap dcp:: ops for their Triton lowerings (dcp_triton::, same schema).

    before: dcp.mla_partial_attention(...); dcp.sharded_kv_write(...); dcp.mla_attention(...)
    after:  dcp_triton.mla_partial_attention(...); dcp_triton.sharded_kv_write(...);
            dcp_triton.mla_partial_attention(..., key_positions=arange(L).expand(B, L), ...)[0]

Assumes: the DCP rewrites ran (or were switched off); what is left of the canonical ops has the
unsharded meaning, which the Triton kernels serve with dcp_size 1.
Guarantees: each swapped node keeps its arguments, users and fake value; ops with no Triton
kernel keep the torch reference. 'auto' and 'flashinfer' lower only graphs whose KV cache lives
on CUDA (under 'flashinfer', what lower_flashinfer_attention left), 'npu' only graphs whose KV
cache lives on an NPU (what lower_npu_attention left, for triton-ascend).
Why a pass: the kernel choice depends on the device and the deployment, and a visible target in
the graph says which kernel runs.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from dcp_compile.lowering.registry import LAUNCHERS, triton_op
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

    def applies(self, config: PassConfig) -> bool:
        return config.kernels != "torch"

    def run(self, gm: fx.GraphModule, config: PassConfig) -> int:
        graph = gm.graph
        device = _graph_device(graph)
        # 'flashinfer' lowered attention over the pool already; the rest runs Triton on CUDA.
        if config.kernels in ("auto", "flashinfer") and (device is None or device.type != "cuda"):
            return 0
        # kernels='npu': what FIA does not serve (KV writes, gather-kv attention) runs the same
        # Triton kernels under triton-ascend on an NPU; on the CPU stand-ins, the torch reference.
        if config.kernels == "npu" and (device is None or device.type != "npu"):
            return 0
        lowered = 0
        swaps = {getattr(torch.ops.dcp, name).default: triton_op(name) for name in LAUNCHERS}
        for node in list(graph.nodes):
            if node.op == "call_function" and node.target in swaps:
                node.target = swaps[node.target]
                lowered += 1
        for site in sites.find_kv_writes(graph):
            with graph.inserting_before(site.node):
                call(graph, triton_op("sharded_kv_write"), site.cache, site.latent, site.rope, site.loc, 0, 1, 1)
            graph.erase_node(site.node)
            lowered += 1
        for site in sites.find_attention_sites(graph):
            width = fake_value(site.req_to_token).shape[1]
            with graph.inserting_before(site.node):
                columns = call(graph, aten.arange.default, width, dtype=fake_value(site.req_to_token).dtype, device=device)
                positions = call(graph, aten.expand.default, columns, [size_of(graph, site.req_to_token, 0), width])
                partial = call(graph, triton_op("mla_partial_attention"), site.q_latent, site.q_rope, site.cache,
                               site.req_to_token, site.seq_lens, positions, site.q_seq_ids, site.q_positions, site.sm_scale)
                out = call(graph, operator.getitem, partial, 0)
            site.node.replace_all_uses_with(out)
            graph.erase_node(site.node)
            lowered += 1
        return lowered
