"""MLA partial attention with the queries of a request folded into the rows of one tile.

Same contract as `attention.partial_attention` (and `reference.partial_attention`): the query
tokens may come in any order (the model contract asks for none). Verify's k draft tokens of a
request read the same keys, so a program takes BLOCK_M rows of (query, head) pairs of one
request, k x heads rows in all, and each KV block it loads serves every one of them: FlashMLA's
layout (the draft tokens folded into the head dimension). The per-query kernel in attention.py
loads each block once per query and head tile (sharing it through L2 at best); with 16 heads
and k = 4 a folded tile of 64 rows does the work of four of its programs with one read.

Each row keeps its own causal mask (key position <= the row's query position), so a shard of
a DCP rank, whose keys carry global positions, is served as attention.py serves it. The KV
splits and their merge are attention.py's: the same split of a request's keys, the same
workspace and the same merge kernel, so the two kernels agree split by split.

A request's tokens are found on the device, reading nothing back (a captured graph stays
valid): a stable sort of q_seq_ids puts the tokens in request order, a searchsorted over the
sorted ids gives each request's range of them, and the kernel reads q and writes its partials
through that order, with no gather or scatter pass. The sort is of T ids a layer; for a batch
already grouped by request (RequestTable's) it is the identity, and the tiles are the same. Row
ids lie in [0, rows), as the batch guard leaves them (passes/guard_batch.py) for attention.py's
kernel too.

The launcher folds where it measured faster than attention.py's kernel (`folds`), and runs that
one elsewhere. On an H100 (bench/results/gpu_h100_2026-12-06d, Kimi-K2 latent sizes, 32k and
128k, k = 4..16), against the per-query kernel's time:
- 16 heads (a per-query tile a quarter full): 0.52-0.96x with 4 tiles or more in all (0.52-0.69x
  at 128k); with fewer (batch 1, k = 4 or 7) 0.86-1.90x, its splits each too short;
- 32 heads (half full): 0.81-1.03x with 16 tiles or more (batch 4 at k >= 7, batch 16); with
  fewer 0.91-1.52x;
- 64 heads, where one query's heads fill a tile themselves and folding gains no row: 1.18-1.50x.
Below 16 heads the per-query tile (16 rows at least) is emptier still; that is not measured.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dcp_compile.lowering.triton import attention
from dcp_compile.lowering.triton.attention import _LN2, _check_inputs, _keys_per_split
from dcp_compile.lowering.triton.attention_tiling import AttentionTiling, choose_num_splits, parallel_units
from dcp_compile.lowering.triton.launching import (
    block_size,
    cache_offsets,
    check_float,
    grid_for,
    is_interpreted,
    row_addressing,
    triton_dtype,
)

FOLDED_ROWS = 64
"""Rows of (query, head) pairs a program takes: one warpgroup MMA's M on Hopper, and a [64, 512]
fp32 accumulator, the most that stays in registers (attention_tiling.MAX_BLOCK_H)."""
FOLDED_QUERIES = range(4, 17)
"""Queries a request (on average) at which the launcher folds: the k it was measured at."""
MIN_FOLDED_TILES = {16: 4, 32: 16}
"""Most heads -> the fewest tiles in all (requests x tiles a request) at which the launcher folds;
above 32 heads it never does (module docstring)."""


@triton.jit(do_not_specialize=["rows", "heads", "width", "num_splits", "tiles"])
def _attend_folded_kernel(
    q_latent_ptr, q_rope_ptr, latent_cache_ptr, rope_cache_ptr, page_table_ptr, seq_lens_ptr, key_positions_ptr,
    query_starts_ptr, token_order_ptr, q_positions_ptr, split_out_ptr, split_lse_ptr,
    rows, heads, width, num_splits, tiles, scale_log2,
    stride_q_latent_token, stride_q_latent_head, stride_q_latent_col,
    stride_q_rope_token, stride_q_rope_head, stride_q_rope_col,
    stride_latent_cache_row, stride_latent_cache_col,
    stride_rope_cache_row, stride_rope_cache_col,
    stride_table_req, stride_table_col,
    stride_seq_lens,
    stride_key_positions_req, stride_key_positions_col,
    stride_q_positions,
    stride_split_out_token, stride_split_out_split, stride_split_out_head,
    stride_split_lse_token, stride_split_lse_split,
    RANK_DIM: tl.constexpr, ROPE_DIM: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    OPERAND_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, LN2: tl.constexpr, NZ_BLOCK: tl.constexpr,
):
    latent_cols = tl.arange(0, BLOCK_R).to(tl.int64)
    rope_cols = tl.arange(0, BLOCK_P).to(tl.int64)
    latent_mask = latent_cols < RANK_DIM
    rope_mask = rope_cols < ROPE_DIM
    key_offsets = tl.arange(0, BLOCK_N)
    tile_rows = tl.arange(0, BLOCK_M)
    for work in range(tl.program_id(0), rows * tiles * num_splits, tl.num_programs(0)):
        # Tiles, then requests, vary fastest: the tiles of one request that read the same split run
        # side by side (a request with more rows than `tiles` tiles loops below).
        first_tile = work % tiles
        request = tl.cast((work // tiles) % rows, tl.int64)
        split = tl.cast(work // (tiles * rows), tl.int64)
        first_token = tl.load(query_starts_ptr + request).to(tl.int64)
        queries = tl.load(query_starts_ptr + request + 1).to(tl.int64) - first_token
        seq_len = tl.load(seq_lens_ptr + request * stride_seq_lens).to(tl.int32)
        length, keys_per_split = _keys_per_split(seq_len, width, num_splits, BLOCK_N)
        start = split * keys_per_split
        end = tl.minimum(start + keys_per_split, length)
        table_row = page_table_ptr + request * stride_table_req
        key_positions_row = key_positions_ptr + request * stride_key_positions_req
        if start < end:
            for tile in range(first_tile, tl.cdiv(queries * heads, BLOCK_M), tiles):
                pair = tile * BLOCK_M + tile_rows
                row_mask = pair < queries * heads
                # The request's queries in request order: the batch's tokens come in any order.
                token = tl.load(token_order_ptr + first_token + pair // heads, mask=row_mask, other=0).to(tl.int64)
                head = pair % heads
                q_latent = tl.load(
                    q_latent_ptr + token[:, None] * stride_q_latent_token + head[:, None] * stride_q_latent_head
                    + latent_cols[None, :] * stride_q_latent_col,
                    mask=row_mask[:, None] & latent_mask[None, :], other=0.0).to(OPERAND_DTYPE)
                q_rope = tl.load(
                    q_rope_ptr + token[:, None] * stride_q_rope_token + head[:, None] * stride_q_rope_head
                    + rope_cols[None, :] * stride_q_rope_col,
                    mask=row_mask[:, None] & rope_mask[None, :], other=0.0).to(OPERAND_DTYPE)
                query_position = tl.load(q_positions_ptr + token * stride_q_positions, mask=row_mask, other=-1).to(tl.int64)
                # Base-2 running softmax (scores pre-scaled by log2 e); the LSE is stored in base e.
                max_score = tl.full([BLOCK_M], float("-inf"), tl.float32)
                denominator = tl.zeros([BLOCK_M], tl.float32)
                acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
                for first_key in range(start, end, BLOCK_N):
                    key = (first_key + key_offsets).to(tl.int64)
                    key_mask = key < end
                    row = tl.load(table_row + key * stride_table_col, mask=key_mask, other=0).to(tl.int64)
                    key_position = tl.load(key_positions_row + key * stride_key_positions_col,
                                           mask=key_mask, other=0).to(tl.int64)
                    visible = key_mask[None, :] & (key_position[None, :] <= query_position[:, None])
                    k_latent = tl.load(latent_cache_ptr + cache_offsets(row[:, None], latent_cols[None, :],
                                                                        stride_latent_cache_row, stride_latent_cache_col,
                                                                        NZ_BLOCK),
                                       mask=key_mask[:, None] & latent_mask[None, :], other=0.0).to(OPERAND_DTYPE)
                    k_rope = tl.load(rope_cache_ptr + cache_offsets(row[:, None], rope_cols[None, :],
                                                                    stride_rope_cache_row, stride_rope_cache_col,
                                                                    NZ_BLOCK),
                                     mask=key_mask[:, None] & rope_mask[None, :], other=0.0).to(OPERAND_DTYPE)
                    scores = tl.dot(q_rope, tl.trans(k_rope), input_precision=DOT_PRECISION)
                    scores = tl.dot(q_latent, tl.trans(k_latent), scores, input_precision=DOT_PRECISION)
                    scores = tl.where(visible, scores * scale_log2, float("-inf"))
                    new_max = tl.maximum(max_score, tl.max(scores, 1))
                    # While every score so far is -inf, shift by 0 so that no -inf - -inf makes a NaN.
                    shift = tl.where(new_max == float("-inf"), 0.0, new_max)
                    rescale = tl.exp2(max_score - shift)
                    probs = tl.exp2(scores - shift[:, None])
                    denominator = denominator * rescale + tl.sum(probs, 1)
                    acc = acc * rescale[:, None] + tl.dot(probs.to(OPERAND_DTYPE), k_latent,
                                                          input_precision=DOT_PRECISION)
                    max_score = new_max
                seen = denominator > 0
                safe_denominator = tl.where(seen, denominator, 1.0)
                split_lse = tl.where(seen, (max_score + tl.log2(safe_denominator)) * LN2, float("-inf"))
                split_out = acc / safe_denominator[:, None]
                tl.store(split_out_ptr + token[:, None] * stride_split_out_token + split * stride_split_out_split
                         + head[:, None] * stride_split_out_head + latent_cols[None, :],
                         split_out, mask=row_mask[:, None] & latent_mask[None, :])
                tl.store(split_lse_ptr + token * stride_split_lse_token + split * stride_split_lse_split + head,
                         split_lse, mask=row_mask)


def choose_folded_tiling(tokens: int, rows: int, heads: int, width: int, device: torch.device,
                         cache_dtype: torch.dtype = torch.bfloat16) -> tuple[AttentionTiling, int]:
    """(tiling, tiles a request's work item covers) for `tokens` queries over `rows` requests.

    The tiles are sized for the mean queries a request (exact for verify's k each); a request with
    more loops over them. block_h is the tile's rows (FOLDED_ROWS; half of it in fp32, the exact
    path, whose IEEE dots would fill shared memory), num_splits fills the device as attention.py's
    heuristic does, counting tiles instead of (query, head tile) pairs.
    """
    most_rows = FOLDED_ROWS if cache_dtype != torch.float32 else FOLDED_ROWS // 2
    mean_queries = max(1, _mean_queries(tokens, rows))
    block_m = min(most_rows, max(16, triton.next_power_of_2(mean_queries * heads)))
    tiles = triton.cdiv(mean_queries * heads, block_m)
    num_splits = choose_num_splits(max(1, rows * tiles), width, parallel_units(device))
    if cache_dtype == torch.float32:
        return AttentionTiling(num_splits=num_splits, block_h=block_m, block_n=16, num_warps=8, num_stages=2), tiles
    return AttentionTiling(num_splits=num_splits, block_h=block_m, block_n=64, num_warps=8, num_stages=2), tiles


def _mean_queries(tokens: int, rows: int) -> int:
    """Queries a request, rounded up: verify's k where every request has k."""
    return -(-tokens // max(rows, 1))


def request_order(q_seq_ids: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(token_order [T] int64, query_starts [rows + 1] int32): request b's queries are tokens
    token_order[query_starts[b]] .. token_order[query_starts[b + 1] - 1], for q_seq_ids in any
    order (a stable sort: the identity where they are grouped by request, in request order). On
    the device, no read back."""
    sorted_ids, token_order = torch.sort(q_seq_ids, stable=True)
    requests = torch.arange(rows + 1, dtype=sorted_ids.dtype, device=sorted_ids.device)
    return token_order, torch.searchsorted(sorted_ids, requests, out_int32=True)


def folds(tokens: int, rows: int, heads: int) -> bool:
    """Whether the launcher folds `tokens` queries over `rows` requests at `heads` heads: verify's
    measured range (FOLDED_QUERIES queries a request on average), at most 32 heads, with
    MIN_FOLDED_TILES tiles or more (module docstring); decode (one query a request) never. Shapes
    only: the choice reads nothing from the device."""
    fewest = next((tiles for most, tiles in sorted(MIN_FOLDED_TILES.items()) if heads <= most), None)
    mean_queries = _mean_queries(tokens, rows)
    return (fewest is not None and mean_queries in FOLDED_QUERIES
            and rows * triton.cdiv(mean_queries * heads, FOLDED_ROWS) >= fewest)


def folded_partial_attention_into(q_latent, q_rope, kv_cache, page_table, seq_lens, key_positions, q_seq_ids,
                                  q_positions, sm_scale: float, out, lse, tiling: AttentionTiling | None = None,
                                  tiles: int | None = None, workspace=None, rope_cache=None,
                                  fold: bool | None = None) -> None:
    """`folded_partial_attention` writing into out [T, H, R] and lse [T, H]; `tiling` and `tiles`
    override choose_folded_tiling (benchmarks sweep them), `workspace` is attention.split_workspace's;
    `fold` (default: folds(...)) False runs attention.py's kernel instead, True the folded one at
    any shape."""
    if not (folds(q_latent.shape[0], page_table.shape[0], q_latent.shape[1]) if fold is None else fold):
        attention.partial_attention_into(q_latent, q_rope, kv_cache, page_table, seq_lens, key_positions, q_seq_ids,
                                         q_positions, sm_scale, out, lse, rope_cache=rope_cache)
        return
    latent_cache, rope_part = _check_inputs(q_latent, q_rope, kv_cache, page_table, seq_lens, key_positions, q_seq_ids,
                                            q_positions, rope_cache)
    tokens, heads, rank_dim = q_latent.shape
    rope_dim = q_rope.shape[2]
    rows, width = page_table.shape
    attention.check_outputs(q_latent, out, lse)
    if tokens == 0 or heads == 0:
        return
    chosen, chosen_tiles = choose_folded_tiling(tokens, rows, heads, width, q_latent.device, kv_cache.dtype)
    tiling, tiles = tiling or chosen, tiles or chosen_tiles
    split_out, split_lse = attention.checked_workspace(workspace, tiling, q_latent)
    # As in attention.py: the cache's dtype in the dots on a device, IEEE fp32 under the interpreter.
    dot_in_fp32 = kv_cache.dtype == torch.float32 or is_interpreted(_attend_folded_kernel)
    latent_addressing, rope_addressing = row_addressing(latent_cache), row_addressing(rope_part)
    if rows > 0:
        token_order, starts = request_order(q_seq_ids, rows)
        _attend_folded_kernel[grid_for(rows * tiles * tiling.num_splits)](
            q_latent, q_rope, latent_cache, rope_part, page_table, seq_lens, key_positions, starts, token_order,
            q_positions, split_out, split_lse,
            rows, heads, width, tiling.num_splits, tiles, sm_scale / _LN2,
            q_latent.stride(0), q_latent.stride(1), q_latent.stride(2),
            q_rope.stride(0), q_rope.stride(1), q_rope.stride(2),
            *latent_addressing[:2],
            *rope_addressing[:2],
            page_table.stride(0), page_table.stride(1),
            seq_lens.stride(0),
            key_positions.stride(0), key_positions.stride(1),
            q_positions.stride(0),
            split_out.stride(0), split_out.stride(1), split_out.stride(2),
            split_lse.stride(0), split_lse.stride(1),
            RANK_DIM=rank_dim, ROPE_DIM=rope_dim,
            BLOCK_R=block_size(rank_dim), BLOCK_P=block_size(rope_dim), BLOCK_M=tiling.block_h, BLOCK_N=tiling.block_n,
            OPERAND_DTYPE=tl.float32 if dot_in_fp32 else triton_dtype(kv_cache.dtype),
            DOT_PRECISION="ieee" if dot_in_fp32 else None, LN2=_LN2, NZ_BLOCK=latent_addressing[2],
            num_warps=tiling.num_warps, num_stages=tiling.num_stages,
        )
    attention.merge_splits(split_out, split_lse, seq_lens, q_seq_ids, width, tiling, out, lse)


def folded_partial_attention(q_latent, q_rope, kv_cache, page_table, seq_lens, key_positions, q_seq_ids, q_positions,
                             sm_scale: float, rope_cache=None):
    """`attention.partial_attention` with the queries of a request folded into the rows of one tile
    (module docstring), the tokens in any order. Returns out [T, H, R] in q's dtype and lse [T, H]
    fp32 (natural log); a query that sees no key gets out = 0 and lse = -inf."""
    check_float("q_latent", q_latent)
    tokens, heads, rank_dim = q_latent.shape
    out = torch.empty((tokens, heads, rank_dim), dtype=q_latent.dtype, device=q_latent.device)
    lse = torch.empty((tokens, heads), dtype=torch.float32, device=q_latent.device)
    folded_partial_attention_into(q_latent, q_rope, kv_cache, page_table, seq_lens, key_positions, q_seq_ids,
                                  q_positions, sm_scale, out, lse, rope_cache=rope_cache)
    return out, lse
