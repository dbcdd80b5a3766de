"""Window attention: a row's last <= `window` local keys, merged by LSE into a prefix result.

Matches `reference.window_attention`. The paged kernels that cannot mask by global position
(FlashInfer, Ascend FIA) attend each verify row's keys before its first query without a mask;
this kernel adds the keys at or after that position, which are among the last `window` entries
of the row's local page table, each query seeing those at or before its own position. It reads
T x window cache rows in all: a few microseconds next to the paged call.

One program per (query, head tile): it loads the window's rows once for every head of its tile,
computes their scores with two dots, and merges its (out, lse) with the prefix's. The row's
first query position comes from `reference.first_query_positions` (a masked minimum on the device).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dcp_compile.ops.reference import first_query_positions
from dcp_compile.lowering.triton.launching import (
    block_size,
    cache_offsets,
    cache_parts,
    check_float,
    check_index,
    check_same_device,
    grid_for,
    is_interpreted,
    row_addressing,
    triton_dtype,
)

MAX_BLOCK_H = 16


@triton.jit(do_not_specialize=["tokens", "heads", "width", "window", "head_tiles"])
def _window_kernel(
    out_prefix_ptr, lse_prefix_ptr, q_latent_ptr, q_rope_ptr, latent_cache_ptr, rope_cache_ptr, page_table_ptr, seq_lens_ptr,
    key_positions_ptr, q_seq_ids_ptr, q_positions_ptr, first_ptr, out_ptr, lse_ptr,
    tokens, heads, width, window, head_tiles, sm_scale,
    stride_prefix_token, stride_prefix_head, stride_prefix_col,
    stride_lse_prefix_token, stride_lse_prefix_head,
    stride_q_latent_token, stride_q_latent_head, stride_q_latent_col,
    stride_q_rope_token, stride_q_rope_head, stride_q_rope_col,
    stride_latent_cache_row, stride_latent_cache_col,
    stride_rope_cache_row, stride_rope_cache_col,
    stride_table_req, stride_table_col,
    stride_seq_lens,
    stride_key_positions_req, stride_key_positions_col,
    stride_q_seq_ids, stride_q_positions,
    stride_out_token, stride_out_head, stride_out_col,
    stride_lse_token, stride_lse_head,
    RANK_DIM: tl.constexpr, ROPE_DIM: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr,
    OPERAND_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, NZ_BLOCK: tl.constexpr,
):
    latent_cols = tl.arange(0, BLOCK_R).to(tl.int64)
    rope_cols = tl.arange(0, BLOCK_P).to(tl.int64)
    latent_mask = latent_cols < RANK_DIM
    rope_mask = rope_cols < ROPE_DIM
    slots = tl.arange(0, BLOCK_W)
    for work in range(tl.program_id(0), tokens * head_tiles, tl.num_programs(0)):
        head_tile = work % head_tiles
        token = tl.cast(work // head_tiles, tl.int64)
        request = tl.load(q_seq_ids_ptr + token * stride_q_seq_ids).to(tl.int64)
        seq_len = tl.load(seq_lens_ptr + request * stride_seq_lens).to(tl.int64)
        query_position = tl.load(q_positions_ptr + token * stride_q_positions).to(tl.int64)
        first = tl.load(first_ptr + request).to(tl.int64)
        column = seq_len - window + slots
        in_table = (slots < window) & (column >= 0) & (column < width)
        column = tl.where(in_table, column, 0)
        row = tl.load(page_table_ptr + request * stride_table_req + column * stride_table_col, mask=in_table, other=0).to(tl.int64)
        key_position = tl.load(key_positions_ptr + request * stride_key_positions_req + column * stride_key_positions_col,
                               mask=in_table, other=0).to(tl.int64)
        visible = in_table & (key_position >= first) & (key_position <= query_position)
        k_latent = tl.load(latent_cache_ptr + cache_offsets(row[:, None], latent_cols[None, :], stride_latent_cache_row,
                                                            stride_latent_cache_col, NZ_BLOCK),
                           mask=visible[:, None] & latent_mask[None, :], other=0.0).to(OPERAND_DTYPE)
        k_rope = tl.load(rope_cache_ptr + cache_offsets(row[:, None], rope_cols[None, :], stride_rope_cache_row,
                                                        stride_rope_cache_col, NZ_BLOCK),
                         mask=visible[:, None] & rope_mask[None, :], other=0.0).to(OPERAND_DTYPE)

        head = (head_tile * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)
        head_mask = head < heads
        q_latent = tl.load(q_latent_ptr + token * stride_q_latent_token + head[:, None] * stride_q_latent_head
                           + latent_cols[None, :] * stride_q_latent_col,
                           mask=head_mask[:, None] & latent_mask[None, :], other=0.0).to(OPERAND_DTYPE)
        q_rope = tl.load(q_rope_ptr + token * stride_q_rope_token + head[:, None] * stride_q_rope_head
                         + rope_cols[None, :] * stride_q_rope_col,
                         mask=head_mask[:, None] & rope_mask[None, :], other=0.0).to(OPERAND_DTYPE)
        scores = tl.dot(q_rope, tl.trans(k_rope), input_precision=DOT_PRECISION)
        scores = tl.dot(q_latent, tl.trans(k_latent), scores, input_precision=DOT_PRECISION)
        scores = tl.where(visible[None, :], scores * sm_scale, float("-inf"))
        window_max = tl.max(scores, 1)
        window_shift = tl.where(window_max == float("-inf"), 0.0, window_max)
        probs = tl.exp(scores - window_shift[:, None])
        window_total = tl.sum(probs, 1)
        window_acc = tl.dot(probs.to(OPERAND_DTYPE), k_latent, input_precision=DOT_PRECISION)

        prefix_lse = tl.load(lse_prefix_ptr + token * stride_lse_prefix_token + head * stride_lse_prefix_head,
                             mask=head_mask, other=float("-inf")).to(tl.float32)
        prefix_out = tl.load(out_prefix_ptr + token * stride_prefix_token + head[:, None] * stride_prefix_head
                             + latent_cols[None, :] * stride_prefix_col,
                             mask=head_mask[:, None] & latent_mask[None, :], other=0.0).to(tl.float32)
        # The window's LSE is window_shift + log(window_total); merge in the shifted frame of the larger one.
        window_lse = tl.where(window_total > 0, window_shift + tl.log(tl.where(window_total > 0, window_total, 1.0)),
                              float("-inf"))
        shift = tl.maximum(prefix_lse, window_lse)
        shift = tl.where(shift == float("-inf"), 0.0, shift)
        prefix_weight = tl.exp(prefix_lse - shift)
        window_scale = tl.where(window_total > 0, tl.exp(window_shift - shift), 0.0)
        total = prefix_weight + window_scale * window_total
        acc = tl.where(prefix_weight[:, None] > 0, prefix_weight[:, None] * prefix_out, 0.0) + window_scale[:, None] * window_acc
        seen = total > 0
        out = tl.where(seen[:, None], acc / tl.where(seen, total, 1.0)[:, None], 0.0)
        lse = tl.where(seen, shift + tl.log(tl.where(seen, total, 1.0)), float("-inf"))
        tl.store(out_ptr + token * stride_out_token + head[:, None] * stride_out_head + latent_cols[None, :] * stride_out_col,
                 out.to(out_ptr.dtype.element_ty), mask=head_mask[:, None] & latent_mask[None, :])
        tl.store(lse_ptr + token * stride_lse_token + head * stride_lse_head, lse, mask=head_mask)


def window_attention(out_prefix, lse_prefix, q_latent, q_rope, kv_cache, page_table, seq_lens, key_positions,
                     q_seq_ids, q_positions, sm_scale: float, window: int, rope_cache=None):
    """Returns (out [T, H, R] in q's dtype, lse [T, H] fp32), as `reference.window_attention`."""
    for name, tensor in (("out_prefix", out_prefix), ("q_latent", q_latent), ("q_rope", q_rope)):
        check_float(name, tensor)
    for name, tensor in (("page_table", page_table), ("seq_lens", seq_lens), ("key_positions", key_positions),
                         ("q_seq_ids", q_seq_ids), ("q_positions", q_positions)):
        check_index(name, tensor)
    check_same_device(out_prefix=out_prefix, lse_prefix=lse_prefix, q_latent=q_latent, kv_cache=kv_cache,
                      page_table=page_table, q_seq_ids=q_seq_ids)
    tokens, heads, rank_dim = q_latent.shape
    rope_dim = q_rope.shape[2]
    rows, width = page_table.shape
    latent_cache, rope_part = cache_parts(kv_cache, rope_cache, rank_dim, rope_dim)
    if out_prefix.shape != q_latent.shape or lse_prefix.shape != (tokens, heads):
        raise ValueError(f"window_attention: out_prefix {tuple(out_prefix.shape)} and lse_prefix {tuple(lse_prefix.shape)} "
                         f"must be [T, H, R] and [T, H] for q {tuple(q_latent.shape)}")
    if not 1 <= window <= 64:
        raise ValueError(f"window_attention serves windows of 1 to 64 keys, got {window}")
    out = torch.empty_like(q_latent)
    lse = torch.empty((tokens, heads), dtype=torch.float32, device=q_latent.device)
    if tokens == 0 or heads == 0:
        return out, lse
    first = first_query_positions(q_seq_ids, q_positions, rows)
    block_h = min(MAX_BLOCK_H, block_size(heads))
    head_tiles = triton.cdiv(heads, block_h)
    dot_in_fp32 = kv_cache.dtype == torch.float32 or is_interpreted(_window_kernel)
    _window_kernel[grid_for(tokens * head_tiles)](
        out_prefix, lse_prefix, q_latent, q_rope, latent_cache, rope_part, page_table, seq_lens, key_positions, q_seq_ids,
        q_positions, first, out, lse,
        tokens, heads, width, window, head_tiles, sm_scale,
        out_prefix.stride(0), out_prefix.stride(1), out_prefix.stride(2),
        lse_prefix.stride(0), lse_prefix.stride(1),
        q_latent.stride(0), q_latent.stride(1), q_latent.stride(2),
        q_rope.stride(0), q_rope.stride(1), q_rope.stride(2),
        *row_addressing(latent_cache)[:2],
        *row_addressing(rope_part)[:2],
        page_table.stride(0), page_table.stride(1),
        seq_lens.stride(0),
        key_positions.stride(0), key_positions.stride(1),
        q_seq_ids.stride(0), q_positions.stride(0),
        out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0), lse.stride(1),
        RANK_DIM=rank_dim, ROPE_DIM=rope_dim,
        BLOCK_R=block_size(rank_dim), BLOCK_P=block_size(rope_dim), BLOCK_H=block_h, BLOCK_W=block_size(window),
        OPERAND_DTYPE=tl.float32 if dot_in_fp32 else triton_dtype(kv_cache.dtype),
        DOT_PRECISION="ieee" if dot_in_fp32 else None, NZ_BLOCK=row_addressing(latent_cache)[2],
        num_warps=8,
    )
    return out, lse
