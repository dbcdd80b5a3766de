"""`dcp_triton::skinny_linear` and `dcp_triton::head_matmul`: a linear and MLA's absorbed per-head
product, run by the skinny-matmul Triton kernel (skinny_matmul.py) when they have few rows, by
torch otherwise. The lower_projections pass swaps the model's F.linear / einsum for them.

    skinny_linear(x [..., K], weight [N, K]) -> [..., N]                  F.linear(x, weight)
    head_matmul(x [T, H, K], weight [H, K, N]) -> [T, H, N]               einsum("thk,hkn->thn")

The choice is made per call from the row count, so one graph whose token count is symbolic serves
a decode step (a few rows: the kernel) and a prefill (many: cuBLAS). Where the operands' layout or
dtype is not one the kernel reads, or this GPU's tuned table says cuBLAS is faster at the shape,
torch runs: an op never fails where the product it replaces would have run. Triton is imported only when the kernel first runs.
"""

from __future__ import annotations

import torch

KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _kernel_reads(x: torch.Tensor, weight: torch.Tensor, rows: int) -> bool:
    from dcp_compile.lowering.triton.skinny_matmul import MAX_ROWS

    return (0 < rows <= MAX_ROWS and x.dtype == weight.dtype and x.dtype in KERNEL_DTYPES
            and x.device == weight.device and x.stride(-1) == 1 and 1 in (weight.stride(-1), weight.stride(-2)))


@torch.library.custom_op("dcp_triton::skinny_linear", mutates_args=(), device_types=("cuda", "cpu"))
def skinny_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    rows, k = x.numel() // max(x.shape[-1], 1), x.shape[-1]
    if weight.dim() != 2 or not _kernel_reads(x, weight, rows):
        return torch.nn.functional.linear(x, weight).contiguous()  # the layout the fake promises
    try:
        flat = x.view(1, rows, k)
    except RuntimeError:  # leading dims that do not flatten without a copy
        return torch.nn.functional.linear(x, weight).contiguous()
    from dcp_compile.lowering.triton import skinny_matmul

    config = skinny_matmul.config_for(flat, weight.shape[0], k, 1)
    if config is None:  # cuBLAS measured faster at this shape on this GPU
        return torch.nn.functional.linear(x, weight).contiguous()
    out = torch.empty((*x.shape[:-1], weight.shape[0]), dtype=x.dtype, device=x.device)
    skinny_matmul.skinny_matmul_into(out.view(1, rows, weight.shape[0]), flat, weight.t().unsqueeze(0), config)
    return out


@skinny_linear.register_fake
def _(x, weight):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("dcp_triton::head_matmul", mutates_args=(), device_types=("cuda", "cpu"))
def head_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # The output is laid out [H, T, N] and seen as [T, H, N], as einsum's batched matmul leaves it,
    # so the graph around the op is the one the einsum had.
    out = _head_major(x, weight)
    heads_first = x.transpose(0, 1)  # heads as the batch: no copies
    if not _kernel_reads(x, weight, x.shape[0]):
        return torch.bmm(heads_first, weight, out=out.transpose(0, 1)).transpose(0, 1)
    from dcp_compile.lowering.triton import skinny_matmul

    config = skinny_matmul.config_for(heads_first, weight.shape[2], weight.shape[1], weight.shape[0])
    if config is None:  # cuBLAS measured faster at this shape on this GPU
        return torch.bmm(heads_first, weight, out=out.transpose(0, 1)).transpose(0, 1)
    skinny_matmul.skinny_matmul_into(out.transpose(0, 1), heads_first, weight, config)
    return out


def _head_major(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[1], x.shape[0], weight.shape[-1])).transpose(0, 1)


@head_matmul.register_fake
def _(x, weight):
    return _head_major(x, weight)
