"""Run the model's projections through the skinny-matmul kernel where a step has few tokens.

    before: q = linear(x, W_q);        q_latent = einsum("thn,hnr->thr", q_nope, W_UK)
    after:  q = dcp_triton.skinny_linear(x, W_q);  q_latent = dcp_triton.head_matmul(q_nope, W_UK)

At a decode or verify step every projection is a product of a few rows with a large weight: its
floor is the weight's bytes at the copy rate, which cuBLAS reaches 20-80% of on an H200 at these
shapes (bench/results/decode_gemms_h200.json); skinny_matmul.py's kernel spreads the weight read
over the whole GPU (bench/results/skinny_matmul_h200.json). The ops pick the kernel or torch per
call from the row count, so prefill graphs keep cuBLAS.

Assumes: fuse_projections ran first (it matches F.linear), so a fused weight is lowered as one.
Matches bias-free F.linear with a 2-D weight and einsums of the per-head form "abc,bcd->abd", of
half-precision operands on one of `devices`.
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


def find_projection_sites(graph: fx.Graph, devices: tuple[str, ...]) -> list[ProjectionSite]:
    found = []
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in LINEARS and len(node.args) >= 2 and not node.kwargs:
            bias = node.args[2] if len(node.args) > 2 else None
            x, weight = fake_value(node.args[0]), fake_value(node.args[1])
            if bias is None and _operands_qualify((x, weight), devices) and weight.dim() == 2:
                found.append(ProjectionSite(node, "linear"))
        elif node.target in EINSUMS and len(node.args) == 3 and not node.kwargs and _per_head_equation(node.args[0]):
            x, weight = fake_value(node.args[1]), fake_value(node.args[2])
            if _operands_qualify((x, weight), devices) and x.dim() == 3 and weight.dim() == 3:
                found.append(ProjectionSite(node, "heads"))
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
            if site.kind == "linear":
                site.node.target = torch.ops.dcp_triton.skinny_linear.default
                site.node.args = site.node.args[:2]
            else:
                site.node.target = torch.ops.dcp_triton.head_matmul.default
                site.node.args = site.node.args[1:]
        return len(sites)
