"""Compile regions: a step whose repeated layers dynamo captured as calls of one subgraph
(`torch.ops.higher_order.invoke_subgraph`, from `torch.compiler.nested_compile_region`; the
reference model's `MLAModel(regions=True)`) is compiled one region at a time.

    before: h1 = invoke_subgraph(layer_graph, "subgraph_0", h0, w_0..., cache_0, seq_lens, ...)[0]
            h2 = invoke_subgraph(layer_graph, "subgraph_0", h1, w_1..., cache_1, seq_lens, ...)[0]
    after:  meta = guard and local metadata of (seq_lens, ...)      # hoisted: once a step
            h1 = region_0(h0, w_0..., cache_0, seq_lens, ..., *host_values, *meta)[0]
            h2 = region_0(h1, w_1..., cache_1, seq_lens, ..., *host_values, *meta)[0]

`region_0` is the subgraph after the DCP passes and the kernel back end's lowering, compiled by
the inner compiler once for every layer that calls it, so the passes' and the inner compiler's
time stop growing with the layer count. What is left of the step around the regions (the
embedding, the last norm, the logits) runs as the captured FX code, op by op. A region's host-fed
inputs (runtime/host_inputs.py) are fed once per step and passed to each of its calls.

Why not inductor over the whole graph with the regions inside: AOTAutograd functionalizes an
invoke_subgraph's body itself and refuses a custom op that writes its input (the KV writes),
torch 2.11 to 2.13.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from dcp_compile.passes.graph_utils import InputSources, fake_value, propagate_fake, storage_of, written_arguments

INVOKE_SUBGRAPH = torch.ops.higher_order.invoke_subgraph
OUTER_SOURCES = "dcp_region_outer_sources"
"""A compile region's gm.meta key: its OuterSources, for passes that ask what step inputs a value
depends on (the absorb pass's mask rule)."""


@dataclass
class Region:
    """One distinct subgraph and the nodes that call it, in graph order."""

    name: str
    module: fx.GraphModule
    calls: list[fx.Node] = field(default_factory=list)

    def placeholders(self) -> list[fx.Node]:
        return [n for n in self.module.graph.nodes if n.op == "placeholder"]

    def operand(self, call: fx.Node, index: int):
        """A call's operand for placeholder `index` (an invoke_subgraph's, or the compiled
        region's call that replaced it)."""
        return call.args[index if call.op == "call_module" else 2 + index]

    def common_operands(self) -> dict[int, object]:
        """{placeholder index: the outer value} for the operands every call passes alike (the
        batch's metadata): what a call's subgraph may read as the same value in every layer."""
        first = self.calls[0]
        return {i: self.operand(first, i) for i in range(len(self.placeholders()))
                if all(self.operand(c, i) is self.operand(first, i) for c in self.calls)}


class OuterSources:
    """sources(placeholder name) -> the names of the outer graph's placeholders that the value its
    calls pass it depends on, in any call. Computed on demand: a layer's hidden state depends on
    every layer before it, and no pass asks for it."""

    def __init__(self, region: Region):
        self._operands = {holder.name: [region.operand(call, i) for call in region.calls]
                          for i, holder in enumerate(region.placeholders())}
        self._outer = InputSources()

    def __call__(self, name: str) -> frozenset[str]:
        if name not in self._operands:  # a placeholder a pass added: an input of its own, never allowed by default
            return frozenset([name])
        return frozenset().union(*(self._outer(v) for v in self._operands[name]))


def find_regions(gm: fx.GraphModule) -> list[Region]:
    """The graph's compile regions, in the order of their first call."""
    regions: dict[str, Region] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is INVOKE_SUBGRAPH:
            name = node.args[0].target
            if name not in regions:
                regions[name] = Region(name, getattr(gm, name))
            regions[name].calls.append(node)
    return list(regions.values())


def own_region(region: Region) -> Region:
    """The region with a copy of its subgraph (nodes and meta) that passes may rewrite."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(region.module.graph, {}))
    return Region(region.name, fx.GraphModule(region.module, graph), region.calls)


def _in_mode(value, mode):
    """`value` as a fake tensor of `mode` (the same sizes, strides, dtype and device)."""
    if not isinstance(value, FakeTensor) or value.fake_mode is mode:
        return value
    with mode:
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device)


def adopt_fake_mode(region: Region, mode) -> None:
    """Give the region's graph fake values of `mode` (the outer step's, which the inner compiler
    checks its inputs against) where dynamo traced it under a fake mode of its own (torch 2.10):
    its inputs refaked, every node's value propagated anew."""
    if mode is None or all(not isinstance(v, FakeTensor) or v.fake_mode is mode for v in examples(region)):
        return
    inputs = [_in_mode(v, mode) for v in examples(region)]
    propagate_fake(FakeTensorProp(region.module, mode), inputs)
    for node in region.module.graph.nodes:
        if "val" in node.meta:
            node.meta["example_value"] = node.meta["val"]


def examples(region: Region) -> list:
    """The region's inputs as dynamo traced them (fake tensors, symbolic where the step is)."""
    return [n.meta.get("val", n.meta.get("example_value")) for n in region.placeholders()]


def module_name(region: Region) -> str:
    """The outer graph's submodule that runs the compiled region."""
    return f"dcp_region_{region.name}"


class CompiledRegion(torch.nn.Module):
    """A compiled region in the outer graph: its calls pass their operands and then the region's
    host-fed values of the step (extra placeholders of the outer graph)."""

    def __init__(self, compiled):
        super().__init__()
        self.compiled = compiled

    def forward(self, *args):
        return self.compiled(*args)


def replace_calls(gm: fx.GraphModule, region: Region, compiled, sources: list) -> None:
    """Every call of `region` in gm becomes a call of `compiled` (a submodule of gm). sources:
    what each placeholder of the compiled region takes, in order: an int (the call's own operand
    of that index), an outer node (the same in every call), or a list of outer nodes (one per call)."""
    target = module_name(region)
    gm.add_submodule(target, CompiledRegion(compiled))
    replaced = []
    for k, call in enumerate(region.calls):
        args = [call.args[2 + s] if isinstance(s, int) else s[k] if isinstance(s, list) else s for s in sources]
        with gm.graph.inserting_before(call):
            new = gm.graph.call_module(target, tuple(args))
        new.meta.update(call.meta)
        call.replace_all_uses_with(new)
        gm.graph.erase_node(call)
        replaced.append(new)
    region.calls = replaced
    for node in [n for n in gm.graph.nodes if n.op == "get_attr" and n.target == region.name and not n.users]:
        gm.graph.erase_node(node)


def per_call_attributes(gm: fx.GraphModule, tensors: list[torch.Tensor], calls: list[fx.Node]) -> list[fx.Node]:
    """One get_attr node of gm per call, before it, reading that call's tensor (registered on gm
    as a buffer, once per tensor)."""
    made = []
    for tensor, call in zip(tensors, calls):
        name = f"dcp_region_tensor_{id(tensor)}"
        if not hasattr(gm, name):
            gm.register_buffer(name, tensor, persistent=False)
        with gm.graph.inserting_before(call):
            made.append(gm.graph.get_attr(name))
    return made


def add_outer_inputs(gm: fx.GraphModule, names: list[str], vals: list) -> list[fx.Node]:
    """New placeholders after the outer graph's last one (they take the host-fed values the
    wrapper appends to every call)."""
    last = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
    made = []
    for name, val in zip(names, vals):
        with gm.graph.inserting_after(last):
            node = gm.graph.placeholder(name)
        node.meta["val"] = val
        made.append(node)
        last = node
    return made


def read_outside(region: Region, index: int, lowered: dict[str, Region]) -> bool:
    """Whether the value the region's calls pass as placeholder `index` is read anywhere but in
    this region: by the outer graph's own nodes, or by another region that reads its placeholder.
    lowered: every region of the step after its lowering, by its module's name in the outer graph
    (call it after replace_calls)."""
    values = {region.operand(call, index) for call in region.calls}
    if len(values) != 1:
        return True  # a per-layer value, not the batch's
    value = values.pop()
    if not isinstance(value, fx.Node):
        return False
    for user in value.users:
        other = lowered.get(str(user.target)) if user.op == "call_module" else None
        if other is None:
            return True  # the outer graph's own read
        if other is region:
            continue
        holders = other.placeholders()
        if any(holders[i].users for i, arg in enumerate(user.args) if arg is value):
            return True
    return False


COLLECTIVE_NAMESPACES = ("_c10d_functional", "c10d")


def _movable(node: fx.Node) -> bool:
    """A node that may run once before the calls instead of in each: it writes nothing, and is
    neither a collective (ranks must issue theirs in one order) nor a nested region."""
    if node.op not in ("call_function", "call_method") or written_arguments(node):
        return False
    target = node.target
    return (getattr(target, "namespace", None) not in COLLECTIVE_NAMESPACES
            and not isinstance(target, torch._ops.HigherOrderOperator)
            and not (getattr(target, "__module__", None) or "").startswith("torch.distributed"))


def written_operands(gm: fx.GraphModule, found: list[Region]) -> set[fx.Node]:
    """The outer values the step writes: in the outer graph, or as a region's input in some call
    (a KV cache, a layer's recurrent state). A region's code that reads one runs in the region."""
    written = {w for node in gm.graph.nodes for w in written_arguments(node) if isinstance(w, fx.Node)}
    for region in found:
        holders = {storage_of(fake_value(h)): i for i, h in enumerate(region.placeholders())}
        holders.pop(None, None)
        for node in region.module.graph.nodes:
            for w in written_arguments(node):
                index = holders.get(storage_of(fake_value(w))) if isinstance(w, fx.Node) else None
                if index is not None:
                    written.update(region.operand(call, index) for call in region.calls)
    return written


def _values(value) -> list:
    return list(value) if isinstance(value, (tuple, list)) else [value]


def hoist_invariants(gm: fx.GraphModule, region: Region, invariant: dict[fx.Node, fx.Node]) -> dict[fx.Node, fx.Node]:
    """Move the region's nodes whose value is the same in every call (they read only `invariant`
    placeholders: {placeholder: the outer node every call passes}, and write nothing) into the
    outer graph, before the region's first call: the batch's guard and local metadata then run
    once a step, not once a layer. The tensors the region still reads from them become placeholders
    after its last one; returns {each of those placeholders: the outer node the calls pass it}."""
    graph = region.module.graph
    # Memory some node of the region writes (the KV cache, a buffer the layer fills in place) is
    # state: a node that reads it must run after the write, in the region, and one that makes it
    # is made anew in each call.
    written = {storage_of(fake_value(w)) for n in graph.nodes for w in written_arguments(n) if isinstance(w, fx.Node)}
    written.discard(None)
    blocked: set[fx.Node] = set()
    while True:
        outside = set(invariant)
        for node in graph.nodes:
            touched = [v for n in (node, *node.all_input_nodes) for v in _values(fake_value(n))]
            if (node not in blocked and _movable(node) and all(i in outside for i in node.all_input_nodes)
                    and not any(storage_of(v) in written for v in touched)):
                outside.add(node)
        # What crosses into the region must be a tensor (a compiled region's input): a node of
        # another value that the region reads stays in it, and so does what is computed from it.
        stuck = [n for n in outside if n not in invariant and not isinstance(fake_value(n), torch.Tensor)
                 and any(u not in outside for u in n.users)]
        if not stuck:
            break
        blocked.update(stuck)
    moved = [n for n in graph.nodes if n in outside and n not in invariant]
    outer = dict(invariant)
    for node in moved:
        with gm.graph.inserting_before(region.calls[0]):
            outer[node] = gm.graph.node_copy(node, outer.__getitem__)
    passed = {}
    last = region.placeholders()[-1]
    for node in [n for n in moved if any(u not in outside for u in n.users)]:
        with graph.inserting_after(last):
            last = graph.placeholder(f"hoisted_{node.name}")
        last.meta.update(node.meta)
        node.replace_all_uses_with(last, delete_user_cb=lambda user: user not in outside)
        passed[last] = outer[node]
    for node in reversed(moved):
        graph.erase_node(node)
    region.module.recompile()
    return passed
