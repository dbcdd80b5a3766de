"""overlap_collectives: each all-gather issued as soon as its input exists, checked on the node order
of the reference model's rewritten graph (the order `dcp-compile dump` shows)."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx

from dcp_compile.passes.overlap_collectives import hoist
from tests.harness import fake_graph, run_passes, tiny_graph

c10d = torch.ops._c10d_functional
LINEAR = (torch._C._nn.linear, torch.nn.functional.linear)


def _positions(gm: fx.GraphModule) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(gm.graph.nodes)}


def _calls(gm, target) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target == target]


def _ancestors(node: fx.Node) -> set[fx.Node]:
    seen, stack = set(), list(node.all_input_nodes)
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


def _kv_writes(gm) -> list[fx.Node]:
    """The sharded KV writes, canonical or lowered to a back end's writer."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and "kv_write" in str(n.target)]


def _collectives(gm) -> list:
    return [n.target for n in gm.graph.nodes
            if n.op == "call_function" and getattr(n.target, "namespace", None) == "_c10d_functional"]


@pytest.fixture(scope="module")
def graph():
    return tiny_graph()  # three MLA layers and a linear-attention one


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_each_q_gather_is_issued_before_its_layers_kv_path(graph, kernels):
    gm, report, recorder = run_passes(graph, dcp_size=2, kernels=kernels)
    order = _positions(gm)
    gathers = _calls(gm, c10d.all_gather_into_tensor.default)
    writes = _kv_writes(gm)
    assert len(gathers) == len(writes) == 3
    assert report.sites("overlap_collectives") == 3
    for gather, write in zip(gathers, writes):
        (wait,) = gather.users
        assert wait.target == c10d.wait_tensor.default
        assert order[gather] < order[write] < order[wait]  # issue, the layer's KV write, then the wait
        # The KV projection (the matmul the write depends on and the gather does not) follows the issue.
        (kv_projection,) = [n for n in _ancestors(write) - _ancestors(gather)
                            if n.op == "call_function" and n.target in LINEAR]
        assert order[gather] < order[kv_projection]
        # The q path all precedes it: nothing the gather needs was moved after it.
        assert all(order[n] < order[gather] for n in _ancestors(gather))
    assert recorder.ops("overlap_collectives", "before") == recorder.ops("overlap_collectives", "after")


def test_without_the_schedule_the_gather_follows_the_kv_write(graph):
    gm, _, _ = run_passes(graph, dcp_size=2, disabled=("overlap_collectives",))
    order = _positions(gm)
    for gather, write in zip(_calls(gm, c10d.all_gather_into_tensor.default), _kv_writes(gm)):
        assert order[write] < order[gather]


def test_the_schedule_keeps_a_topological_order_and_the_collective_order(graph):
    unscheduled, _, _ = run_passes(graph, dcp_size=2, disabled=("overlap_collectives",))
    gm, _, _ = run_passes(graph, dcp_size=2)
    gm.graph.lint()  # every node after its inputs
    assert _collectives(gm) == _collectives(unscheduled)


def test_gather_kv_strategy_issues_its_kv_gather_early(graph):
    gm, report, _ = run_passes(graph, dcp_size=2, attention_strategy="gather-kv")
    assert report.sites("overlap_collectives") >= 1
    gm.graph.lint()


def test_kimi_graph_at_tp_two_keeps_every_collective_in_order():
    """Kimi-K2 layers at TP 2, DCP 2 (shapes only): the Q gathers, all-to-alls and TP all-reduces
    in the same order as before the schedule, each gather ahead of its layer's KV write."""
    gm = fake_graph("kimi-k2", "decode", layers=3, tp_size=2, batch=4)
    unscheduled, _, _ = run_passes(gm, dcp_size=2, disabled=("overlap_collectives",))
    scheduled, report, _ = run_passes(gm, dcp_size=2)
    assert report.sites("overlap_collectives") == 3
    assert _collectives(scheduled) == _collectives(unscheduled)
    order = _positions(scheduled)
    for gather, write in zip(_calls(scheduled, c10d.all_gather_into_tensor.default),
                             _kv_writes(scheduled)):
        assert order[gather] < order[write]


def _small_graph(reads_what_is_written: bool):
    """x, buf -> buf.add_(x) (a state write the gather does not need); q from x or from buf; gather(q)."""
    graph = fx.Graph()
    x, buf = graph.placeholder("x"), graph.placeholder("buf")
    x.meta["val"], buf.meta["val"] = torch.ones(2), torch.zeros(2)
    write = graph.call_function(torch.ops.aten.add_.Tensor, (buf, x))
    write.meta["val"] = buf.meta["val"]
    q = graph.call_function(torch.ops.aten.mul.Tensor, (buf if reads_what_is_written else x, 2))
    q.meta["val"] = torch.ones(2)
    gather = graph.call_function(c10d.all_gather_into_tensor.default, (q, 2, "g"))
    wait = graph.call_function(c10d.wait_tensor.default, (gather,))
    graph.output((wait, write))
    return graph, gather, [write, q, gather, wait]


def test_an_independent_state_write_moves_after_the_gather():
    graph, gather, (write, q, _, wait) = _small_graph(reads_what_is_written=False)
    assert hoist(gather) is True
    assert [n for n in graph.nodes if n.op == "call_function"] == [q, gather, write, wait]


def test_a_write_the_gathers_input_reads_keeps_its_place():
    graph, gather, nodes = _small_graph(reads_what_is_written=True)
    assert hoist(gather) is False
    assert [n for n in graph.nodes if n.op == "call_function"] == nodes
