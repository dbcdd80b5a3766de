"""Issue each all-gather as early as its input exists, so that it overlaps the work it does not need.

    before: ...q path...  kv_a -> norm -> rope -> dcp.sharded_kv_write  cat(q_lat, q_rope) -> all_gather -> wait -> attention
    after:  ...q path...  cat(q_lat, q_rope) -> all_gather  kv_a -> norm -> rope -> dcp.sharded_kv_write  wait -> attention

For each all-gather (gather_q_attention's Q gather, gather_kv_attention's KV gather), the nodes
before it, back to the previous collective, to the last node it depends on that writes state
(a linear-attention layer's state update) or to the last node that writes what it reads (the KV
write before a gather of the cache), are split in two, keeping the order within each part:
those it depends on, then the all-gather, then the rest. The wait stays where it was, right
before the first reader of the gathered tensor. On a GPU the collective then runs on its
communicator's stream while the KV path (its projection, norm, rope and the sharded KV write)
runs on the compute stream.

Assumes: fake values tell which storage each node reads and writes (checked per all-gather: no
node moves past a node that reads what it writes).
Guarantees: a topological order of the same nodes; collectives and waits keep their order (no node
moves across one, so every rank issues its collectives in the same order); a node that writes
state keeps its order with respect to every node that reads what it writes.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from dcp_compile.passes.base import GraphPass, PassConfig
from dcp_compile.passes.graph_utils import fake_value, keeps_state, storage_of, written_arguments

c10d = torch.ops._c10d_functional
ALL_GATHERS = (c10d.all_gather_into_tensor.default,)


def _is_collective(node: fx.Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "namespace", None) == "_c10d_functional"


def _storages(value) -> set:
    values = value if isinstance(value, (tuple, list)) else (value,)
    return {storage_of(v) for v in values} - {None}


def _reads(node: fx.Node) -> set:
    storages = set()
    for arg in node.all_input_nodes:
        storages |= _storages(fake_value(arg))
    return storages


def _writes(node: fx.Node) -> set:
    storages = set()
    for arg in written_arguments(node):
        if isinstance(arg, fx.Node):
            storages |= _storages(fake_value(arg))
    return storages


def _window(gather: fx.Node) -> list[fx.Node]:
    """The nodes before `gather` back to (not including) the previous collective or graph input."""
    window = []
    node = gather.prev
    while node.op not in ("root", "placeholder", "get_attr") and not _is_collective(node):
        window.append(node)
        node = node.prev
    return window[::-1]


def _needed(gather: fx.Node, window: list[fx.Node]) -> set[fx.Node]:
    """The nodes of `window` that `gather` depends on."""
    inside, needed = set(window), set()
    stack = list(gather.all_input_nodes)
    while stack:
        node = stack.pop()
        if node in inside and node not in needed:
            needed.add(node)
            stack.extend(node.all_input_nodes)
    return needed


def hoist(gather: fx.Node) -> bool:
    """Move the nodes of `gather`'s window that it does not depend on to after it. Returns whether
    any node moved."""
    window = _window(gather)
    while True:
        needed = _needed(gather, window)
        # A needed node that writes state keeps its place among the other nodes: the window starts after it.
        writers = [i for i, node in enumerate(window) if node in needed and keeps_state(node)]
        if writers:
            window = window[writers[-1] + 1:]
            needed = _needed(gather, window)
        # The other nodes move past the needed nodes after them and past the gather, all pure now:
        # a node that writes what those read (a KV write before a gather of the cache) stays, and
        # the window starts after it.
        needed_reads = set().union(_reads(gather), *(_reads(n) for n in needed))
        clashes = [i for i, node in enumerate(window) if node not in needed and _writes(node) & needed_reads]
        if not clashes:
            break
        window = window[clashes[-1] + 1:]
    rest = [n for n in window if n not in needed]
    if not rest:
        return False
    anchor = gather
    for node in rest:
        anchor.append(node)
        anchor = node
    return True


class OverlapCollectives(GraphPass):
    name = "overlap_collectives"

    def applies(self, config: PassConfig) -> bool:
        return config.dcp_size > 1

    def run(self, gm: fx.GraphModule, config: PassConfig) -> int:
        gathers = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in ALL_GATHERS]
        return sum(hoist(gather) for gather in gathers)
