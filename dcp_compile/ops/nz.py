"""The NZ (FRACTAL_NZ) layout of a paged KV cache part, as Ascend's FIA reads it (docs/ascend.md §11.4, §15).

A part of D channels (the latent, 512, or the rope, 64) over blocks of `block` rows is held as
one contiguous tensor [blocks, 1, D/16, block, 16]: the channel d of row s of block b lives at
[b, 0, d // 16, s, d % 16]. It is an ordinary tensor viewed so (neither engine casts the storage
format); rows are the local rows of the split layout, row = b * block + s.

These helpers give the torch kernels (the reference ops, the stand-ins) row access to it; the
Triton kernels compute the same offsets themselves (lowering/triton/launching.row_addressing).
"""

from __future__ import annotations

import torch

GROUP = 16
"""Channels per fractal (fp16 / bf16)."""
BLOCK = 128
"""The only block size FIA takes with an NZ cache (docs/ascend.md §11.4)."""


def is_nz(cache: torch.Tensor) -> bool:
    return cache.dim() == 5


def shape(rows: int, width: int, block: int) -> tuple[int, int, int, int, int]:
    if rows % block or width % GROUP:
        raise ValueError(f"an NZ cache holds whole blocks of {block} rows and channels in groups of {GROUP}; "
                         f"got {rows} rows of {width}")
    return (rows // block, 1, width // GROUP, block, GROUP)


def check(cache: torch.Tensor) -> None:
    if not is_nz(cache) or cache.shape[1] != 1 or cache.shape[4] != GROUP:
        raise ValueError(f"an NZ cache is [blocks, 1, D/{GROUP}, block, {GROUP}], got {tuple(cache.shape)}")


def block_of(cache: torch.Tensor) -> int:
    check(cache)
    return cache.shape[3]


def rows_of(cache: torch.Tensor) -> int:
    """Rows of a cache part in either layout ([rows, D] or NZ)."""
    return cache.shape[0] * cache.shape[3] if is_nz(cache) else cache.shape[0]


def width_of(cache: torch.Tensor) -> int:
    """Channels of a cache part in either layout."""
    return cache.shape[2] * cache.shape[4] if is_nz(cache) else cache.shape[-1]


def row_view(cache: torch.Tensor) -> torch.Tensor:
    """A [blocks, block, D/16, 16] view of an NZ cache, indexed by (block, slot) like rows."""
    check(cache)
    return cache[:, 0].permute(0, 2, 1, 3)


def read_rows(cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """cache's rows at `index` (any shape) as [*index.shape, D], in either layout."""
    if not is_nz(cache):
        return cache[index]
    block = block_of(cache)
    flat = index.reshape(-1)
    rows = row_view(cache)[flat // block, flat % block]
    return rows.reshape(*index.shape, width_of(cache))


def write_rows(cache: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> None:
    """cache[index] = values ([n, D]), in either layout; in place."""
    if not is_nz(cache):
        cache[index] = values
        return
    block = block_of(cache)
    row_view(cache)[index // block, index % block] = values.reshape(-1, cache.shape[2], GROUP)


def to_rows(cache: torch.Tensor) -> torch.Tensor:
    """The [rows, D] contents of an NZ cache (a copy)."""
    return row_view(cache).reshape(rows_of(cache), width_of(cache))


def from_rows(rows: torch.Tensor, block: int) -> torch.Tensor:
    """rows [rows, D] in the NZ layout (a copy)."""
    blocks, _, groups, _, _ = shape(rows.shape[0], rows.shape[1], block)
    return rows.reshape(blocks, block, groups, GROUP).permute(0, 2, 1, 3).contiguous().unsqueeze(1)
