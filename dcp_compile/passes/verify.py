"""Verify the rewritten graph: FX lint, then shape propagation with fake tensors.

Guarantees: every node's recorded fake value matches what propagation computes, in shape and
dtype; a pass that built an ill-typed graph fails here, at compile time, not at run time.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from dcp_compile.passes.base import GraphPass, PassConfig
from dcp_compile.passes.graph_utils import fake_mode_of, fake_value


class GraphVerificationError(RuntimeError):
    pass


def _same(expected, got) -> bool:
    if isinstance(expected, torch.Tensor) and isinstance(got, torch.Tensor):
        return tuple(expected.shape) == tuple(got.shape) and expected.dtype == got.dtype
    if isinstance(expected, (tuple, list)) and isinstance(got, (tuple, list)):
        return len(expected) == len(got) and all(_same(e, g) for e, g in zip(expected, got))
    return True


class Verify(GraphPass):
    name = "verify"

    def run(self, gm: fx.GraphModule, config: PassConfig) -> int:
        gm.graph.lint()
        mode = fake_mode_of(gm.graph)
        if mode is None:
            return 0
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        expected = {n: fake_value(n) for n in gm.graph.nodes}
        inputs = [fake_value(n) for n in placeholders]
        FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*inputs)
        checked = 0
        for node in gm.graph.nodes:
            got = node.meta.get("val")
            if expected[node] is not None and not _same(expected[node], got):
                raise GraphVerificationError(f"node {node.format_node()} recorded {expected[node]} but propagates to {got}")
            checked += 1
        return checked
