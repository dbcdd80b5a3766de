"""MLA partial attention with LSE over a token-granular page table: split-KV flash decoding.

Matches `reference.partial_attention`. Query t of request b = q_seq_ids[t] sees the local keys
j < seq_lens[b] with key_positions[b, j] <= q_positions[t]; keys carry global positions, so the
causal mask of verify and extend holds on a shard. A query that sees no key gets out = 0 and
lse = -inf.

Stage 1 runs one program per (query, KV split, head tile). Each program loads a block of KV
rows once and uses it for every head of its tile: the latent part is both K (scores) and V
(output), the rope part only K. With at most MAX_BLOCK_H heads there is one tile, so each KV row
is read once for all heads of the query; that keeps the time flat from 16 to 64 heads. Program
ids run over head tiles, then queries, then splits: the tiles of one query and the queries of
one request (verify's k tokens) that read the same split are adjacent, so they run together and
share its rows through L2 instead of streaming the KV once per query. Stage 2 merges the splits of each (query, head) by their LSE.

Every offset into the cache, the queries, the outputs and the workspace is 64-bit (tokens,
heads, columns and splits alike), so a pool or a query of more than 2^31 elements works: a
head-major query of a 16k x 8 prefill at 64 heads puts head 32 at 2^31 elements (in 32-bit, an
illegal memory access on an H100).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from dcp_compile.lowering.triton.attention_tiling import MAX_BLOCK_H, AttentionTiling, choose_tiling
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

_LN2 = math.log(2.0)
MERGE_BLOCK_H = 8
"""Heads one work item of the split merge takes: [8, R] fp32 partials, a few registers a thread."""


@triton.jit
def _keys_per_split(seq_len, width, num_splits, BLOCK_N: tl.constexpr):
    """A request's keys cut into num_splits runs of whole blocks, from its own length, so the
    work spreads evenly whatever the page-table width. Returns (keys, keys per split)."""
    length = tl.minimum(seq_len, width)
    return length, tl.cdiv(tl.cdiv(length, num_splits), BLOCK_N) * BLOCK_N


@triton.jit(do_not_specialize=["tokens", "heads", "width", "num_splits", "head_tiles"])
def _attend_splits_kernel(
    q_latent_ptr, q_rope_ptr, latent_cache_ptr, rope_cache_ptr, page_table_ptr, seq_lens_ptr, key_positions_ptr,
    q_seq_ids_ptr, q_positions_ptr, split_out_ptr, split_lse_ptr,
    tokens, heads, width, num_splits, head_tiles, scale_log2,
    stride_q_latent_token, stride_q_latent_head, stride_q_latent_col,
    stride_q_rope_token, stride_q_rope_head, stride_q_rope_col,
    stride_latent_cache_row, stride_latent_cache_col,
    stride_rope_cache_row, stride_rope_cache_col,
    stride_table_req, stride_table_col,
    stride_seq_lens,
    stride_key_positions_req, stride_key_positions_col,
    stride_q_seq_ids, stride_q_positions,
    stride_split_out_token, stride_split_out_split, stride_split_out_head,
    stride_split_lse_token, stride_split_lse_split,
    RANK_DIM: tl.constexpr, ROPE_DIM: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    OPERAND_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, LN2: tl.constexpr, NZ_BLOCK: tl.constexpr,
):
    latent_cols = tl.arange(0, BLOCK_R).to(tl.int64)
    rope_cols = tl.arange(0, BLOCK_P).to(tl.int64)
    latent_mask = latent_cols < RANK_DIM
    rope_mask = rope_cols < ROPE_DIM
    key_offsets = tl.arange(0, BLOCK_N)
    work_items = tokens * num_splits * head_tiles
    for work in range(tl.program_id(0), work_items, tl.num_programs(0)):
        # Head tiles, then tokens, vary fastest: the queries of one request (adjacent tokens) read
        # the same KV split at the same time, so verify's k queries share each block through L2.
        head_tile = work % head_tiles
        token = tl.cast((work // head_tiles) % tokens, tl.int64)
        split = tl.cast(work // (head_tiles * tokens), tl.int64)
        request = tl.load(q_seq_ids_ptr + token * stride_q_seq_ids).to(tl.int64)
        seq_len = tl.load(seq_lens_ptr + request * stride_seq_lens).to(tl.int32)
        query_position = tl.load(q_positions_ptr + token * stride_q_positions).to(tl.int64)
        length, keys_per_split = _keys_per_split(seq_len, width, num_splits, BLOCK_N)
        start = split * keys_per_split
        end = tl.minimum(start + keys_per_split, length)
        if start < end:
            head = (head_tile * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)
            head_mask = head < heads
            q_latent = tl.load(
                q_latent_ptr + token * stride_q_latent_token + head[:, None] * stride_q_latent_head
                + latent_cols[None, :] * stride_q_latent_col,
                mask=head_mask[:, None] & latent_mask[None, :], other=0.0).to(OPERAND_DTYPE)
            q_rope = tl.load(
                q_rope_ptr + token * stride_q_rope_token + head[:, None] * stride_q_rope_head
                + rope_cols[None, :] * stride_q_rope_col,
                mask=head_mask[:, None] & rope_mask[None, :], other=0.0).to(OPERAND_DTYPE)
            table_row = page_table_ptr + request * stride_table_req
            key_positions_row = key_positions_ptr + request * stride_key_positions_req
            # Running softmax in base 2 (scores are pre-scaled by log2 e); the LSE is stored in base e.
            max_score = tl.full([BLOCK_H], float("-inf"), tl.float32)
            denominator = tl.zeros([BLOCK_H], tl.float32)
            acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
            for first_key in range(start, end, BLOCK_N):
                key = (first_key + key_offsets).to(tl.int64)
                key_mask = key < end
                row = tl.load(table_row + key * stride_table_col, mask=key_mask, other=0).to(tl.int64)
                key_position = tl.load(key_positions_row + key * stride_key_positions_col,
                                       mask=key_mask, other=0).to(tl.int64)
                visible = key_mask & (key_position <= query_position)
                k_latent = tl.load(latent_cache_ptr + cache_offsets(row[:, None], latent_cols[None, :],
                                                                    stride_latent_cache_row, stride_latent_cache_col,
                                                                    NZ_BLOCK),
                                   mask=key_mask[:, None] & latent_mask[None, :], other=0.0).to(OPERAND_DTYPE)
                k_rope = tl.load(rope_cache_ptr + cache_offsets(row[:, None], rope_cols[None, :], stride_rope_cache_row,
                                                                stride_rope_cache_col, NZ_BLOCK),
                                 mask=key_mask[:, None] & rope_mask[None, :], other=0.0).to(OPERAND_DTYPE)
                scores = tl.dot(q_rope, tl.trans(k_rope), input_precision=DOT_PRECISION)
                scores = tl.dot(q_latent, tl.trans(k_latent), scores, input_precision=DOT_PRECISION)
                scores = tl.where(visible[None, :], scores * scale_log2, float("-inf"))
                new_max = tl.maximum(max_score, tl.max(scores, 1))
                # While every score so far is -inf, shift by 0 so that no -inf - -inf makes a NaN.
                shift = tl.where(new_max == float("-inf"), 0.0, new_max)
                rescale = tl.exp2(max_score - shift)
                probs = tl.exp2(scores - shift[:, None])
                denominator = denominator * rescale + tl.sum(probs, 1)
                acc = acc * rescale[:, None] + tl.dot(probs.to(OPERAND_DTYPE), k_latent, input_precision=DOT_PRECISION)
                max_score = new_max
            seen = denominator > 0
            safe_denominator = tl.where(seen, denominator, 1.0)
            split_lse = tl.where(seen, (max_score + tl.log2(safe_denominator)) * LN2, float("-inf"))
            split_out = acc / safe_denominator[:, None]
            tl.store(split_out_ptr + token * stride_split_out_token + split * stride_split_out_split
                     + head[:, None].to(tl.int64) * stride_split_out_head + latent_cols[None, :],
                     split_out, mask=head_mask[:, None] & latent_mask[None, :])
            tl.store(split_lse_ptr + token * stride_split_lse_token + split * stride_split_lse_split + head,
                     split_lse, mask=head_mask)


@triton.jit(do_not_specialize=["tokens", "heads", "width", "num_splits", "head_tiles"])
def _merge_splits_kernel(
    split_out_ptr, split_lse_ptr, seq_lens_ptr, q_seq_ids_ptr, out_ptr, lse_ptr,
    tokens, heads, width, num_splits, head_tiles,
    stride_split_out_token, stride_split_out_split, stride_split_out_head,
    stride_split_lse_token, stride_split_lse_split,
    stride_seq_lens, stride_q_seq_ids,
    stride_out_token, stride_out_head, stride_out_col,
    stride_lse_token, stride_lse_head,
    RANK_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr,
):
    # One work item merges a tile of BLOCK_H heads of one token: the heads of a token share its
    # request's splits, so the loop over splits serves them all.
    cols = tl.arange(0, BLOCK_R).to(tl.int64)
    col_mask = cols < RANK_DIM
    for work in range(tl.program_id(0), tokens * head_tiles, tl.num_programs(0)):
        heads_in_tile = ((work % head_tiles) * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)
        head_mask = heads_in_tile < heads
        token = tl.cast(work // head_tiles, tl.int64)
        request = tl.load(q_seq_ids_ptr + token * stride_q_seq_ids).to(tl.int64)
        seq_len = tl.load(seq_lens_ptr + request * stride_seq_lens).to(tl.int32)
        length, keys_per_split = _keys_per_split(seq_len, width, num_splits, BLOCK_N)
        # Stage 1 wrote only the splits that hold keys; the others are never read.
        active_splits = tl.where(keys_per_split > 0, tl.cdiv(length, tl.maximum(keys_per_split, 1)), 0)
        max_lse = tl.full([BLOCK_H], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
        for split in range(0, active_splits):
            split_lse = tl.load(split_lse_ptr + token * stride_split_lse_token + split * stride_split_lse_split
                                + heads_in_tile, mask=head_mask, other=float("-inf"))
            split_out = tl.load(split_out_ptr + token * stride_split_out_token + split * stride_split_out_split
                                + heads_in_tile[:, None] * stride_split_out_head + cols[None, :],
                                mask=head_mask[:, None] & col_mask[None, :], other=0.0)
            new_max = tl.maximum(max_lse, split_lse)
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)
            rescale = tl.exp(max_lse - shift)
            weight = tl.exp(split_lse - shift)
            acc = acc * rescale[:, None] + weight[:, None] * split_out
            total = total * rescale + weight
            max_lse = new_max
        seen = total > 0
        out = tl.where(seen[:, None], acc / tl.where(seen, total, 1.0)[:, None], 0.0)
        lse = tl.where(seen, max_lse + tl.log(tl.where(seen, total, 1.0)), float("-inf"))
        tl.store(out_ptr + token * stride_out_token + heads_in_tile[:, None] * stride_out_head
                 + cols[None, :] * stride_out_col, out.to(out_ptr.dtype.element_ty),
                 mask=head_mask[:, None] & col_mask[None, :])
        tl.store(lse_ptr + token * stride_lse_token + heads_in_tile * stride_lse_head, lse, mask=head_mask)


def split_workspace(tokens: int, num_splits: int, heads: int, rank_dim: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 partials of every split: out [T, S, H, R] and lse [T, S, H]."""
    return (torch.empty((tokens, num_splits, heads, rank_dim), dtype=torch.float32, device=device),
            torch.empty((tokens, num_splits, heads), dtype=torch.float32, device=device))


def check_outputs(q_latent, out, lse) -> None:
    tokens, heads, _ = q_latent.shape
    if out.shape != q_latent.shape or out.dtype != q_latent.dtype or lse.shape != (tokens, heads) or lse.dtype != torch.float32:
        raise ValueError(f"out must be {tuple(q_latent.shape)} {q_latent.dtype} and lse {(tokens, heads)} float32; got "
                         f"{tuple(out.shape)} {out.dtype} and {tuple(lse.shape)} {lse.dtype}")


def checked_workspace(workspace, tiling: AttentionTiling, q_latent) -> tuple[torch.Tensor, torch.Tensor]:
    """`workspace` (or a new one) after checking it is split_workspace's for this call."""
    tokens, heads, rank_dim = q_latent.shape
    split_out, split_lse = workspace or split_workspace(tokens, tiling.num_splits, heads, rank_dim, q_latent.device)
    if split_out.shape != (tokens, tiling.num_splits, heads, rank_dim) or split_out.stride(3) != 1 \
            or split_lse.shape != (tokens, tiling.num_splits, heads) or split_lse.stride(2) != 1:
        raise ValueError("workspace must be split_workspace(T, num_splits, H, R) for this call")
    return split_out, split_lse


def _check_inputs(q_latent, q_rope, kv_cache, page_table, seq_lens, key_positions, q_seq_ids, q_positions, rope_cache=None):
    """The cache's (latent, rope) parts (launching.cache_parts), after checking every input."""
    for name, tensor in (("q_latent", q_latent), ("q_rope", q_rope)):
        check_float(name, tensor)
    for name, tensor in (("page_table", page_table), ("seq_lens", seq_lens), ("key_positions", key_positions),
                         ("q_seq_ids", q_seq_ids), ("q_positions", q_positions)):
        check_index(name, tensor)
    check_same_device(q_latent=q_latent, q_rope=q_rope, kv_cache=kv_cache, page_table=page_table,
                      seq_lens=seq_lens, key_positions=key_positions, q_seq_ids=q_seq_ids, q_positions=q_positions)
    if q_latent.dim() != 3 or q_rope.dim() != 3 or q_latent.shape[:2] != q_rope.shape[:2]:
        raise ValueError(f"q_latent and q_rope must be [T, H, R] and [T, H, P]; got "
                         f"{tuple(q_latent.shape)} and {tuple(q_rope.shape)}")
    tokens, _, rank_dim = q_latent.shape
    rope_dim = q_rope.shape[2]
    parts = cache_parts(kv_cache, rope_cache, rank_dim, rope_dim)
    if page_table.dim() != 2 or key_positions.shape != page_table.shape or seq_lens.shape != page_table.shape[:1]:
        raise ValueError(f"page_table and key_positions must be [B, L] and seq_lens [B]; got {tuple(page_table.shape)}, "
                         f"{tuple(key_positions.shape)}, {tuple(seq_lens.shape)}")
    if q_seq_ids.shape != (tokens,) or q_positions.shape != (tokens,):
        raise ValueError(f"q_seq_ids and q_positions must be [T] = [{tokens}]; got {tuple(q_seq_ids.shape)}, "
                         f"{tuple(q_positions.shape)}")
    return parts


def partial_attention_into(q_latent, q_rope, kv_cache, page_table, seq_lens, key_positions, q_seq_ids, q_positions,
                           sm_scale: float, out, lse, tiling: AttentionTiling | None = None, workspace=None,
                           rope_cache=None) -> None:
    """`partial_attention` writing into out [T, H, R] and lse [T, H].

    `tiling` overrides the heuristic (benchmarks sweep it); `workspace` is the pair from
    `split_workspace` for tiling.num_splits, for callers that keep static buffers.
    """
    latent_cache, rope_part = _check_inputs(q_latent, q_rope, kv_cache, page_table, seq_lens, key_positions, q_seq_ids,
                                            q_positions, rope_cache)
    tokens, heads, rank_dim = q_latent.shape
    rope_dim = q_rope.shape[2]
    width = page_table.shape[1]
    check_outputs(q_latent, out, lse)
    if tokens == 0 or heads == 0:
        return
    tiling = tiling or choose_tiling(tokens, heads, width, q_latent.device, kv_cache.dtype)
    head_tiles = triton.cdiv(heads, tiling.block_h)
    split_out, split_lse = checked_workspace(workspace, tiling, q_latent)
    # The dots take the cache's dtype on a device, fp32 under the interpreter, whose tl.dot
    # multiplies the raw bits of bf16 (triton-lang/triton#11584). fp32 dots ask for IEEE
    # precision: the default TF32 would miss the reference by 1e-3.
    dot_in_fp32 = kv_cache.dtype == torch.float32 or is_interpreted(_attend_splits_kernel)
    _attend_splits_kernel[grid_for(tokens * tiling.num_splits * head_tiles)](
        q_latent, q_rope, latent_cache, rope_part, page_table, seq_lens, key_positions, q_seq_ids, q_positions, split_out,
        split_lse, tokens, heads, width, tiling.num_splits, head_tiles, sm_scale / _LN2,
        q_latent.stride(0), q_latent.stride(1), q_latent.stride(2),
        q_rope.stride(0), q_rope.stride(1), q_rope.stride(2),
        *row_addressing(latent_cache)[:2],
        *row_addressing(rope_part)[:2],
        page_table.stride(0), page_table.stride(1),
        seq_lens.stride(0),
        key_positions.stride(0), key_positions.stride(1),
        q_seq_ids.stride(0), q_positions.stride(0),
        split_out.stride(0), split_out.stride(1), split_out.stride(2),
        split_lse.stride(0), split_lse.stride(1),
        RANK_DIM=rank_dim, ROPE_DIM=rope_dim,
        BLOCK_R=block_size(rank_dim), BLOCK_P=block_size(rope_dim), BLOCK_H=tiling.block_h, BLOCK_N=tiling.block_n,
        OPERAND_DTYPE=tl.float32 if dot_in_fp32 else triton_dtype(kv_cache.dtype),
        DOT_PRECISION="ieee" if dot_in_fp32 else None, LN2=_LN2, NZ_BLOCK=row_addressing(latent_cache)[2],
        num_warps=tiling.num_warps, num_stages=tiling.num_stages,
    )
    merge_splits(split_out, split_lse, seq_lens, q_seq_ids, width, tiling, out, lse)


def merge_splits(split_out, split_lse, seq_lens, q_seq_ids, width: int, tiling: AttentionTiling, out, lse) -> None:
    """Stage 2: each (query, head)'s splits merged by their LSE into out and lse; a split is read
    where its request has keys in it (`_keys_per_split` of the page-table width and tiling)."""
    tokens, _, heads, rank_dim = split_out.shape
    # Under the interpreter a work item costs Python per op, not registers: one takes every head.
    most_heads = MAX_BLOCK_H if is_interpreted(_merge_splits_kernel) else MERGE_BLOCK_H
    merge_heads = min(most_heads, triton.next_power_of_2(heads))
    merge_tiles = triton.cdiv(heads, merge_heads)
    _merge_splits_kernel[grid_for(tokens * merge_tiles)](
        split_out, split_lse, seq_lens, q_seq_ids, out, lse,
        tokens, heads, width, tiling.num_splits, merge_tiles,
        split_out.stride(0), split_out.stride(1), split_out.stride(2),
        split_lse.stride(0), split_lse.stride(1),
        seq_lens.stride(0), q_seq_ids.stride(0),
        out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0), lse.stride(1),
        RANK_DIM=rank_dim, BLOCK_R=block_size(rank_dim), BLOCK_N=tiling.block_n, BLOCK_H=merge_heads,
        num_warps=4,
    )


def partial_attention(q_latent, q_rope, kv_cache, page_table, seq_lens, key_positions, q_seq_ids, q_positions,
                      sm_scale: float, rope_cache=None):
    """Causal MLA attention of each query over its request's rows of `kv_cache`.

    Returns out [T, H, R] in q's dtype and lse [T, H] in fp32 (natural log); a query that sees no
    key gets out = 0 and lse = -inf.
    """
    check_float("q_latent", q_latent)
    tokens, heads, rank_dim = q_latent.shape
    out = torch.empty((tokens, heads, rank_dim), dtype=q_latent.dtype, device=q_latent.device)
    lse = torch.empty((tokens, heads), dtype=torch.float32, device=q_latent.device)
    partial_attention_into(q_latent, q_rope, kv_cache, page_table, seq_lens, key_positions, q_seq_ids, q_positions,
                           sm_scale, out, lse, rope_cache=rope_cache)
    return out, lse
