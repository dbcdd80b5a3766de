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
    kv_cache [rows, R + P], or the split layout's kv_cache [rows, R] and rope_cache [rows, P].
    Kernels address the two parts through their own pointers and strides, so one kernel serves
    both layouts."""
    check_float("kv_cache", kv_cache)
    if rope_cache is None:
        if kv_cache.dim() != 2 or kv_cache.shape[1] != rank_dim + rope_dim:
            raise ValueError(f"kv_cache must be [rows, R + P] = [rows, {rank_dim} + {rope_dim}], got {tuple(kv_cache.shape)}")
        return kv_cache, kv_cache[:, rank_dim:]
    check_float("rope_cache", rope_cache)
    check_same_device(kv_cache=kv_cache, rope_cache=rope_cache)
    if kv_cache.dim() != 2 or rope_cache.dim() != 2 or kv_cache.shape != (rope_cache.shape[0], rank_dim) \
            or rope_cache.shape[1] != rope_dim or kv_cache.dtype != rope_cache.dtype:
        raise ValueError(f"a split KV cache is kv_cache [rows, R] = [rows, {rank_dim}] and rope_cache [rows, P] = "
                         f"[rows, {rope_dim}] of one dtype, got {tuple(kv_cache.shape)} {kv_cache.dtype} and "
                         f"{tuple(rope_cache.shape)} {rope_cache.dtype}")
    return kv_cache, rope_cache
