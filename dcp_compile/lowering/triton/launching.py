"""What every launcher in this package shares: dtype checks, grid sizing, block sizes.

Grids follow the rules that let one source run on CUDA and triton-ascend: at most
MAX_PROGRAMS programs in all (the Ascend limit), one grid axis, kernels loop over their work
items with a stride of the grid size, and an empty problem returns before any launch.

Sizes that change from step to step (tokens, batch, widths, split counts, the rank) are marked
`do_not_specialize` on each kernel, so a new batch size does not compile a new variant.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dcp_compile.ops import nz

MAX_PROGRAMS = 65535
SUPPORTED_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SUPPORTED_INDEX_DTYPES = (torch.int32, torch.int64)


def triton_dtype(dtype: torch.dtype):
    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype]


def check_float(name: str, tensor: torch.Tensor) -> None:
    if tensor.dtype not in SUPPORTED_FLOAT_DTYPES:
        raise TypeError(
            f"{name} has dtype {tensor.dtype}; the Triton kernels support "
            f"{', '.join(str(d) for d in SUPPORTED_FLOAT_DTYPES)}"
        )


def check_index(name: str, tensor: torch.Tensor) -> None:
    if tensor.dtype not in SUPPORTED_INDEX_DTYPES:
        raise TypeError(
            f"{name} has dtype {tensor.dtype}; the Triton kernels take indices as "
            f"{', '.join(str(d) for d in SUPPORTED_INDEX_DTYPES)}"
        )


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")


def grid_for(work_items: int) -> tuple[int]:
    """A 1-D grid for `work_items` items, capped so that kernels loop when there are more."""
    return (min(work_items, MAX_PROGRAMS),)


def block_size(extent: int, minimum: int = 16) -> int:
    """Power-of-two block covering `extent`; tl.dot and tl.arange need powers of two >= 16."""
    return max(minimum, triton.next_power_of_2(extent))


def is_interpreted(kernel) -> bool:
    """Whether `kernel` runs under TRITON_INTERPRET (decided when the kernel was defined)."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # a triton build without the interpreter
        return False
    return isinstance(kernel, InterpretedFunction)


def cache_parts(kv_cache: torch.Tensor, rope_cache: torch.Tensor | None, rank_dim: int, rope_dim: int):
    """(latent rows [rows, R], rope rows [rows, P]) of a KV cache: views of the packed
    kv_cache [rows, R + P], or the split layout's kv_cache [rows, R] and rope_cache [rows, P],
    each of those two also possibly NZ (ops/nz.py). Kernels address the two parts through
    their own pointers and `row_addressing`, so one kernel serves every layout."""
    check_float("kv_cache", kv_cache)
    if rope_cache is None:
        if kv_cache.dim() != 2 or kv_cache.shape[1] != rank_dim + rope_dim:
            raise ValueError(f"kv_cache must be [rows, R + P] = [rows, {rank_dim} + {rope_dim}], got {tuple(kv_cache.shape)}")
        return kv_cache, kv_cache[:, rank_dim:]
    check_float("rope_cache", rope_cache)
    check_same_device(kv_cache=kv_cache, rope_cache=rope_cache)
    if nz.is_nz(kv_cache) or nz.is_nz(rope_cache):
        for name, part, width in (("kv_cache", kv_cache, rank_dim), ("rope_cache", rope_cache, rope_dim)):
            nz.check(part)
            if not part.is_contiguous() or nz.width_of(part) != width:
                raise ValueError(f"an NZ {name} must be a contiguous [blocks, 1, {width}/16, block, 16], got "
                                 f"{tuple(part.shape)}")
        if kv_cache.shape[0] != rope_cache.shape[0] or nz.block_of(kv_cache) != nz.block_of(rope_cache) \
                or kv_cache.dtype != rope_cache.dtype:
            raise ValueError(f"an NZ split KV cache's two parts need one block size, block count and dtype, got "
                             f"{tuple(kv_cache.shape)} {kv_cache.dtype} and {tuple(rope_cache.shape)} {rope_cache.dtype}")
        return kv_cache, rope_cache
    if kv_cache.dim() != 2 or rope_cache.dim() != 2 or kv_cache.shape != (rope_cache.shape[0], rank_dim) \
            or rope_cache.shape[1] != rope_dim or kv_cache.dtype != rope_cache.dtype:
        raise ValueError(f"a split KV cache is kv_cache [rows, R] = [rows, {rank_dim}] and rope_cache [rows, P] = "
                         f"[rows, {rope_dim}] of one dtype, got {tuple(kv_cache.shape)} {kv_cache.dtype} and "
                         f"{tuple(rope_cache.shape)} {rope_cache.dtype}")
    return kv_cache, rope_cache


def row_addressing(part: torch.Tensor) -> tuple[int, int, int]:
    """(stride_row, stride_col, nz_block) of a cache part for `cache_offsets`: a [rows, D] view's
    strides and 0, or for an NZ part its block stride, 1 and its block size."""
    if nz.is_nz(part):
        return part.stride(0), 1, nz.block_of(part)
    return part.stride(0), part.stride(1), 0


@triton.jit
def cache_offsets(rows, cols, stride_row, stride_col, NZ_BLOCK: tl.constexpr):
    """Element offsets of (rows, cols) in a cache part (broadcast): a strided [rows, D] part where
    NZ_BLOCK is 0, else NZ: channel d of row r at [r // B, 0, d // 16, r % B, d % 16] (ops/nz.py)."""
    if NZ_BLOCK > 0:
        offsets = (rows // NZ_BLOCK) * stride_row + (rows % NZ_BLOCK) * 16 + (cols // 16) * (NZ_BLOCK * 16) + cols % 16
    else:
        offsets = rows * stride_row + cols * stride_col
    return offsets
