"""Local metadata builder: a rank's view of every request, built on the device.

Matches `reference.local_metadata`. One program per request walks its page-table row in
blocks; a running count plus `tl.cumsum` over the owned mask compacts the owned entries to the
front in position order, storing their local rows and global positions. The tail past the local
length is zeroed, as the reference does, so whole tensors compare equal. Nothing is read back
to the host, so the launch can be captured in a graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dcp_compile.lowering.triton.launching import check_index, check_same_device, grid_for
from dcp_compile.runtime import layout

# Wide enough that a decode row of a long context takes few iterations, small enough for one scan.
_MAX_BLOCK_COLUMNS = 1024


@triton.jit(do_not_specialize=["batch", "width", "dcp_rank"])
def _local_metadata_kernel(
    req_to_token_ptr, seq_lens_ptr,
    local_req_to_token_ptr, local_seq_lens_ptr, local_positions_ptr,
    batch, width, dcp_rank, dcp_size, interleave,
    stride_table_req, stride_table_col,
    stride_seq_lens,
    stride_local_table_req, stride_local_table_col,
    stride_local_lens,
    stride_local_positions_req, stride_local_positions_col,
    BLOCK_COLUMNS: tl.constexpr,
):
    columns = tl.arange(0, BLOCK_COLUMNS)
    for request in range(tl.program_id(0), batch, tl.num_programs(0)):
        request_index = tl.cast(request, tl.int64)
        length = tl.load(seq_lens_ptr + request_index * stride_seq_lens).to(tl.int64)
        table_row = req_to_token_ptr + request_index * stride_table_req
        local_table_row = local_req_to_token_ptr + request_index * stride_local_table_req
        local_positions_row = local_positions_ptr + request_index * stride_local_positions_req
        local_length = tl.zeros([], dtype=tl.int32)
        for first in range(0, width, BLOCK_COLUMNS):
            position = first + columns
            in_row = position < width
            loc = tl.load(table_row + position.to(tl.int64) * stride_table_col, mask=in_row, other=0).to(tl.int64)
            owned = in_row & (position < length) & ((loc // interleave) % dcp_size == dcp_rank)
            owned_count = owned.to(tl.int32)
            slot = (local_length + tl.cumsum(owned_count, 0) - 1).to(tl.int64)
            local_row = (loc // (interleave * dcp_size)) * interleave + loc % interleave
            tl.store(local_table_row + slot * stride_local_table_col,
                     local_row.to(local_req_to_token_ptr.dtype.element_ty), mask=owned)
            tl.store(local_positions_row + slot * stride_local_positions_col,
                     position.to(local_positions_ptr.dtype.element_ty), mask=owned)
            local_length += tl.sum(owned_count, 0)
        tl.store(local_seq_lens_ptr + request_index * stride_local_lens,
                 local_length.to(local_seq_lens_ptr.dtype.element_ty))
        # The compacted entries end at local_length, so these stores never overlap the ones above.
        for first in range(0, width, BLOCK_COLUMNS):
            position = first + columns
            tail = (position < width) & (position >= local_length)
            slot = position.to(tl.int64)
            tl.store(local_table_row + slot * stride_local_table_col,
                     tl.zeros([BLOCK_COLUMNS], dtype=local_req_to_token_ptr.dtype.element_ty), mask=tail)
            tl.store(local_positions_row + slot * stride_local_positions_col,
                     tl.zeros([BLOCK_COLUMNS], dtype=local_positions_ptr.dtype.element_ty), mask=tail)


def local_metadata_into(req_to_token, seq_lens, dcp_rank: int, dcp_size: int, interleave: int,
                        local_req_to_token, local_seq_lens, local_positions) -> None:
    """`local_metadata` writing into given buffers (static buffers of a captured graph)."""
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
    _local_metadata_kernel[grid_for(batch)](
        req_to_token, seq_lens,
        local_req_to_token, local_seq_lens, local_positions,
        batch, width, dcp_rank, dcp_size, interleave,
        req_to_token.stride(0), req_to_token.stride(1),
        seq_lens.stride(0),
        local_req_to_token.stride(0), local_req_to_token.stride(1),
        local_seq_lens.stride(0),
        local_positions.stride(0), local_positions.stride(1),
        BLOCK_COLUMNS=min(_MAX_BLOCK_COLUMNS, max(16, triton.next_power_of_2(width))),
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
