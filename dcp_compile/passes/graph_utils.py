"""Small FX helpers shared by the passes: fake values, node insertion with meta, op counts."""

from __future__ import annotations

import collections
import weakref

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.node import map_arg


def fake_value(node):
    """The fake tensor (or tuple of them) a node produces, whichever key the tracer used."""
    if not isinstance(node, fx.Node):
        return node
    return node.meta.get("val", node.meta.get("example_value"))


def normalize_meta(graph: fx.Graph) -> None:
    """Dynamo records `example_value`; the passes and the printer read `val`."""
    for node in graph.nodes:
        if "val" not in node.meta and "example_value" in node.meta:
            node.meta["val"] = node.meta["example_value"]


_FAKE_MODES: "weakref.WeakKeyDictionary[fx.Graph, object]" = weakref.WeakKeyDictionary()


def fake_mode_of(graph: fx.Graph):
    """The FakeTensorMode the graph's values belong to (looked up once per graph)."""
    if graph not in _FAKE_MODES:
        _FAKE_MODES[graph] = _find_fake_mode(graph)
    return _FAKE_MODES[graph]


def _find_fake_mode(graph: fx.Graph):
    for node in graph.nodes:
        vals = fake_value(node)
        for val in vals if isinstance(vals, (tuple, list)) else (vals,):
            if isinstance(val, FakeTensor):
                return val.fake_mode
    return None


def call(graph: fx.Graph, target, *args, **kwargs) -> fx.Node:
    """Insert call_function(target) at the graph's insertion point and set meta['val'] by
    running target on the arguments' fake values."""
    node = graph.call_function(target, args, kwargs)
    mode = fake_mode_of(graph)
    fake_args = map_arg(args, fake_value)
    fake_kwargs = map_arg(kwargs, fake_value)
    if mode is not None:
        with mode:
            node.meta["val"] = target(*fake_args, **fake_kwargs)
    return node


def op_name(node: fx.Node) -> str:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}::{target._opname}"
    if isinstance(target, torch._ops.OpOverloadPacket):
        return str(target).replace(".", "::", 1)
    return getattr(target, "__name__", str(target))


def op_counts(graph: fx.Graph) -> collections.Counter:
    return collections.Counter(op_name(n) for n in graph.nodes if n.op in ("call_function", "call_method"))
