"""Guards for the speedups that make the pass pipeline fast enough for `dcp-compile dump` and
bench/pass_pipeline.py on 61-layer graphs: verify propagates each distinct (op, input metadata)
once, and graph_utils.call reuses the fake result of a pure op. Neither may change a result."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from dcp_compile.passes.graph_utils import call, fake_mode_of
from dcp_compile.passes.verify import GraphVerificationError, Verify, _SharedFakeTensorProp
from dcp_compile.ops import targets
from tests.harness import fake_graph, run_passes

aten = torch.ops.aten


@pytest.fixture(scope="module")
def rewritten():
    gm, report, _ = run_passes(fake_graph("tiny", dcp_size=2, tp_size=2), dcp_size=2)
    assert report.sites("gather_q_attention") == 3
    return gm


def _propagated(gm: fx.GraphModule, prop_class) -> list:
    gm = copy.deepcopy(gm)
    mode = fake_mode_of(gm.graph)
    placeholders = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
    prop_class(gm, mode).propagate_dont_convert_inputs(*placeholders)

    def describe(value):
        if isinstance(value, (tuple, list)):
            return tuple(describe(v) for v in value)
        if isinstance(value, torch.Tensor):
            return (tuple(value.shape), value.stride(), value.dtype, value.device)
        return value

    return [(n.name, describe(n.meta.get("val"))) for n in gm.graph.nodes]


def test_shared_propagation_equals_plain_fake_tensor_prop(rewritten):
    assert _propagated(rewritten, _SharedFakeTensorProp) == _propagated(rewritten, FakeTensorProp)


def test_a_wrong_value_in_a_repeated_layer_is_still_caught(rewritten):
    gm = copy.deepcopy(rewritten)
    merges = [n for n in gm.graph.nodes if n.target is targets.MERGE_PARTIALS]
    assert len(merges) == 3
    good = merges[-1].meta["val"]
    with fake_mode_of(gm.graph):
        merges[-1].meta["val"] = torch.empty(good.shape[0], good.shape[1] + 1, good.shape[2], dtype=good.dtype, device=good.device)
    with pytest.raises(GraphVerificationError, match=merges[-1].name):
        Verify().run(gm, None)


def test_call_keys_on_constant_types():
    """x * 2 and x * 2.0 hash alike but differ in dtype: the reuse must tell them apart."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    with FakeTensorMode() as mode:
        x.meta["val"] = torch.empty(4, dtype=torch.int64)
    by_int = call(graph, aten.mul.Tensor, x, 2)
    by_float = call(graph, aten.mul.Tensor, x, 2.0)
    again = call(graph, aten.mul.Tensor, x, 2)
    assert by_int.meta["val"].dtype == again.meta["val"].dtype == torch.int64
    assert by_float.meta["val"].dtype == torch.float32
    assert fake_mode_of(graph) is mode

