"""Stateless pieces shared by the reference model's layers: the TP all-reduce and SwiGLU."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def all_reduce(x: torch.Tensor, group_name: str | None) -> torch.Tensor:
    """Sum over the TP group (a functional collective, visible in the graph); identity at TP 1."""
    if group_name is None:
        return x
    reduced = torch.ops._c10d_functional.all_reduce(x, "sum", group_name)
    return torch.ops._c10d_functional.wait_tensor(reduced)


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)
