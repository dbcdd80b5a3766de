"""Small FX helpers shared by the passes: fake values, node insertion with meta, op counts."""

from __future__ import annotations

import collections
import operator
import weakref

import torch
import torch.fx as fx
from torch._dispatch.python import enable_python_dispatcher
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols, statically_known_true
from torch.fx.node import map_arg
from torch.multiprocessing.reductions import StorageWeakRef


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


def record_example_values(graph: fx.Graph) -> None:
    """The reverse of normalize_meta for the nodes passes inserted: `example_value` where only
    `val` is set. AOTAutograd's cache accepts a method call only on a node that has one (it
    bypasses the cache otherwise, and a warm start then redoes the whole AOT trace)."""
    for node in graph.nodes:
        if "example_value" not in node.meta and "val" in node.meta:
            node.meta["example_value"] = node.meta["val"]


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
    """A value whose metadata does not determine what an op computes from it (or is data-dependent)."""


_CONSTANT_TYPES = (type(None), bool, int, float, str, torch.dtype, torch.device, torch.layout, torch.memory_format)


def fake_signature(value):
    """Everything about a fake value (or constant, or a structure of them) that the metadata an
    op computes from it can depend on; raises UncacheableValue for anything else.

    The type is part of the key because 2 and 2.0 (and True) hash alike yet promote differently.
    """
    if isinstance(value, FakeTensor):
        shape, stride = tuple(value.shape), value.stride()
        return (FakeTensor, _sizes(shape), _sizes(stride), _size(value.storage_offset()), value.dtype, value.device,
                value.layout, value.requires_grad, value.is_conj(), value.is_neg())
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return _size(value)
    if isinstance(value, _CONSTANT_TYPES) or value is Ellipsis:
        return (type(value), value)
    if isinstance(value, (tuple, list)):
        return (type(value), tuple(fake_signature(v) for v in value))
    if isinstance(value, slice):
        return (slice, fake_signature(value.start), fake_signature(value.stop), fake_signature(value.step))
    if isinstance(value, dict):
        return (dict, tuple((k, fake_signature(v)) for k, v in value.items()))
    raise UncacheableValue


def _size(value):
    """An int, or a symbolic size as its expression over the graph's backed symbols: within one
    shape environment, equal expressions are equal sizes (a batch-symbolic graph's layers repeat
    the same ones). A size over an unbacked symbol (data-dependent) is not a key."""
    if type(value) is int:
        return value
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        if free_unbacked_symbols(value):
            raise UncacheableValue
        return (type(value), value.node.expr)
    raise UncacheableValue


def _sizes(values) -> tuple:
    return tuple(_size(v) for v in values)


def is_fake_result(value) -> bool:
    """A fake tensor or a non-empty tuple/list of them: what a pure op's result may be reused as."""
    if isinstance(value, FakeTensor):
        return True
    return isinstance(value, (tuple, list)) and len(value) > 0 and all(isinstance(v, FakeTensor) for v in value)


_CALL_RESULTS: "weakref.WeakKeyDictionary[object, dict]" = weakref.WeakKeyDictionary()


def is_size(node: fx.Node) -> bool:
    """An int or a symbolic size (a dynamic dimension's value, or one read off a tensor's shape):
    the shape of a batch, never its data."""
    return isinstance(node.meta.get("example_value", node.meta.get("val")), (int, torch.SymInt))


class InputSources:
    """sources(node) -> the names of the graph inputs its value depends on (a size depends on none),
    memoized and walked without recursion (a step's graph is long). resolve(name): what a
    placeholder stands for (a compile region's: the outer graph's inputs its calls pass it,
    dcp_compile/regions.py); by default its own name."""

    def __init__(self, resolve=None):
        self._resolve = resolve or (lambda name: frozenset([name]))
        self._memo: dict[fx.Node, frozenset[str]] = {}

    def __call__(self, value) -> frozenset[str]:
        if not isinstance(value, fx.Node):
            return frozenset()
        stack = [value]
        while stack:
            node = stack[-1]
            if node in self._memo:
                stack.pop()
                continue
            pending = [] if is_size(node) else [p for p in node.all_input_nodes if p not in self._memo]
            if pending:
                stack.extend(pending)
                continue
            stack.pop()
            if is_size(node):
                self._memo[node] = frozenset()
            elif node.op == "placeholder":
                self._memo[node] = self._resolve(node.name)
            else:
                self._memo[node] = frozenset().union(*(self._memo[p] for p in node.all_input_nodes))
        return self._memo[value]


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
    # The Python dispatcher, as dynamo's own fake propagation: composite ops (linear's matmul)
    # take their Python decompositions, which serve symbolic sizes where the C++ ones (numel())
    # raise "Cannot call numel() on tensor with symbolic sizes/strides" (seen on CUDA).
    with mode, enable_python_dispatcher():
        node.meta["val"] = target(*fake_args, **fake_kwargs)
    if key is not None and is_fake_result(node.meta["val"]):
        results[key] = node.meta["val"]
    return node


def propagate_fake(prop, inputs) -> None:
    """Every node's fake value through `prop` (a FakeTensorProp) from fake `inputs`, under the
    Python dispatcher for the reason `call` gives (FakeTensorProp enters only its mode)."""
    with enable_python_dispatcher():
        prop.propagate_dont_convert_inputs(*inputs)


def same_shape(a, b) -> bool:
    """Whether two shapes are provably equal, static or symbolic, without adding a guard (a
    compare of SymInts would specialise the graph on its outcome)."""
    return len(a) == len(b) and all(statically_known_true(x == y) for x, y in zip(a, b))


def maybe_same_shape(a, b) -> bool:
    """Whether two shapes may be equal: in a symbolic graph, independent sizes (each input's own
    symbol) are not provably equal, but may well be at run time."""
    return len(a) == len(b) and not any(statically_known_true(x != y) for x, y in zip(a, b))


def size_of(graph: fx.Graph, node: fx.Node, dim: int):
    """Dimension `dim` of node's value as a node argument: the int of a static size, or a
    sym_size node (at the insertion point) for a symbolic one, which no argument may hold itself."""
    size = fake_value(node).shape[dim]
    return size if isinstance(size, int) else call(graph, torch.ops.aten.sym_size.int, node, dim)


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
    if old.dtype != new.dtype or not same_shape(old.shape, new.shape):
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


_IN_PLACE_OPERATORS = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
                       operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift,
                       operator.irshift, operator.imatmul, operator.setitem}


def _in_place_name(target) -> bool:
    name = target if isinstance(target, str) else getattr(target, "__name__", "")
    return name.endswith("_") and not name.endswith("__")


def written_arguments(node: fx.Node) -> list:
    """The arguments `node` writes in place: the tensor of an in-place method or function
    (`buf.add_(1)`, `torch.relu_(x)`, `x += 1`, `x[i] = v`), an `out=` tensor, or the mutable
    arguments of an op overload's schema. Empty for a node that writes nothing."""
    if node.op not in ("call_function", "call_method"):
        return []
    written = []
    if isinstance(node.target, torch._ops.OpOverload):
        for i, argument in enumerate(node.target._schema.arguments):
            if argument.alias_info is not None and argument.alias_info.is_write:
                written.append(node.args[i] if i < len(node.args) else node.kwargs.get(argument.name))
    elif node.args and (_in_place_name(node.target) or node.target in _IN_PLACE_OPERATORS):
        written.append(node.args[0])
    out = node.kwargs.get("out")
    written.extend(out if isinstance(out, (tuple, list)) else [out] if out is not None else [])
    return [w for w in written if w is not None]


def keeps_state(node: fx.Node) -> bool:
    """Whether dead-code elimination must keep `node` although nothing reads its result: FX's
    own impurity (placeholders, outputs, mutable op overloads, side-effectful functions), or a
    write into a tensor, which FX's rule misses for methods (`self.counter.add_(1)`)."""
    return node.is_impure() or bool(written_arguments(node))


def storage_of(value):
    """The storage a (fake) tensor lives in, as a hashable reference; None for anything else."""
    return StorageWeakRef(value.untyped_storage()) if isinstance(value, torch.Tensor) else None


def mutated_inputs(graph: fx.Graph) -> set[str]:
    """Names of the graph inputs (placeholders, and attributes read with get_attr) whose memory
    some node writes: a model's KV caches, its counters and its other state."""
    inputs = {}
    for node in graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            storage = storage_of(fake_value(node))
            if storage is not None:
                inputs.setdefault(storage, node.name)
    mutated = set()
    for node in graph.nodes:
        for written in written_arguments(node):
            storage = storage_of(fake_value(written)) if isinstance(written, fx.Node) else None
            if storage in inputs:
                mutated.add(inputs[storage])
    return mutated
