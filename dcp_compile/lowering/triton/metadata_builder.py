"""Local metadata builder: a rank's view of every request, built on the device.

Matches `reference.local_metadata`. A decode step's page table is wide (B x 128k columns), so the
work is split over (request, column block) pairs rather than one program per request scanning
its whole row in sequence. Two launches, with no host read-back between them, so both can be
captured in a graph:

1. `_count_owned_kernel`: each (request, block) counts the entries it owns -> counts [B, nblocks].
2. `_compact_owned_kernel`: each (request, block) sums the counts of its request's earlier
   blocks (its offset) and of all blocks (the local length), then stores its owned entries at
   offset + their rank in the block (`tl.cumsum` over the owned mask), in position order. It
   also zeroes the columns of its block that lie past the local length, as the reference does,
   so every output element is written by exactly one program: owned slots are < the local
   length, zeroed ones >= it. Block 0 of each request stores the local length.

Entries at positions >= seq_lens[b] are never loaded, so a short request reads little of its row.
The per-program prefix over counts costs O(nblocks) loads, small next to a block of columns.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dcp_compile.lowering.triton.launching import block_size, check_index, check_same_device, grid_for
from dcp_compile.runtime import layout

# Columns per work item: wide enough that each program streams a useful amount of the table,
# narrow enough that B x nblocks fills the device at decode batch sizes.
_MAX_BLOCK_COLUMNS = 2048
# Counts summed per step of the prefix loop in the compaction kernel.
_MAX_COUNT_BLOCK = 1024


@triton.jit
def _owned_block(table_row, position, width, length, dcp_rank, dcp_size, interleave, stride_table_col):
    """(loc, owned) for the columns `position` of one request's row; loads nothing past `length`."""
    in_range = (position < width) & (position < length)
    loc = tl.load(table_row + position * stride_table_col, mask=in_range, other=0).to(tl.int64)
    owned = in_range & ((loc // interleave) % dcp_size == dcp_rank)
    return loc, owned


@triton.jit(do_not_specialize=["work_items", "width", "num_blocks", "dcp_rank"])
def _count_owned_kernel(
    req_to_token_ptr, seq_lens_ptr, counts_ptr,
    work_items, width, num_blocks, dcp_rank, dcp_size, interleave,
    stride_table_req, stride_table_col,
    stride_seq_lens,
    BLOCK_COLUMNS: tl.constexpr,
):
    columns = tl.arange(0, BLOCK_COLUMNS).to(tl.int64)
    for item in range(tl.program_id(0), work_items, tl.num_programs(0)):
        item_index = tl.cast(item, tl.int64)
        request = item_index // num_blocks
        block = item_index % num_blocks
        length = tl.load(seq_lens_ptr + request * stride_seq_lens).to(tl.int64)
        position = block * BLOCK_COLUMNS + columns
        _, owned = _owned_block(req_to_token_ptr + request * stride_table_req, position, width, length,
                                dcp_rank, dcp_size, interleave, stride_table_col)
        tl.store(counts_ptr + item_index, tl.sum(owned.to(tl.int32), 0))


@triton.jit(do_not_specialize=["work_items", "width", "num_blocks", "dcp_rank"])
def _compact_owned_kernel(
    req_to_token_ptr, seq_lens_ptr, counts_ptr,
    local_req_to_token_ptr, local_seq_lens_ptr, local_positions_ptr,
    work_items, width, num_blocks, dcp_rank, dcp_size, interleave,
    stride_table_req, stride_table_col,
    stride_seq_lens,
    stride_local_table_req, stride_local_table_col,
    stride_local_lens,
    stride_local_positions_req, stride_local_positions_col,
    BLOCK_COLUMNS: tl.constexpr, COUNT_BLOCK: tl.constexpr,
):
    columns = tl.arange(0, BLOCK_COLUMNS).to(tl.int64)
    count_columns = tl.arange(0, COUNT_BLOCK).to(tl.int64)
    for item in range(tl.program_id(0), work_items, tl.num_programs(0)):
        item_index = tl.cast(item, tl.int64)
        request = item_index // num_blocks
        block = item_index % num_blocks
        counts_row = counts_ptr + request * num_blocks
        # offset: owned entries in this request's earlier blocks; local_length: in all of them.
        offset = tl.zeros([], dtype=tl.int64)
        local_length = tl.zeros([], dtype=tl.int64)
        for first in range(0, num_blocks, COUNT_BLOCK):
            index = first + count_columns
            counts = tl.load(counts_row + index, mask=index < num_blocks, other=0).to(tl.int64)
            offset += tl.sum(tl.where(index < block, counts, 0), 0)
            local_length += tl.sum(counts, 0)

        length = tl.load(seq_lens_ptr + request * stride_seq_lens).to(tl.int64)
        position = block * BLOCK_COLUMNS + columns
        loc, owned = _owned_block(req_to_token_ptr + request * stride_table_req, position, width, length,
                                  dcp_rank, dcp_size, interleave, stride_table_col)
        slot = offset + tl.cumsum(owned.to(tl.int32), 0).to(tl.int64) - 1
        local_row = (loc // (interleave * dcp_size)) * interleave + loc % interleave
        local_table_row = local_req_to_token_ptr + request * stride_local_table_req
        local_positions_row = local_positions_ptr + request * stride_local_positions_req
        tl.store(local_table_row + slot * stride_local_table_col,
                 local_row.to(local_req_to_token_ptr.dtype.element_ty), mask=owned)
        tl.store(local_positions_row + slot * stride_local_positions_col,
                 position.to(local_positions_ptr.dtype.element_ty), mask=owned)
        # Owned slots end at local_length, so these stores never overlap any program's above.
        tail = (position < width) & (position >= local_length)
        tl.store(local_table_row + position * stride_local_table_col,
                 tl.zeros([BLOCK_COLUMNS], dtype=local_req_to_token_ptr.dtype.element_ty), mask=tail)
        tl.store(local_positions_row + position * stride_local_positions_col,
                 tl.zeros([BLOCK_COLUMNS], dtype=local_positions_ptr.dtype.element_ty), mask=tail)
        tl.store(local_seq_lens_ptr + request * stride_local_lens,
                 local_length.to(local_seq_lens_ptr.dtype.element_ty), mask=block == 0)


def _block_columns(width: int) -> int:
    return min(_MAX_BLOCK_COLUMNS, block_size(width))


def workspace_numel(batch: int, width: int) -> int:
    """Elements of the int32 workspace `local_metadata_into` needs for a [batch, width] table."""
    return batch * triton.cdiv(width, _block_columns(width)) if batch and width else 0


def local_metadata_into(req_to_token, seq_lens, dcp_rank: int, dcp_size: int, interleave: int,
                        local_req_to_token, local_seq_lens, local_positions, workspace=None) -> None:
    """`local_metadata` writing into given buffers (static buffers of a captured graph).

    `workspace`: optional contiguous int32 tensor of at least `workspace_numel(B, L)` elements
    for the per-block counts; without it one is allocated (from the graph's pool under capture).
    """
    layout.validate(dcp_size, dcp_rank, interleave)
    check_index("req_to_token", req_to_token)
    check_index("seq_lens", seq_lens)
    check_same_device(req_to_token=req_to_token, seq_lens=seq_lens, local_req_to_token=local_req_to_token,
                      local_seq_lens=local_seq_lens, local_positions=local_positions)
    if req_to_token.dim() != 2 or seq_lens.shape != (req_to_token.shape[0],):
        raise ValueError(
            f"req_to_token must be [B, L] and seq_lens [B]; got {tuple(req_to_token.shape)} and {tuple(seq_lens.shape)}"
        )
    for name, buffer, like in (("local_req_to_token", local_req_to_token, req_to_token),
                               ("local_seq_lens", local_seq_lens, seq_lens),
                               ("local_positions", local_positions, req_to_token)):
        if buffer.shape != like.shape or buffer.dtype != like.dtype:
            raise ValueError(f"{name} must be {tuple(like.shape)} {like.dtype}, got {tuple(buffer.shape)} {buffer.dtype}")
    batch, width = req_to_token.shape
    if batch == 0:
        return
    if width == 0:
        local_seq_lens.zero_()
        return
    block_columns = _block_columns(width)
    num_blocks = triton.cdiv(width, block_columns)
    needed = batch * num_blocks
    if workspace is None:
        workspace = torch.empty(needed, dtype=torch.int32, device=req_to_token.device)
    else:
        check_same_device(req_to_token=req_to_token, workspace=workspace)
        if workspace.dtype != torch.int32 or not workspace.is_contiguous() or workspace.numel() < needed:
            raise ValueError(f"workspace must be a contiguous int32 tensor of at least {needed} elements, got "
                             f"{tuple(workspace.shape)} {workspace.dtype}")
    grid = grid_for(needed)
    _count_owned_kernel[grid](
        req_to_token, seq_lens, workspace,
        needed, width, num_blocks, dcp_rank, dcp_size, interleave,
        req_to_token.stride(0), req_to_token.stride(1),
        seq_lens.stride(0),
        BLOCK_COLUMNS=block_columns,
    )
    _compact_owned_kernel[grid](
        req_to_token, seq_lens, workspace,
        local_req_to_token, local_seq_lens, local_positions,
        needed, width, num_blocks, dcp_rank, dcp_size, interleave,
        req_to_token.stride(0), req_to_token.stride(1),
        seq_lens.stride(0),
        local_req_to_token.stride(0), local_req_to_token.stride(1),
        local_seq_lens.stride(0),
        local_positions.stride(0), local_positions.stride(1),
        BLOCK_COLUMNS=block_columns,
        COUNT_BLOCK=min(_MAX_COUNT_BLOCK, block_size(num_blocks)),
    )


def local_metadata(req_to_token, seq_lens, dcp_rank: int, dcp_size: int, interleave: int):
    """A rank's local view of each request: local rows and global positions, in position order.

    Returns (local_req_to_token [B, L], local_seq_lens [B], local_positions [B, L]); entries past
    local_seq_lens[b] are 0, as in the reference.
    """
    local_req_to_token = torch.empty_like(req_to_token, memory_format=torch.contiguous_format)
    local_seq_lens = torch.empty_like(seq_lens, memory_format=torch.contiguous_format)
    local_positions = torch.empty_like(req_to_token, memory_format=torch.contiguous_format)
    local_metadata_into(req_to_token, seq_lens, dcp_rank, dcp_size, interleave,
                        local_req_to_token, local_seq_lens, local_positions)
    return local_req_to_token, local_seq_lens, local_positions
