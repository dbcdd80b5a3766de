"""The split KV layout: a back end whose kernels take a layer's latent and rope rows as two
contiguous tensors (Ascend FIA: `key` and `key_rope`, docs/ascend.md §11.1) declares
`SplitLayout` (or a subclass) as its Lowering.kv_layout, so that the pool holds them so, and ends
its passes with this one, which points every reader and writer of a layer's cache at the two
parts.

    before: dcp_triton.sharded_kv_write(cache, latent, rope, loc, r, N, I, None)
            key = aten.slice(cache, 1, 0, R); key_rope = aten.slice(cache, 1, R, R + P)
            dcp_triton.window_attention(..., cache, ...); dcp.gather_local_rows(cache, ...)
    after:  dcp_triton.sharded_kv_write(cache_latent, latent, rope, loc, r, N, I, cache_rope)
            key = cache_latent; key_rope = cache_rope
            dcp_triton.window_attention(..., cache_latent, ..., rope_cache=cache_rope); ...

A layout whose parts are not row-major (the NPU back end's NZ layout, lowering/npu/kv_layout.py)
is read through an op of the back end that returns both parts of the cache, named in
`part_views`, not through slices:

    before: latent_nz, rope_nz = dcp_npu.nz_kv_blocks(cache, R, block)
    after:  latent_nz = cache_latent; rope_nz = cache_rope

`cache_latent` and `cache_rope` are the pool's tensors themselves, attributes of the graph
module (get_attr): the backend binds which placeholder is which layer (passes.cache_use.bind_pool).
Assumes: the other passes ran; every use of a cache is one of the ops above (the cache in the
split layout holds no memory, so any other use is an error here, before anything runs).
Guarantees: no node reads or writes the packed cache.
Why a pass: the layout is the back end's choice, and no other pass knows it.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from dcp_compile.lowering.triton.ops import triton_op
from dcp_compile.passes.base import GraphPass, PassConfig
from dcp_compile.passes.cache_use import PER_CALL_INPUTS, POOL_INPUTS, REGION_POOL_LAYERS
from dcp_compile.passes.graph_utils import fake_mode_of, fake_value, op_name
from dcp_compile.passes.verify import CAPTURED_MUTATIONS
from dcp_compile.runtime.kv_pool import KVLayout

aten = torch.ops.aten


class SplitLayout(KVLayout):
    """A layer's latent rows [rows, R] and rope rows [rows, P], two contiguous tensors."""

    name = "split"
    packed = False
    row_major = True
    """The parts are [rows, D]: a slice of the packed cache's columns is one of them."""

    def part_shapes(self, rows: int, kv_lora_rank: int, rope_dim: int, pool) -> tuple[tuple[int, ...], ...]:
        return (rows, kv_lora_rank), (rows, rope_dim)


def _cache_readers() -> dict:
    """op -> index of its kv_cache argument, for the ops that take an optional rope_cache."""
    readers = {}
    for name, index in (("sharded_kv_write", 0), ("mla_partial_attention", 2), ("window_attention", 4)):
        readers[getattr(torch.ops.dcp, name).default] = index
        readers[triton_op(name)] = index
    readers[torch.ops.dcp.gather_local_rows.default] = 0
    return readers


class SplitKVCache(GraphPass):
    name = "split_kv_cache"

    def __init__(self, part_views: dict | None = None, readers: dict | None = None):
        """part_views: {op: check(call_node, pool)} for the back end's ops whose call
        op(cache, ...) returns (latent, rope) views of a cache in its layout: each call is replaced
        by the pool's two parts after check raises a ValueError where its arguments do not match.
        readers: {op: index of its kv_cache argument} for the back end's own ops that read a
        cache and take its rope part as `rope_cache` (besides the package's own readers)."""
        self.part_views = dict(part_views or {})
        self.readers = dict(readers or {})

    def run(self, gm: fx.GraphModule, config: PassConfig) -> int:
        if POOL_INPUTS not in gm.meta:
            raise RuntimeError("split_kv_cache needs the KV pool bound to the graph (passes.cache_use.bind_pool)")
        pool, layers = gm.meta[POOL_INPUTS]
        if not isinstance(pool.layout, SplitLayout):
            raise RuntimeError(f"split_kv_cache runs on a pool in a split layout; this one is {pool.layout.name!r}")
        readers = {**_cache_readers(), **self.readers}
        rewritten = 0
        captured = gm.meta.get(CAPTURED_MUTATIONS)
        for node in [n for n in gm.graph.nodes if n.op == "placeholder" and n.name in layers]:
            latent, rope = self._parts(gm, node, pool, layers[node.name])
            for user in list(node.users):
                self._rewrite(gm.graph, user, node, latent, rope, pool, readers, self.part_views)
                rewritten += 1
            if captured is not None and node.name in captured:
                # The layer's writes moved to its two parts: the verifier checks those now.
                gm.meta[CAPTURED_MUTATIONS] = captured = (captured - {node.name}) | {latent.name, rope.name}
        return rewritten

    @staticmethod
    def _parts(gm: fx.GraphModule, node: fx.Node, pool, layer: int) -> tuple[fx.Node, fx.Node]:
        mode = fake_mode_of(gm.graph)
        if REGION_POOL_LAYERS in gm.meta:
            return SplitKVCache._region_parts(gm, node, pool, gm.meta[REGION_POOL_LAYERS][node.name], mode)
        made = []
        for part, tensor in zip(("latent", "rope"), pool.parts(layer)):
            name = f"dcp_kv_{part}_{layer}"
            gm.register_buffer(name, tensor, persistent=False)
            with gm.graph.inserting_after(node):
                attr = gm.graph.get_attr(name)
            attr.meta["val"] = mode.from_tensor(tensor, static_shapes=True) if mode is not None else tensor
            made.append(attr)
        return made[0], made[1]

    @staticmethod
    def _region_parts(gm: fx.GraphModule, node: fx.Node, pool, layers: list[int], mode) -> tuple[fx.Node, fx.Node]:
        """In a compile region (dcp_compile/regions.py) each call passes its own layer's parts:
        two placeholders after the region's last one, fed per call (PER_CALL_INPUTS)."""
        made = []
        last = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
        for index, part in enumerate(("latent", "rope")):
            tensors = [pool.parts(layer)[index] for layer in layers]
            with gm.graph.inserting_after(last):
                last = gm.graph.placeholder(f"{node.name}_{part}")
            last.meta["val"] = mode.from_tensor(tensors[0], static_shapes=True) if mode is not None else tensors[0]
            gm.meta[PER_CALL_INPUTS][last.name] = tensors
            made.append(last)
        return made[0], made[1]

    @staticmethod
    def _rewrite(graph: fx.Graph, user: fx.Node, cache: fx.Node, latent: fx.Node, rope: fx.Node, pool,
                 readers: dict, part_views: dict) -> None:
        rank_dim = pool.kv_lora_rank
        if user.op == "call_function" and user.target in readers and user.args[readers[user.target]] is cache:
            args = list(user.args)
            args[readers[user.target]] = latent
            rope_index = [a.name for a in user.target._schema.arguments].index("rope_cache")
            if rope_index < len(args):  # passed positionally (a writer's rope_cache has no default)
                args[rope_index] = rope
            else:
                user.kwargs = {**user.kwargs, "rope_cache": rope}
            user.args = tuple(args)
            return
        if user.op == "call_function" and user.target in part_views and user.args[0] is cache:
            part_views[user.target](user, pool)
            for getitem in list(user.users):
                getitem.replace_all_uses_with((latent, rope)[getitem.args[1]])
                graph.erase_node(getitem)
            graph.erase_node(user)
            return
        if user.op == "call_function" and user.target is aten.slice.Tensor and user.args[1] == 1 \
                and pool.layout.row_major:
            start, end = user.args[2], user.args[3]
            width = fake_value(cache).shape[1]
            part = {(0, rank_dim): latent, (rank_dim, width): rope}.get((start, min(end, width)))
            if part is not None:
                user.replace_all_uses_with(part)
                graph.erase_node(user)
                return
        raise ValueError(f"the split KV layout serves the cache to its kernels' readers and writers only; "
                         f"{op_name(user)} reads the packed cache")

