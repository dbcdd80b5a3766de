"""Pack partial outputs and their LSE into one buffer for the all-to-all.

Matches `reference.pack_partials`: out [T, N*H, R] and lse [T, N*H] become packed
[N, T, H, R + w], slice j holding peer j's heads [j*H, (j+1)*H). The empty-shard mask (an
infinite LSE gives out = 0) is fused in, so a NaN in an empty shard's output never leaves the
rank. The LSE words are written as `lse_packing` describes.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dcp_compile.ops.reference import lse_words
from dcp_compile.lowering.triton.launching import block_size, check_float, check_same_device, grid_for
from dcp_compile.lowering.triton.lse_packing import store_lse_words

# Rows per program are chosen so one program of 4 warps moves about this many elements: 16 per
# thread keeps the merge, which holds an fp32 tile across its loop, near 120 registers on sm_90.
ELEMENTS_PER_PROGRAM = 2048
NUM_WARPS = 4


@triton.jit(do_not_specialize=["tokens"])
def _pack_partials_kernel(
    out_ptr, lse_ptr, packed_ptr,
    tokens, heads, dcp_size,
    stride_out_token, stride_out_head, stride_out_col,
    stride_lse_token, stride_lse_head,
    stride_packed_peer, stride_packed_token, stride_packed_head, stride_packed_col,
    RANK_DIM: tl.constexpr, BLOCK_R: tl.constexpr, LSE_WORDS: tl.constexpr, BLOCK_ROWS: tl.constexpr,
):
    columns = tl.arange(0, BLOCK_R).to(tl.int64)
    column_mask = columns < RANK_DIM
    all_heads = dcp_size * heads
    total_rows = tokens * all_heads
    for first in range(tl.program_id(0) * BLOCK_ROWS, total_rows, tl.num_programs(0) * BLOCK_ROWS):
        rows = first + tl.arange(0, BLOCK_ROWS).to(tl.int64)
        row_mask = rows < total_rows
        token = rows // all_heads
        gathered_head = rows % all_heads
        peer = gathered_head // heads
        head = gathered_head % heads
        lse = tl.load(lse_ptr + token * stride_lse_token + gathered_head * stride_lse_head,
                      mask=row_mask, other=float("-inf")).to(tl.float32)
        tile_mask = row_mask[:, None] & column_mask[None, :]
        out = tl.load(out_ptr + token[:, None] * stride_out_token + gathered_head[:, None] * stride_out_head
                      + columns[None, :] * stride_out_col, mask=tile_mask, other=0.0).to(tl.float32)
        out = tl.where((tl.abs(lse) == float("inf"))[:, None], 0.0, out)
        packed_row = packed_ptr + peer * stride_packed_peer + token * stride_packed_token + head * stride_packed_head
        tl.store(packed_row[:, None] + columns[None, :] * stride_packed_col,
                 out.to(packed_ptr.dtype.element_ty), mask=tile_mask)
        store_lse_words(packed_row + RANK_DIM * stride_packed_col, stride_packed_col, lse, row_mask, LSE_WORDS)


def rows_per_program(rank_dim: int) -> int:
    return max(1, ELEMENTS_PER_PROGRAM // block_size(rank_dim))


def pack_partials_into(out, lse, dcp_size: int, packed) -> None:
    """`pack_partials` writing into a given buffer (the all-to-all's static input)."""
    check_float("out", out)
    check_float("lse", lse)
    check_same_device(out=out, lse=lse, packed=packed)
    tokens, all_heads, rank_dim = out.shape
    if dcp_size < 1 or all_heads % dcp_size:
        raise ValueError(f"{all_heads} gathered heads do not split over dcp_size {dcp_size}")
    if lse.shape != (tokens, all_heads):
        raise ValueError(f"lse must be [T, N*H] = {(tokens, all_heads)}, got {tuple(lse.shape)}")
    heads = all_heads // dcp_size
    words = lse_words(out.dtype)
    expected = (dcp_size, tokens, heads, rank_dim + words)
    if tuple(packed.shape) != expected or packed.dtype != out.dtype:
        raise ValueError(f"packed must be {expected} {out.dtype}, got {tuple(packed.shape)} {packed.dtype}")
    total_rows = tokens * all_heads
    if total_rows == 0:
        return
    block_rows = rows_per_program(rank_dim)
    _pack_partials_kernel[grid_for(triton.cdiv(total_rows, block_rows))](
        out, lse, packed,
        tokens, heads, dcp_size,
        out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0), lse.stride(1),
        packed.stride(0), packed.stride(1), packed.stride(2), packed.stride(3),
        RANK_DIM=rank_dim, BLOCK_R=block_size(rank_dim), LSE_WORDS=words, BLOCK_ROWS=block_rows,
        num_warps=NUM_WARPS,
    )


def pack_partials(out, lse, dcp_size: int):
    """[T, N*H, R] out + [T, N*H] lse -> one [N, T, H, R + w] buffer, slice j for DCP peer j."""
    check_float("out", out)
    tokens, all_heads, rank_dim = out.shape
    if dcp_size < 1 or all_heads % dcp_size:
        raise ValueError(f"{all_heads} gathered heads do not split over dcp_size {dcp_size}")
    packed = out.new_empty((dcp_size, tokens, all_heads // dcp_size, rank_dim + lse_words(out.dtype)))
    pack_partials_into(out, lse, dcp_size, packed)
    return packed
