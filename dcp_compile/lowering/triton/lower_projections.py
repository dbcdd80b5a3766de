"""Run the model's projections through the skinny-matmul kernel where a step has few tokens.

    before: q = linear(x, W_q);        q_latent = einsum("thn,hnr->thr", q_nope, W_UK)
                                       (or bmm(q_nope.transpose(0, 1), W_UK).transpose(0, 1))
    after:  q = dcp_triton.skinny_linear(x, W_q);  q_latent = dcp_triton.head_matmul(q_nope, W_UK)

At a decode or verify step every projection is a product of a few rows with a large weight: its
floor is the weight's bytes at the copy rate, which cuBLAS reaches 20-80% of on an H200 at these
shapes (bench/results/decode_gemms_h200.json); skinny_matmul.py's kernel spreads the weight read
over the whole GPU (bench/results/skinny_matmul_h200.json). The ops pick the kernel or torch per
call from the row count, so prefill graphs keep cuBLAS.

Assumes: fuse_projections ran first (it matches F.linear), so a fused weight is lowered as one.
Matches bias-free F.linear with a 2-D weight, and per-head products: einsums of the form
"abc,bcd->abd", and bmm(x.transpose(0, 1), w) seen through .transpose(0, 1) only (the model's
per_head_matmul); of half-precision operands on one of `devices`.
Guarantees: each swapped node computes the same product (to matmul rounding) with the same shape,
dtype and users; every other node is untouched.
Why a pass: the kernel choice depends on the device and the deployment; the model stays as written.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from dcp_compile.passes.base import GraphPass, PassConfig
from dcp_compile.passes.fuse_projections import LINEARS
from dcp_compile.passes.graph_utils import fake_value

HALF_DTYPES = (torch.bfloat16, torch.float16)
EINSUMS = (torch.functional.einsum, torch.einsum)


@dataclass
class ProjectionSite:
    node: fx.Node
    kind: str
    """'linear' (x [..., K] by weight [N, K]) or 'heads' (x [T, H, K] by weight [H, K, N])."""
    operands: tuple
    """The product's (x, weight) nodes."""
    replaced: tuple = ()
    """Nodes the swap leaves unused (a bmm form's inner transpose and bmm)."""


def _per_head_equation(equation) -> bool:
    """'abc,bcd->abd' with four distinct letters: a batch of matrices indexed by b, per head."""
    if not isinstance(equation, str):
        return False
    equation = equation.replace(" ", "")
    if equation.count(",") != 1 or equation.count("->") != 1:
        return False
    inputs, output = equation.split("->")
    left, right = inputs.split(",")
    if not (len(left) == len(right) == len(output) == 3 and len(set(left + right + output)) == 4):
        return False
    return right[0] == left[1] and right[1] == left[2] and output == left[:2] + right[2]


def _operands_qualify(values, devices) -> bool:
    if not all(isinstance(v, torch.Tensor) for v in values):
        return False
    dtype, device = values[0].dtype, values[0].device
    return (dtype in HALF_DTYPES and device.type in devices
            and all(v.dtype == dtype and v.device == device for v in values))


def _swapped_dims(node) -> fx.Node | None:
    """x where `node` is x.transpose(0, 1) (or torch.transpose(x, 0, 1)), else None."""
    is_method = node.op == "call_method" and node.target == "transpose"
    is_function = node.op == "call_function" and node.target in (torch.transpose, torch.Tensor.transpose)
    if not (is_method or is_function) or node.kwargs or len(node.args) != 3:
        return None
    return node.args[0] if set(node.args[1:]) == {0, 1} and isinstance(node.args[0], fx.Node) else None


def _per_head_bmm(node) -> ProjectionSite | None:
    """bmm(x.transpose(0, 1), w).transpose(0, 1), matched at the outer transpose: its bmm's only
    user."""
    product = _swapped_dims(node)
    if product is None or product.op != "call_function" or product.target is not torch.bmm:
        return None
    if len(product.args) != 2 or product.kwargs or len(product.users) != 1:
        return None
    inner = product.args[0]
    x = _swapped_dims(inner) if isinstance(inner, fx.Node) else None
    if x is None or not isinstance(product.args[1], fx.Node):
        return None
    return ProjectionSite(node, "heads", (x, product.args[1]), (product, inner))


def find_projection_sites(graph: fx.Graph, devices: tuple[str, ...]) -> list[ProjectionSite]:
    found = []
    for node in graph.nodes:
        bmm_site = _per_head_bmm(node)
        if bmm_site is not None:
            x, weight = (fake_value(v) for v in bmm_site.operands)
            if _operands_qualify((x, weight), devices) and x.dim() == 3 and weight.dim() == 3:
                found.append(bmm_site)
            continue
        if node.op != "call_function":
            continue
        if node.target in LINEARS and len(node.args) >= 2 and not node.kwargs:
            bias = node.args[2] if len(node.args) > 2 else None
            x, weight = fake_value(node.args[0]), fake_value(node.args[1])
            if bias is None and _operands_qualify((x, weight), devices) and weight.dim() == 2:
                found.append(ProjectionSite(node, "linear", tuple(node.args[:2])))
        elif node.target in EINSUMS and len(node.args) == 3 and not node.kwargs and _per_head_equation(node.args[0]):
            x, weight = fake_value(node.args[1]), fake_value(node.args[2])
            if _operands_qualify((x, weight), devices) and x.dim() == 3 and weight.dim() == 3:
                found.append(ProjectionSite(node, "heads", tuple(node.args[1:])))
    return found


def tuned_for(device: torch.device) -> bool:
    """Whether the skinny-matmul kernel has configs tuned for this GPU (skinny_matmuls='auto')."""
    if device.type != "cuda":
        return False
    from dcp_compile.lowering.triton import skinny_matmul

    return bool(skinny_matmul.tuned_configs(skinny_matmul.gpu_name(device)))


class LowerProjections(GraphPass):
    name = "lower_projections"

    def __init__(self, devices: tuple[str, ...] = ("cuda",), enabled: bool = True):
        """enabled: the back end's skinny_matmuls option is 'on'."""
        self.devices, self.enabled = devices, enabled

    def applies(self, config: PassConfig) -> bool:
        return self.enabled

    def run(self, gm: fx.GraphModule, config: PassConfig) -> int:
        from dcp_compile.lowering.triton import matmul_ops  # noqa: F401 - defines the ops

        sites = find_projection_sites(gm.graph, self.devices)
        for site in sites:
            site.node.op = "call_function"
            site.node.target = (torch.ops.dcp_triton.skinny_linear.default if site.kind == "linear"
                                else torch.ops.dcp_triton.head_matmul.default)
            site.node.args = site.operands
            for unused in site.replaced:  # the bmm, then its inner transpose
                if not unused.users:
                    gm.graph.erase_node(unused)
        return len(sites)
