"""Finders: small match records for the canonical MLA ops and the DCP nodes passes insert.

Only `dcp::` ops are matched, never attention internals.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

KV_WRITE = torch.ops.dcp.mla_kv_write.default
ATTENTION = torch.ops.dcp.mla_attention.default
SHARDED_KV_WRITE = torch.ops.dcp.sharded_kv_write.default
LOCAL_METADATA = torch.ops.dcp.local_metadata.default
PARTIAL_ATTENTION = torch.ops.dcp.mla_partial_attention.default
CHECK_LOCATIONS = torch.ops.dcp.check_locations.default
CHECK_METADATA = torch.ops.dcp.check_metadata.default
GATHER_LOCAL_ROWS = torch.ops.dcp.gather_local_rows.default
GATHERED_KV_METADATA = torch.ops.dcp.gathered_kv_metadata.default


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


def find_attention_sites(graph: fx.Graph) -> list[AttentionSite]:
    return [AttentionSite(n, *n.args) for n in _calls(graph, ATTENTION)]


def find_local_metadata(graph: fx.Graph) -> dict[tuple[fx.Node, fx.Node], fx.Node]:
    """Existing local-metadata nodes keyed by their (req_to_token, seq_lens) inputs."""
    return {(n.args[0], n.args[1]): n for n in _calls(graph, LOCAL_METADATA)}


def count_mla_sites(graph: fx.Graph) -> int:
    return len(_calls(graph, ATTENTION, PARTIAL_ATTENTION))
