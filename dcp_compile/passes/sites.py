"""Finders: small match records for the canonical MLA ops and the DCP nodes passes insert.

Only `dcp::` ops are matched, never attention internals.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch.fx as fx

from dcp_compile.passes.graph_utils import check_replacement
from dcp_compile.ops.targets import ATTENTION, CACHE_VIEW, KV_WRITE, LOCAL_METADATA, PARTIAL_ATTENTION, SHARDED_KV_WRITE


@dataclass
class KVWriteSite:
    node: fx.Node
    cache: fx.Node
    latent: fx.Node
    rope: fx.Node
    loc: fx.Node


@dataclass
class AttentionSite:
    node: fx.Node
    q_latent: fx.Node
    q_rope: fx.Node
    cache: fx.Node
    req_to_token: fx.Node
    seq_lens: fx.Node
    q_seq_ids: fx.Node
    q_positions: fx.Node
    sm_scale: float


def _calls(graph: fx.Graph, *targets):
    return [n for n in graph.nodes if n.op == "call_function" and n.target in targets]


def find_kv_writes(graph: fx.Graph, sharded: bool = False) -> list[KVWriteSite]:
    target = SHARDED_KV_WRITE if sharded else KV_WRITE
    return [KVWriteSite(n, *n.args[:4]) for n in _calls(graph, target)]


def first_kv_write(graph: fx.Graph, site: fx.Node, writes, inputs) -> fx.Node:
    """Where a check of `site`'s batch goes: before the graph's first KV write (or the site, if it
    comes first), so that a refused batch writes nothing, but not before `inputs` exist."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    earliest = min([site, *(w.node for w in writes)], key=order.__getitem__)
    defined = max((order[n] for n in inputs if isinstance(n, fx.Node)), default=-1)
    if order[earliest] > defined:
        return earliest
    return next(n for n in graph.nodes if order[n] > defined)


def find_attention_sites(graph: fx.Graph) -> list[AttentionSite]:
    return [AttentionSite(n, *n.args) for n in _calls(graph, ATTENTION)]


def find_local_metadata(graph: fx.Graph) -> dict[tuple[fx.Node, fx.Node], fx.Node]:
    """Existing local-metadata nodes keyed by their (req_to_token, seq_lens) inputs."""
    return {(n.args[0], n.args[1]): n for n in _calls(graph, LOCAL_METADATA)}


def rewrite_attention_sites(graph: fx.Graph, pass_name: str,
                            rewrite: Callable[[AttentionSite, fx.Node], fx.Node]) -> int:
    """Replace every MLA attention site by `rewrite(site, its local-metadata node)`, inserted
    before the site: the frame of the DCP attention rewrites. Each site must have local
    metadata (local_metadata ran first), and its replacement keeps its dtype and shape.
    Returns the number of sites."""
    metadata = find_local_metadata(graph)
    attention = find_attention_sites(graph)
    for site in attention:
        meta = metadata.get((site.req_to_token, site.seq_lens))
        if meta is None:
            raise RuntimeError(f"{pass_name} found an MLA site with no local metadata: run local_metadata first")
        with graph.inserting_before(site.node):
            replacement = rewrite(site, meta)
        check_replacement(site.node, replacement, pass_name)
        site.node.replace_all_uses_with(replacement)
    for site in attention:
        graph.erase_node(site.node)
    return len(attention)


def count_mla_sites(graph: fx.Graph) -> int:
    return len(_calls(graph, ATTENTION, PARTIAL_ATTENTION))


def count_cache_views(graph: fx.Graph) -> int:
    """A front end's reads of the pool (dcp::mla_cache_view), each an MLA site its passes rewrite."""
    return len(_calls(graph, CACHE_VIEW))


@dataclass
class PoolAttention:
    """Attention over the KV pool, with the view a paged kernel reads: the rank's page table,
    local lengths and key positions (the global ones at dcp_size 1)."""

    node: fx.Node
    q_latent: fx.Node
    q_rope: fx.Node
    cache: fx.Node
    page_table: fx.Node
    local_lens: fx.Node
    key_positions: fx.Node | None
    """None at dcp_size 1: a key's position is its page-table column."""
    q_seq_ids: fx.Node
    q_positions: fx.Node
    sm_scale: float
    req_to_token: fx.Node
    seq_lens: fx.Node
    returns_lse: bool


def find_pool_attention(graph: fx.Graph, dcp_size: int) -> list[PoolAttention]:
    """At dcp_size 1, the canonical attention sites; under DCP, the partial attentions over a
    sharded pool's local metadata (not those over gathered KV rows)."""
    if dcp_size == 1:
        return [PoolAttention(s.node, s.q_latent, s.q_rope, s.cache, s.req_to_token, s.seq_lens, None, s.q_seq_ids,
                              s.q_positions, s.sm_scale, s.req_to_token, s.seq_lens, False)
                for s in find_attention_sites(graph)]
    pool_caches = {s.cache for s in find_kv_writes(graph, sharded=True)}
    found = []
    for node in _calls(graph, PARTIAL_ATTENTION):
        if node.args[2] not in pool_caches:
            continue
        q_latent, q_rope, cache, page_table, local_lens, key_positions, q_seq_ids, q_positions, sm_scale = node.args
        metadata = page_table.args[0]
        if metadata.target is not LOCAL_METADATA:
            raise RuntimeError("a paged lowering expects partial attention over local_metadata's page table")
        found.append(PoolAttention(node, q_latent, q_rope, cache, page_table, local_lens, key_positions, q_seq_ids,
                                   q_positions, sm_scale, metadata.args[0], metadata.args[1], True))
    return found
