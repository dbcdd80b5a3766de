"""Lower what is left of a graph after FIA to native NPU ops (npu_kernels='native'): no Triton.

    before: dcp.sharded_kv_write(cache, latent, rope, loc, r, N, I)      (dcp.kv_write at dcp_size 1)
    after:  slots = dcp_npu.slot_mapping(loc, rows, r, N, I)              # int32: local row, or `rows`
            dcp_npu.scatter_kv_cache(cache, latent, rope, slots, block)   # npu_scatter_pa_kv_cache over
                                                                          # the parts, "Norm" or "PA_NZ"
    before: table, lens, ids, loc = dcp.guard_batch(req_to_token, seq_lens, q_seq_ids, out_loc, capacity)
    after:  lens, ids, loc = dcp_npu.guard_tokens(seq_lens, q_seq_ids, out_loc, width)
            (where nothing reads the guarded page table any more: FIA reads the KV through the
            host-fed block table, which the host checks; req_to_token is then not read on the device
            at all, and a graph runner need not copy it: its placeholder is tagged for the HostFeed)
    before: dcp.mla_partial_attention(...) over gathered rows; dcp.mla_attention(...) (dcp_size 1)
    after:  dcp_npu.partial_attention(...) (chunks longer than FIA's 16 queries a row)

The merge (npu_attention_update) and attention over the pool (FIA) are LowerNPUAttention's; the
pack stays dcp.pack_partials, whose torch reference is aten ops torch_npu runs on the device.
Assumes: LowerNPUAttention ran; the pool holds the native layout's reserved block past the
locations' rows (lowering/npu/kv_layout.py), which this pass checks. Guarantees: no dcp_triton:: op;
every slot the vendor op gets is int32 and in [0, rows + block) (its contract, docs/ascend.md §17):
the tokens other ranks own, and padding (location 0), write the reserved block's first row, `rows`,
which no location maps to and no read sees; no location's row but the token's own is written.
Why a pass: the kernels are the deployment's choice (docs/ascend.md §18 for the versions).
"""

from __future__ import annotations

import operator
from typing import NamedTuple

import torch
import torch.fx as fx

from dcp_compile.lowering.npu import native_ops
from dcp_compile.lowering.npu.options import NPUOptions
from dcp_compile.ops import nz, targets
from dcp_compile.passes import sites
from dcp_compile.passes.base import GraphPass, PassConfig
from dcp_compile.passes.cache_use import POOL_INPUTS
from dcp_compile.passes.graph_utils import call, fake_value, keeps_state, size_of
from dcp_compile.runtime import layout
from dcp_compile.runtime.host_inputs import BATCH_INPUT, CAPTURE_SKIPPED

aten = torch.ops.aten
DEBUG_CHECKS = (targets.CHECK_METADATA, targets.CHECK_HOST_METADATA, targets.CHECK_LOCATIONS)
"""The debug checks: each reads the device, and does nothing while a device graph is captured."""


def _writes(graph: fx.Graph) -> dict[fx.Node, sites.KVWriteSite]:
    return {w.cache: w for w in sites.find_kv_writes(graph, sharded=True) + sites.find_kv_writes(graph)}


def _after(graph: fx.Graph, *inputs: fx.Node):
    """Insert right after the last of `inputs` in graph order."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    return graph.inserting_after(max(inputs, key=order.__getitem__))


def _find_or_make(graph: fx.Graph, target, args: tuple, kwargs: dict | None = None) -> fx.Node:
    kwargs = kwargs or {}
    anchor = next(a for a in args if isinstance(a, fx.Node))
    for user in anchor.users:
        if user.op == "call_function" and user.target is target and user.args == args and user.kwargs == kwargs:
            return user
    with _after(graph, *(a for a in args if isinstance(a, fx.Node))):
        return call(graph, target, *args, **kwargs)


def slots(graph: fx.Graph, loc: fx.Node, num_rows: int, config: PassConfig) -> fx.Node:
    """This rank's slot of each token (dcp_npu.slot_mapping), one node per location tensor, placed
    right after it so that every KV write and attention of the graph can read it."""
    rank, size = (config.dcp_rank, config.dcp_size) if config.dcp_size > 1 else (0, 1)
    return _find_or_make(graph, native_ops.SLOT_MAPPING, (loc, num_rows, rank, size, config.interleave))


def as_cached(graph: fx.Graph, value: fx.Node, dtype: torch.dtype) -> fx.Node:
    """`value` [T, D] as the cache holds it: its dtype, contiguous (a copy, as the KV write needs)."""
    return _find_or_make(graph, aten._to_copy.default, (value,), {"dtype": dtype, "memory_format": torch.contiguous_format})


class StepTokens(NamedTuple):
    """This step's tokens as a layer's KV write hands them to its cache."""

    latent: fx.Node
    rope: fx.Node
    slots: fx.Node
    """int32 (dcp_npu.slot_mapping): below `num_rows` exactly the tokens this rank keeps."""
    num_rows: int
    """The cache's locations' rows (the reserved slot)."""


def step_tokens(graph: fx.Graph, cache: fx.Node, config: PassConfig) -> StepTokens:
    """This step's tokens written to `cache`: the graph's KV write of it."""
    write = _writes(graph).get(cache)
    if write is None:
        raise ValueError("npu_kernels='native' completes verify rows from this step's own tokens, but the graph "
                         "writes no KV to this cache: a model must write its KV before attention (dcp.kv_write)")
    dtype = fake_value(cache).dtype
    rows = nz.rows_of(fake_value(cache))
    return StepTokens(as_cached(graph, write.latent, dtype), as_cached(graph, write.rope, dtype),
                      slots(graph, write.loc, rows, config), rows)


def check_reserved_block(gm: fx.GraphModule, rows: int, block: int, width: int) -> None:
    """The pool bound to `gm` holds the reserved block the slots of `rows` aim at, and every slot
    times the row width (`width` elements) fits int32: the A5 kernel multiplies the slot by it in
    the slots' dtype (docs/ascend.md §17)."""
    if POOL_INPUTS in gm.meta:
        pool = gm.meta[POOL_INPUTS][0]
        if pool.reserved_rows_per_rank < block:
            raise ValueError(f"npu_kernels='native' writes the tokens a rank does not keep to a reserved block of "
                             f"{block} rows past the locations' rows, and the KV pool's layout {pool.layout!r} holds "
                             f"{pool.reserved_rows_per_rank}: hold the pool in NPULowering.kv_layout")
    if (rows + block) * width > torch.iinfo(native_ops.SLOT_DTYPE).max:
        raise ValueError(f"npu_kernels='native' passes int32 slots, which npu_scatter_pa_kv_cache multiplies by the "
                         f"row width {width} (docs/ascend.md §17): a shard of {rows} rows and a reserved block of "
                         f"{block} exceeds that; use a larger dcp_size or a smaller pool")


class LowerNativeKernels(GraphPass):
    name = "lower_native_kernels"

    def __init__(self, options: NPUOptions = NPUOptions()):
        self.options = options

    def applies(self, config: PassConfig) -> bool:
        return self.options.npu_kernels == "native"

    def run(self, gm: fx.GraphModule, config: PassConfig) -> int:
        graph = gm.graph
        lowered = self._writes(gm, config) + self._attention(graph)
        graph.eliminate_dead_code(is_impure_node=keeps_state)
        return lowered + self._guards(graph)

    @staticmethod
    def _writes(gm: fx.GraphModule, config: PassConfig) -> int:
        graph = gm.graph
        writes = list(_writes(graph).values())
        if not writes:
            return 0
        block = layout.require_local_block_size(config.page_size, config.dcp_size, config.interleave,
                                                "the native KV write (npu_scatter_pa_kv_cache's blocks)")
        for write in writes:
            tokens = step_tokens(graph, write.cache, config)
            check_reserved_block(gm, tokens.num_rows, block, fake_value(tokens.latent).shape[-1])
            with graph.inserting_before(write.node):
                call(graph, native_ops.SCATTER_KV_CACHE, write.cache, tokens.latent, tokens.rope, tokens.slots, block,
                     None)
            graph.erase_node(write.node)
        return len(writes)

    @staticmethod
    def _attention(graph: fx.Graph) -> int:
        """Attention over gathered rows (chunks over 16 queries a row) and, at dcp_size 1, the
        canonical attention FIA did not take."""
        lowered = 0
        for node in [n for n in graph.nodes if n.op == "call_function" and n.target is targets.PARTIAL_ATTENTION]:
            node.target = native_ops.PARTIAL_ATTENTION
            lowered += 1
        for site in sites.find_attention_sites(graph):
            width = fake_value(site.req_to_token).shape[1]
            with graph.inserting_before(site.node):
                columns = call(graph, aten.arange.default, width, dtype=fake_value(site.req_to_token).dtype,
                               device=fake_value(site.req_to_token).device)
                positions = call(graph, aten.expand.default, columns, [size_of(graph, site.req_to_token, 0), width])
                partial = call(graph, native_ops.PARTIAL_ATTENTION, site.q_latent, site.q_rope, site.cache,
                               site.req_to_token, site.seq_lens, positions, site.q_seq_ids, site.q_positions,
                               site.sm_scale)
                out = call(graph, operator.getitem, partial, 0)
            site.node.replace_all_uses_with(out)
            graph.erase_node(site.node)
            lowered += 1
        return lowered

    @staticmethod
    def _guards(graph: fx.Graph) -> int:
        """A batch guard whose guarded page table nothing reads but the debug checks checks the rows
        and tokens only; the debug checks read the batch's own table (they run outside captures
        only, so a replayed graph reads no page table even in debug mode)."""
        for node in graph.nodes:
            if node.op == "call_function" and node.target in DEBUG_CHECKS:
                node.meta[CAPTURE_SKIPPED] = True
        lowered = 0
        for guard in [n for n in graph.nodes if n.op == "call_function" and n.target is targets.GUARD_BATCH]:
            req_to_token, seq_lens, q_seq_ids, out_loc = guard.args[:4]
            if req_to_token.op == "placeholder":
                req_to_token.meta[BATCH_INPUT] = "req_to_token"
            for table in [user for user in guard.users if user.args[1] == 0]:
                for check in [user for user in table.users if user.meta.get(CAPTURE_SKIPPED)]:
                    check.replace_input_with(table, req_to_token)
                if not table.users:
                    graph.erase_node(table)
            outputs = {user.args[1]: user for user in guard.users}
            if 0 in outputs or not isinstance(out_loc, fx.Node):
                continue
            with graph.inserting_before(guard):
                checked = call(graph, native_ops.GUARD_TOKENS, seq_lens, q_seq_ids, out_loc,
                               fake_value(req_to_token).shape[1])
            for index, user in outputs.items():
                user.args = (checked, index - 1)
            graph.erase_node(guard)
            lowered += 1
        return lowered
