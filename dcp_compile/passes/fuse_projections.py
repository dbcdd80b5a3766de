"""Fuse the projections that read one input into one matmul (horizontal fusion).

    before: a = linear(x, W_a);  b = linear(x, W_b)                 (q_a and kv_a; gate and up)
    after:  ab = linear(x, W_ab);  a, b = split(ab, [n_a, n_b], -1)   W_ab = cat(W_a, W_b), a graph constant

At a decode step a projection is a matrix-vector product that reads its whole weight for a few
tokens. cuBLAS reads two small weights slower than their concatenation (on an H200 at 4 tokens,
q_a and kv_a 19.1 us apart and 13.7 us fused, gate and up 25.6 us and 20.4 us:
bench/results/decode_gemms_h200.json), which is why serving engines load MLA's q_a/kv_a and an
MLP's gate/up as one weight. This pass does it for any model, at compile time.

Memory: the fused weight is not a copy. The first graph that fuses a group concatenates the
weights once and, when the inner compiler is done, points each parameter at its rows of the
result (`param.data` becomes a view), so the old storage is freed (the weights are held twice
only while that graph compiles), and the model, its state_dict and an in-place weight update see the
same memory the fused matmul reads. A later graph finds the parameters already laid out so and
fuses without copying. A group whose parameters a graph compiled earlier already read unfused
is left alone, since a captured device graph may hold their old addresses.

Assumes: the backend bound the real parameters of the graph's weight placeholders
(FUSABLE_WEIGHTS, bind_weights). Fuses only bias-free linears of 2-D, contiguous parameters of one
dtype, device and input width, at least two on the same input.
Guarantees: each fused output equals its linear up to matmul rounding; every other node is
untouched; the parameters keep their values.
Why a pass: the model stays as written (and as its checkpoints name its weights); the weights
are only known, and only laid out, when a graph is compiled.
"""

from __future__ import annotations

import logging
import operator
import weakref
from dataclasses import dataclass

import torch
import torch.fx as fx

from dcp_compile.passes.base import GraphPass, PassConfig
from dcp_compile.passes.graph_utils import call, fake_mode_of, fake_value

log = logging.getLogger("dcp_compile")

FUSABLE_WEIGHTS = "dcp_fusable_weights"
"""gm.meta key: {placeholder name: the nn.Parameter the graph receives there}."""
PENDING_VIEWS = "dcp_fused_weight_views"
"""gm.meta key: [(parameter, fused weight, first row)]: the parameters to point at their rows of
a fused weight once the inner compiler is done (finish_fusion). Not before: inductor checks its
example inputs against what dynamo traced, storage offsets included."""

LINEARS = (torch._C._nn.linear, torch.nn.functional.linear, torch.ops.aten.linear.default)

_SEEN: dict[int, weakref.ref] = {}
"""Parameters some compiled graph already takes as inputs (by id, checked by identity):
re-pointing one could strand the address a captured device graph reads."""


def _seen(weight: torch.Tensor) -> bool:
    ref = _SEEN.get(id(weight))
    return ref is not None and ref() is weight


def bind_weights(gm: fx.GraphModule, example_inputs) -> None:
    """Record which placeholders receive which 2-D parameters, and mark them seen for later graphs."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    bound = {}
    for node, value in zip(placeholders, example_inputs):
        # Plain parameters only: a tensor subclass (DTensor, a quantized weight) keeps its own layout.
        if isinstance(value, torch.nn.Parameter) and type(value.data) is torch.Tensor and value.dim() == 2:
            bound[node.name] = (value, _seen(value))
    gm.meta[FUSABLE_WEIGHTS] = bound
    for value, _ in bound.values():
        _SEEN[id(value)] = weakref.ref(value)


@dataclass
class ProjectionGroup:
    input: fx.Node
    linears: list[fx.Node]
    weights: list[torch.nn.Parameter]
    seen: bool


def _weight_of(node: fx.Node, bound: dict):
    if node.op != "call_function" or node.target not in LINEARS or len(node.args) < 2:
        return None
    if (node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")) is not None:
        return None
    weight = node.args[1]
    if not isinstance(weight, fx.Node) or weight.op != "placeholder" or weight.name not in bound:
        return None
    return bound[weight.name]


def find_projection_groups(gm: fx.GraphModule) -> list[ProjectionGroup]:
    bound = gm.meta.get(FUSABLE_WEIGHTS, {})
    groups: dict[tuple, ProjectionGroup] = {}
    claimed: set[int] = set()
    for node in gm.graph.nodes:
        entry = _weight_of(node, bound)
        if entry is None or not isinstance(node.args[0], fx.Node):
            continue
        weight, seen = entry
        if id(weight) in claimed or not weight.is_contiguous():
            continue
        key = (node.args[0], weight.dtype, weight.device, weight.shape[1])
        group = groups.setdefault(key, ProjectionGroup(node.args[0], [], [], False))
        group.linears.append(node)
        group.weights.append(weight)
        group.seen |= seen
        claimed.add(id(weight))
    return [g for g in groups.values() if len(g.linears) >= 2]


def _packed_base(weights: list[torch.Tensor]) -> torch.Tensor | None:
    """The fused weight if `weights` already are consecutive rows of one buffer, in order."""
    storage, first = weights[0].untyped_storage(), weights[0].storage_offset()
    offset = first
    for w in weights:
        if w.untyped_storage().data_ptr() != storage.data_ptr() or w.storage_offset() != offset:
            return None
        offset += w.numel()
    rows, width = sum(w.shape[0] for w in weights), weights[0].shape[1]
    return torch.empty(0, dtype=weights[0].dtype, device=weights[0].device).set_(storage, first, (rows, width), (width, 1))


def pack(gm: fx.GraphModule, weights: list[torch.nn.Parameter]) -> torch.Tensor:
    """One [sum rows, width] tensor holding `weights` in order: the buffer they already share, or
    a new one they are pointed at by finish_fusion."""
    base = _packed_base(weights)
    if base is not None:
        return base
    with torch.no_grad():
        base = torch.cat([w.detach() for w in weights])
    row = 0
    for w in weights:
        gm.meta.setdefault(PENDING_VIEWS, []).append((w, base, row))
        row += w.shape[0]
    return base


def finish_fusion(gm: fx.GraphModule) -> None:
    """Point each fused parameter at its rows of the fused weight, freeing its old storage: after
    the inner compile, before the graph first runs."""
    with torch.no_grad():
        for weight, base, row in gm.meta.pop(PENDING_VIEWS, []):
            weight.data = base[row : row + weight.shape[0]]


class FuseProjections(GraphPass):
    name = "fuse_projections"

    def applies(self, config: PassConfig) -> bool:
        return config.fuse_projections

    def run(self, gm: fx.GraphModule, config: PassConfig) -> int:
        fused = 0
        mode = fake_mode_of(gm.graph)
        for index, group in enumerate(find_projection_groups(gm)):
            if group.seen and _packed_base(group.weights) is None:
                log.info("fuse_projections: %s left unfused (an earlier graph reads its weights)",
                         [n.name for n in group.linears])
                continue
            base = pack(gm, group.weights)
            name = f"dcp_fused_weight_{index}"
            gm.register_buffer(name, base, persistent=False)
            first = group.linears[0]  # found in graph order
            with gm.graph.inserting_before(first):
                attr = gm.graph.get_attr(name)
                attr.meta["val"] = _fake_like(base, mode)
                out = call(gm.graph, first.target, group.input, attr)
                sizes = [w.shape[0] for w in group.weights]
                parts = call(gm.graph, torch.ops.aten.split_with_sizes.default, out, sizes, -1)
                pieces = []
                for i in range(len(sizes)):
                    piece = gm.graph.call_function(operator.getitem, (parts, i))
                    value = fake_value(parts)
                    if value is not None:
                        piece.meta["val"] = value[i]
                    pieces.append(piece)
            for linear, piece in zip(group.linears, pieces):
                linear.replace_all_uses_with(piece)
                gm.graph.erase_node(linear)
            fused += 1
        return fused


def _fake_like(tensor: torch.Tensor, mode):
    """A fake tensor of tensor's metadata, not tied to its storage (which the graph's inputs share)."""
    if mode is None:
        return tensor
    with mode:
        return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=tensor.device)
