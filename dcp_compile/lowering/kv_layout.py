"""The split KV layout: a back end whose kernels take a layer's latent and rope rows as two
contiguous tensors (Ascend FIA: `key` and `key_rope`, docs/ascend.md §11.1) has the pool hold
them so (runtime.kv_pool, layout 'split'), and this pass, its last, points every reader and
writer of a layer's cache at the two parts.

    before: dcp_triton.sharded_kv_write(cache, latent, rope, loc, r, N, I)
            key = aten.slice(cache, 1, 0, R); key_rope = aten.slice(cache, 1, R, R + P)
            dcp_triton.window_attention(..., cache, ...); dcp.gather_local_rows(cache, ...)
    after:  dcp_triton.sharded_kv_write(cache_latent, latent, rope, loc, r, N, I, rope_cache=cache_rope)
            key = cache_latent; key_rope = cache_rope
            dcp_triton.window_attention(..., cache_latent, ..., rope_cache=cache_rope); ...

In the pool's nz layout (Ascend FIA's NZ cache, docs/ascend.md §11.4) the two parts are NZ
tensors [blocks, 1, D/16, block, 16], which the readers and writers above address themselves;
FIA's views of the cache are `dcp.nz_kv_blocks(cache, R, block)` there, not slices:

    before: latent_nz, rope_nz = dcp.nz_kv_blocks(cache, R, block)
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
from dcp_compile.ops import targets
from dcp_compile.ops import nz
from dcp_compile.passes.base import GraphPass, PassConfig
from dcp_compile.passes.cache_use import POOL_INPUTS
from dcp_compile.passes.graph_utils import fake_mode_of, fake_value, op_name
from dcp_compile.passes.verify import CAPTURED_MUTATIONS

aten = torch.ops.aten


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

    def run(self, gm: fx.GraphModule, config: PassConfig) -> int:
        if POOL_INPUTS not in gm.meta:
            raise RuntimeError("split_kv_cache needs the KV pool bound to the graph (passes.cache_use.bind_pool)")
        pool, layers = gm.meta[POOL_INPUTS]
        if pool.layout not in ("split", "nz"):
            raise RuntimeError(f"split_kv_cache runs on a pool in the split or nz layout; this one is {pool.layout!r}")
        readers = _cache_readers()
        rewritten = 0
        captured = gm.meta.get(CAPTURED_MUTATIONS)
        for node in [n for n in gm.graph.nodes if n.op == "placeholder" and n.name in layers]:
            latent, rope = self._parts(gm, node, pool, layers[node.name])
            for user in list(node.users):
                self._rewrite(gm.graph, user, node, latent, rope, pool, readers)
                rewritten += 1
            if captured is not None and node.name in captured:
                # The layer's writes moved to its two parts: the verifier checks those now.
                gm.meta[CAPTURED_MUTATIONS] = captured = (captured - {node.name}) | {latent.name, rope.name}
        return rewritten

    @staticmethod
    def _parts(gm: fx.GraphModule, node: fx.Node, pool, layer: int) -> tuple[fx.Node, fx.Node]:
        mode = fake_mode_of(gm.graph)
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
    def _rewrite(graph: fx.Graph, user: fx.Node, cache: fx.Node, latent: fx.Node, rope: fx.Node, pool,
                 readers: dict) -> None:
        rank_dim = pool.kv_lora_rank
        if user.op == "call_function" and user.target in readers and user.args[readers[user.target]] is cache:
            args = list(user.args)
            args[readers[user.target]] = latent
            user.args = tuple(args)
            user.kwargs = {**user.kwargs, "rope_cache": rope}
            return
        if user.op == "call_function" and user.target is targets.NZ_KV_BLOCKS and user.args[0] is cache:
            if pool.layout != "nz" or user.args[1] != rank_dim or user.args[2] != nz.block_of(pool.parts(0)[0]):
                raise ValueError(f"dcp.nz_kv_blocks{tuple(user.args[1:])} reads NZ blocks, but the pool's layout is "
                                 f"{pool.layout!r}" + (f" with blocks of {pool.nz_block()}" if pool.layout == "nz" else ""))
            for getitem in list(user.users):
                getitem.replace_all_uses_with((latent, rope)[getitem.args[1]])
                graph.erase_node(getitem)
            graph.erase_node(user)
            return
        if user.op == "call_function" and user.target is aten.slice.Tensor and user.args[1] == 1 \
                and pool.layout == "split":
            start, end = user.args[2], user.args[3]
            width = fake_value(cache).shape[1]
            part = {(0, rank_dim): latent, (rank_dim, width): rope}.get((start, min(end, width)))
            if part is not None:
                user.replace_all_uses_with(part)
                graph.erase_node(user)
                return
        raise ValueError(f"the split KV layout serves the cache to its kernels' readers and writers only; "
                         f"{op_name(user)} reads the packed cache")

