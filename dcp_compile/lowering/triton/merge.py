"""LSE merge of the partials that came back from the all-to-all, with the unpack fused in.

Matches `reference.merge_partials` (unpack + `merge_lse`): for packed [N, T, H, R + w],
m = max over shards of lse with an infinite m taken as 0, w_i = exp(lse_i - m), and
o = sum_i w_i * o_i / sum_i w_i, where a term with w_i == 0 is 0 (a NaN in an empty shard cannot
leak) and a row with no weight is 0. The LSE words are read as `lse_packing` describes.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dcp_compile.ops.reference import lse_words
from dcp_compile.lowering.triton.launching import block_size, check_float, grid_for
from dcp_compile.lowering.triton.lse_packing import load_lse_words
from dcp_compile.lowering.triton.pack import NUM_WARPS, rows_per_program


@triton.jit(do_not_specialize=["tokens"])
def _merge_partials_kernel(
    packed_ptr, merged_ptr,
    tokens, heads, dcp_size,
    stride_packed_peer, stride_packed_token, stride_packed_head, stride_packed_col,
    stride_merged_token, stride_merged_head, stride_merged_col,
    RANK_DIM: tl.constexpr, BLOCK_R: tl.constexpr, LSE_WORDS: tl.constexpr, BLOCK_ROWS: tl.constexpr,
):
    columns = tl.arange(0, BLOCK_R).to(tl.int64)
    column_mask = columns < RANK_DIM
    total_rows = tokens * heads
    for first in range(tl.program_id(0) * BLOCK_ROWS, total_rows, tl.num_programs(0) * BLOCK_ROWS):
        rows = first + tl.arange(0, BLOCK_ROWS).to(tl.int64)
        row_mask = rows < total_rows
        tile_mask = row_mask[:, None] & column_mask[None, :]
        token = rows // heads
        head = rows % heads
        first_peer_row = packed_ptr + token * stride_packed_token + head * stride_packed_head
        lse_offset = RANK_DIM * stride_packed_col
        shift = tl.full([BLOCK_ROWS], float("-inf"), tl.float32)
        for peer in range(0, dcp_size):
            peer_row = first_peer_row + tl.cast(peer, tl.int64) * stride_packed_peer
            shift = tl.maximum(shift, load_lse_words(peer_row + lse_offset, stride_packed_col, row_mask, LSE_WORDS))
        shift = tl.where(tl.abs(shift) == float("inf"), 0.0, shift)
        total = tl.zeros([BLOCK_ROWS], tl.float32)
        weighted = tl.zeros([BLOCK_ROWS, BLOCK_R], tl.float32)
        for peer in range(0, dcp_size):
            peer_row = first_peer_row + tl.cast(peer, tl.int64) * stride_packed_peer
            weight = tl.exp(load_lse_words(peer_row + lse_offset, stride_packed_col, row_mask, LSE_WORDS) - shift)
            out = tl.load(peer_row[:, None] + columns[None, :] * stride_packed_col,
                          mask=tile_mask, other=0.0).to(tl.float32)
            weighted += tl.where(weight[:, None] > 0, weight[:, None] * out, 0.0)
            total += weight
        merged = tl.where(total[:, None] > 0, weighted / tl.maximum(total, 1e-30)[:, None], 0.0)
        tl.store(merged_ptr + token[:, None] * stride_merged_token + head[:, None] * stride_merged_head
                 + columns[None, :] * stride_merged_col, merged.to(merged_ptr.dtype.element_ty), mask=tile_mask)


def merge_partials_into(packed, kv_lora_rank: int, merged) -> None:
    """`merge_partials` writing into a given [T, H, R] buffer."""
    check_float("packed", packed)
    if packed.dim() != 4:
        raise ValueError(f"packed must be [N, T, H, R + w], got {tuple(packed.shape)}")
    dcp_size, tokens, heads, width = packed.shape
    words = lse_words(packed.dtype)
    if width != kv_lora_rank + words:
        raise ValueError(
            f"packed rows hold {width} {packed.dtype} values; kv_lora_rank {kv_lora_rank} + {words} LSE "
            f"words gives {kv_lora_rank + words}"
        )
    expected = (tokens, heads, kv_lora_rank)
    if tuple(merged.shape) != expected or merged.dtype != packed.dtype or merged.device != packed.device:
        raise ValueError(
            f"merged must be {expected} {packed.dtype} on {packed.device}, got {tuple(merged.shape)} "
            f"{merged.dtype} on {merged.device}"
        )
    total_rows = tokens * heads
    if total_rows == 0:
        return
    if dcp_size == 0:
        merged.zero_()
        return
    block_rows = rows_per_program(kv_lora_rank)
    _merge_partials_kernel[grid_for(triton.cdiv(total_rows, block_rows))](
        packed, merged,
        tokens, heads, dcp_size,
        packed.stride(0), packed.stride(1), packed.stride(2), packed.stride(3),
        merged.stride(0), merged.stride(1), merged.stride(2),
        RANK_DIM=kv_lora_rank, BLOCK_R=block_size(kv_lora_rank), LSE_WORDS=words, BLOCK_ROWS=block_rows,
        num_warps=NUM_WARPS,
    )


def merge_partials(packed, kv_lora_rank: int):
    """[N, T, H, R + w] packed partials -> [T, H, R] merged output, in packed's dtype."""
    check_float("packed", packed)
    if packed.dim() != 4:
        raise ValueError(f"packed must be [N, T, H, R + w], got {tuple(packed.shape)}")
    _, tokens, heads, _ = packed.shape
    merged = packed.new_empty((tokens, heads, kv_lora_rank))
    merge_partials_into(packed, kv_lora_rank, merged)
    return merged
