"""Verify the rewritten graph: FX lint, the state it writes, then shape propagation with fake
tensors.

Guarantees: every graph input the captured graph wrote in place (KV caches, a model's counters
and buffers) is still written (the pass manager records them before the first pass, in
gm.meta[CAPTURED_MUTATIONS]); every node's recorded fake value matches what propagation
computes, in shape and dtype. A pass that dropped a mutation or built an ill-typed graph fails
here, at compile time, not at run time.

Propagation runs each distinct (op, input metadata) once: the layers of a model repeat the same
ops on the same shapes, so a 61-layer graph costs about one layer of fake-tensor dispatch plus a
dictionary lookup per node. Every node is still checked against its own recorded value.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from dcp_compile.passes.base import GraphPass, PassConfig
from dcp_compile.passes.graph_utils import (UncacheableValue, fake_mode_of, fake_signature, fake_value, is_fake_result,
                                            mutated_inputs, propagate_fake, same_shape, written_arguments)

CAPTURED_MUTATIONS = "dcp_captured_mutations"
"""gm.meta key: names of the inputs the graph wrote as captured, before any pass ran."""


class GraphVerificationError(RuntimeError):
    pass


def _same(expected, got) -> bool:
    if isinstance(expected, torch.Tensor) and isinstance(got, torch.Tensor):
        return same_shape(expected.shape, got.shape) and expected.dtype == got.dtype
    if isinstance(expected, (tuple, list)) and isinstance(got, (tuple, list)):
        return len(expected) == len(got) and all(_same(e, g) for e, g in zip(expected, got))
    return True


# Impure only in that DCE must keep them in order: they return their input's metadata.
_ORDERING_ONLY = (torch.ops._c10d_functional.wait_tensor.default, torch.ops._c10d_functional.wait_tensor)


class _SharedFakeTensorProp(FakeTensorProp):
    """FakeTensorProp that reuses the result of an earlier node with the same op and the same
    input metadata. Only pure call_function/call_method nodes (and collective waits) whose sizes
    are ints or expressions of backed symbols are reused (a batch-symbolic graph's layers repeat
    the same expressions); placeholders, mutating, random and higher-order ops always run. A
    reused node records the same fake value object as the node it repeats: fake values are
    read-only metadata, and a fresh snapshot per node would cost as much as the propagation it
    saves."""

    def __init__(self, module: fx.GraphModule, mode):
        super().__init__(module, mode)
        self._results: dict = {}
        self._signatures: dict[fx.Node, object] = {}

    def _key(self, node: fx.Node):
        if node.op not in ("call_function", "call_method") or written_arguments(node):
            return None
        if isinstance(node.target, torch._ops.HigherOrderOperator):
            return None
        if node.is_impure() and node.target not in _ORDERING_ONLY:
            return None

        def input_signature(arg):
            if isinstance(arg, fx.Node):
                signature = self._signatures.get(arg)
                if signature is None:
                    raise UncacheableValue
                return signature
            if isinstance(arg, (tuple, list)):
                return (type(arg), tuple(input_signature(a) for a in arg))
            if isinstance(arg, dict):
                return (dict, tuple((k, input_signature(v)) for k, v in arg.items()))
            return fake_signature(arg)

        try:
            return (node.op, node.target, input_signature(node.args), input_signature(node.kwargs))
        except (UncacheableValue, TypeError):
            return None

    def run_node(self, n: fx.Node):
        if n.op == "get_attr" and is_fake_result(n.meta.get("val")):
            return n.meta["val"]  # a real tensor the graph reads (a lowering's KV parts): its fake value
        key = self._key(n)
        hit = self._results.get(key) if key is not None else None
        if hit is not None:
            result, signature, n.meta["val"] = hit
        else:
            result = super().run_node(n)
            try:
                signature = fake_signature(result)
            except UncacheableValue:
                signature = None
            if key is not None and signature is not None and is_fake_result(result) and "unbacked_bindings" not in n.meta:
                self._results[key] = (result, signature, n.meta["val"])
        if signature is not None:
            self._signatures[n] = signature
        return result


class Verify(GraphPass):
    name = "verify"

    def run(self, gm: fx.GraphModule, config: PassConfig) -> int:
        gm.graph.lint()
        lost = sorted(gm.meta.get(CAPTURED_MUTATIONS, set()) - mutated_inputs(gm.graph))
        if lost:
            raise GraphVerificationError(
                f"the captured graph wrote {lost} in place, and the rewritten graph no longer does: a pass dropped a "
                "state update of the model (a counter, a cache, a buffer)"
            )
        mode = fake_mode_of(gm.graph)
        if mode is None:
            return 0
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        expected = {n: fake_value(n) for n in gm.graph.nodes}
        inputs = [fake_value(n) for n in placeholders]
        propagate_fake(_SharedFakeTensorProp(gm, mode), inputs)
        checked = 0
        for node in gm.graph.nodes:
            got = node.meta.get("val")
            if expected[node] is not None and not _same(expected[node], got):
                raise GraphVerificationError(f"node {node.format_node()} recorded {expected[node]} but propagates to {got}")
            checked += 1
        return checked
