"""The model contract's cache rule, checked on the captured graph before any pass runs: the KV
pool's buffers are read and written only by the canonical ops, and the canonical ops get the
pool's current buffers.

A layer that indexes its cache itself, or writes it with `cache[loc] = ...`, runs unsharded
against a sharded pool; a model that kept cache tensors from before apply() resharded the pool
runs against stale tensors. Both give finite, wrong logits, so both are errors here, naming the
op and the model source line (the FX node's stack trace).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from dcp_compile.passes.graph_utils import op_name
from dcp_compile.ops import targets

CANONICAL = (targets.KV_WRITE, targets.ATTENTION)
FRONT_END_READS = (targets.CACHE_VIEW,)
"""A front end's read of the pool in a model's own layout (dcp_compile/hf), allowed where a front
end's pass runs first: it replaces every such read under DCP, and raises where it cannot."""


class CacheMisuseError(RuntimeError):
    pass


def source_line(node: fx.Node) -> str:
    """The model line that produced `node`, from dynamo's stack trace."""
    trace = [line for line in (node.meta.get("stack_trace") or "").strip().splitlines()
             if line.strip() and not set(line.strip()) <= set("^~")]  # Python 3.11+'s column markers
    frames = [line.strip() for line in trace if line.strip().startswith("File ")]
    if not frames:
        return "unknown source line"
    code = trace[-1].strip() if not trace[-1].strip().startswith("File ") else ""
    return f"{frames[-1]}: {code}" if code else frames[-1]


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and a.shape == b.shape


POOL_INPUTS = "dcp_kv_pool_inputs"
"""gm.meta key: (the KV pool, {placeholder name: its layer}), for passes that read the pool's
tensors themselves (a back end's KV layout, lowering/kv_layout.py)."""


REGION_POOL_LAYERS = "dcp_region_pool_layers"
"""A compile region's gm.meta key: {cache placeholder name: the layer each of its calls passes}."""
PER_CALL_INPUTS = "dcp_per_call_inputs"
"""A compile region's gm.meta key: {placeholder name: the tensor each call passes}, for the
placeholders a pass adds for one layer's own tensors (the split layout's parts, lowering.kv_layout)."""


def pool_inputs(graph: fx.Graph, example_inputs, caches: list[torch.Tensor]) -> dict[fx.Node, int]:
    """The graph's placeholders that are the pool's caches, with each one's layer."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    found = {}
    for node, example in zip(placeholders, example_inputs):
        if isinstance(example, torch.Tensor):
            # The buffer itself, else one of the same memory (a view of it); meta tensors have no
            # memory to tell them apart, nor does the split layout's memoryless cache: identity.
            same = [layer for layer, cache in enumerate(caches) if example is cache]
            same = same or [layer for layer, cache in enumerate(caches) if _same_storage(example, cache)]
            if same:
                found[node] = same[0]
    return found


def bind_pool(gm: fx.GraphModule, example_inputs, pool) -> None:
    """Record in gm.meta which placeholders are which layer of `pool` (POOL_INPUTS)."""
    caches = [pool.cache(i) for i in range(pool.num_layers)]
    gm.meta[POOL_INPUTS] = (pool, {node.name: layer for node, layer in pool_inputs(gm.graph, example_inputs, caches).items()})


def region_pool_inputs(region, pool_nodes: dict[fx.Node, int]) -> dict[fx.Node, list[int]]:
    """A compile region's placeholders (dcp_compile/regions.py) that its calls pass the pool's
    caches, with each call's layer. A placeholder is a cache in every call or in none."""
    found = {}
    for index, holder in enumerate(region.placeholders()):
        layers = [pool_nodes.get(region.operand(call, index)) for call in region.calls]
        if all(layer is None for layer in layers):
            continue
        if any(layer is None for layer in layers):
            raise CacheMisuseError(
                f"compile region {region.name}'s input {holder.name} is a KV pool cache in some of its calls and "
                "not in others: a region's code must get its layer's cache in every call"
            )
        found[holder] = layers
    return found


def bind_region_pool(region, pool, pool_nodes: dict[fx.Node, int]) -> None:
    """POOL_INPUTS of a region's graph (its cache placeholders, as its first call's layers) and
    REGION_POOL_LAYERS (every call's): a pass that reads a layer's own buffers asks for them per
    call (PER_CALL_INPUTS)."""
    found = region_pool_inputs(region, pool_nodes)
    region.module.meta[POOL_INPUTS] = (pool, {node.name: layers[0] for node, layers in found.items()})
    region.module.meta[REGION_POOL_LAYERS] = {node.name: layers for node, layers in found.items()}
    region.module.meta[PER_CALL_INPUTS] = {}


def check_cache_use(graph: fx.Graph, example_inputs, caches: list[torch.Tensor], front_end: bool = False,
                    regions=()) -> None:
    """front_end: a front end's passes run first (FRONT_END_READS are then allowed). regions: the
    graph's compile regions (dcp_compile/regions.py), whose calls may pass the caches on: their
    graphs are held to the same rule."""
    pool_nodes = pool_inputs(graph, example_inputs, caches)
    readers = CANONICAL + FRONT_END_READS if front_end else CANONICAL
    _check_graph(graph, set(pool_nodes), readers, passes_on={c for r in regions for c in r.calls})
    for region in regions:
        _check_graph(region.module.graph, set(region_pool_inputs(region, pool_nodes)), readers, passes_on=set())


def _check_graph(graph: fx.Graph, pool_nodes: set, readers, passes_on: set) -> None:
    for node in pool_nodes:
        for user in node.users:
            if user in passes_on:
                continue
            if user.op != "call_function" or user.target not in readers:
                raise CacheMisuseError(
                    f"the KV pool's cache is used by {op_name(user)} at {source_line(user)}: only "
                    "dcp_compile.ops.mla_kv_write and mla_attention may read or write it (the README's model "
                    "contract), since DCP shards it by tokens"
                )
    for node in graph.nodes:
        if node.op == "call_function" and node.target in readers and node.args[2 if node.target is targets.ATTENTION else 0] not in pool_nodes:
            raise CacheMisuseError(
                f"{op_name(node)} at {source_line(node)} is given a cache that is not one of the KV pool's current "
                "buffers (a tensor kept from before apply() resharded the pool?): read it with self.kv_pool.cache(i) "
                "inside forward"
            )
