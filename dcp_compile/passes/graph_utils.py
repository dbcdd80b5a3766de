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


class UncacheableValue(Exception):
    """A value whose metadata does not determine what an op computes from it (or is symbolic)."""


_CONSTANT_TYPES = (type(None), bool, int, float, str, torch.dtype, torch.device, torch.layout, torch.memory_format)


def fake_signature(value):
    """Everything about a fake value (or constant, or a structure of them) that the metadata an
    op computes from it can depend on; raises UncacheableValue for anything else.

    The type is part of the key because 2 and 2.0 (and True) hash alike yet promote differently.
    """
    if isinstance(value, FakeTensor):
        shape, stride = tuple(value.shape), value.stride()
        if not all(type(d) is int for d in shape + stride):
            raise UncacheableValue
        return (FakeTensor, shape, stride, value.storage_offset(), value.dtype, value.device, value.layout,
                value.requires_grad, value.is_conj(), value.is_neg())
    if isinstance(value, _CONSTANT_TYPES) or value is Ellipsis:
        return (type(value), value)
    if isinstance(value, (tuple, list)):
        return (type(value), tuple(fake_signature(v) for v in value))
    if isinstance(value, slice):
        return (slice, fake_signature(value.start), fake_signature(value.stop), fake_signature(value.step))
    if isinstance(value, dict):
        return (dict, tuple((k, fake_signature(v)) for k, v in value.items()))
    raise UncacheableValue


def is_fake_result(value) -> bool:
    """A fake tensor or a non-empty tuple/list of them: what a pure op's result may be reused as."""
    if isinstance(value, FakeTensor):
        return True
    return isinstance(value, (tuple, list)) and len(value) > 0 and all(isinstance(v, FakeTensor) for v in value)


_CALL_RESULTS: "weakref.WeakKeyDictionary[object, dict]" = weakref.WeakKeyDictionary()


def call(graph: fx.Graph, target, *args, **kwargs) -> fx.Node:
    """Insert call_function(target) at the graph's insertion point and set meta['val'] by
    running target on the arguments' fake values.

    A pure op overload already run on arguments with the same metadata (the same rewrite in an
    earlier layer) reuses that fake result instead of dispatching again."""
    node = graph.call_function(target, args, kwargs)
    mode = fake_mode_of(graph)
    if mode is None:
        return node
    fake_args = map_arg(args, fake_value)
    fake_kwargs = map_arg(kwargs, fake_value)
    key = None
    if isinstance(target, torch._ops.OpOverload) and not target._schema.is_mutable:
        try:
            key = (target, fake_signature(fake_args), fake_signature(fake_kwargs))
        except (UncacheableValue, TypeError):
            key = None
    results = _CALL_RESULTS.setdefault(mode, {})
    if key is not None and key in results:
        node.meta["val"] = results[key]
        return node
    with mode:
        node.meta["val"] = target(*fake_args, **fake_kwargs)
    if key is not None and is_fake_result(node.meta["val"]):
        results[key] = node.meta["val"]
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


class RewriteError(RuntimeError):
    """A pass built a replacement that breaks the canonical op's promise."""


def check_replacement(replaced: fx.Node, replacement: fx.Node, pass_name: str) -> None:
    """The node standing in for `replaced` must keep its dtype and shape: model code after an
    MLA site relies on what the canonical op promises."""
    old, new = fake_value(replaced), fake_value(replacement)
    if not isinstance(old, torch.Tensor) or not isinstance(new, torch.Tensor):
        return
    if old.dtype != new.dtype or tuple(old.shape) != tuple(new.shape):
        raise RewriteError(
            f"{pass_name} replaced {replaced.format_node()} ({old.dtype}, {tuple(old.shape)}) with a value of "
            f"{new.dtype}, {tuple(new.shape)}"
        )


def replace_attention(graph: fx.Graph, node: fx.Node, returns_lse: bool, out: fx.Node, lse: fx.Node, pass_name: str) -> None:
    """Replace an attention node by (out, lse): a partial attention's getitem users, or a
    canonical attention's (output only) uses; then erase it."""
    if returns_lse:
        for user in list(node.users):  # getitem 0 (out) and 1 (lse)
            replacement = out if user.args[1] == 0 else lse
            check_replacement(user, replacement, pass_name)
            user.replace_all_uses_with(replacement)
            graph.erase_node(user)
    else:
        check_replacement(node, out, pass_name)
        node.replace_all_uses_with(out)
    graph.erase_node(node)
