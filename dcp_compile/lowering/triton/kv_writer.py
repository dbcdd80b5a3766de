"""Sharded KV writer: each token's [latent | rope] row goes to this rank's shard in one pass.

Matches `reference.kv_write`: location 0 (padding) and locations another rank owns are
skipped; an owned location `loc` lands on local row (loc // (I*N)) * I + loc % I, the math of
`runtime.layout` (repeated here because a kernel cannot call Python). A location outside the
pool is never written: the kernel drops the token and sets this device's `write_location` error
flag (runtime/guards.py), which the compiled model reads back without stalling the step and
reports as an error (api.DCPModel); the torch reference raises at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dcp_compile.lowering.triton.launching import (block_size, cache_offsets, cache_parts, check_float, check_index,
                                                   check_same_device, grid_for, row_addressing)
from dcp_compile.ops import nz
from dcp_compile.runtime import guards, layout


def location_error_flag(device: torch.device) -> torch.Tensor:
    """This device's `write_location` flag (a view of runtime.guards.error_flags), int32 [1]."""
    index = guards.INDEX["write_location"]
    return guards.error_flags(device)[index : index + 1]


@triton.jit(do_not_specialize=["tokens", "dcp_rank", "capacity"])
def _kv_write_kernel(
    latent_cache_ptr, rope_cache_ptr, latent_ptr, rope_ptr, loc_ptr, error_ptr,
    tokens, dcp_rank, dcp_size, interleave, capacity,
    stride_latent_cache_row, stride_latent_cache_col,
    stride_rope_cache_row, stride_rope_cache_col,
    stride_latent_token, stride_latent_col,
    stride_rope_token, stride_rope_col,
    stride_loc,
    RANK_DIM: tl.constexpr, ROPE_DIM: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, NZ_BLOCK: tl.constexpr,
):
    latent_cols = tl.arange(0, BLOCK_R).to(tl.int64)
    rope_cols = tl.arange(0, BLOCK_P).to(tl.int64)
    latent_mask = latent_cols < RANK_DIM
    rope_mask = rope_cols < ROPE_DIM
    for token in range(tl.program_id(0), tokens, tl.num_programs(0)):
        token_index = tl.cast(token, tl.int64)
        loc = tl.load(loc_ptr + token_index * stride_loc).to(tl.int64)
        # A location outside the pool (negative, or past its logical capacity) is never written.
        outside = (loc < 0) | (loc >= capacity)
        if outside:
            tl.store(error_ptr, 1)
        owned = (loc > 0) & (loc < capacity) & ((loc // interleave) % dcp_size == dcp_rank)
        if owned:
            row = (loc // (interleave * dcp_size)) * interleave + loc % interleave
            # Through fp32 so every source/cache dtype pair converts with one rounding, as torch's
            # .to() does.
            latent = tl.load(latent_ptr + token_index * stride_latent_token + latent_cols * stride_latent_col,
                             mask=latent_mask).to(tl.float32)
            rope = tl.load(rope_ptr + token_index * stride_rope_token + rope_cols * stride_rope_col,
                           mask=rope_mask).to(tl.float32)
            tl.store(latent_cache_ptr + cache_offsets(row, latent_cols, stride_latent_cache_row,
                                                      stride_latent_cache_col, NZ_BLOCK),
                     latent.to(latent_cache_ptr.dtype.element_ty), mask=latent_mask)
            tl.store(rope_cache_ptr + cache_offsets(row, rope_cols, stride_rope_cache_row, stride_rope_cache_col,
                                                    NZ_BLOCK),
                     rope.to(rope_cache_ptr.dtype.element_ty), mask=rope_mask)


def kv_write(kv_cache, latent, rope, loc, dcp_rank: int = 0, dcp_size: int = 1, interleave: int = 1,
             rope_cache=None) -> None:
    """Write [latent | rope] for each token whose location this rank owns; skip location 0. With
    rope_cache (the split layout), latent goes to kv_cache [rows, R] and rope to rope_cache
    (either of them NZ: ops/nz.py)."""
    layout.validate(dcp_size, dcp_rank, interleave)
    check_float("latent", latent)
    check_float("rope", rope)
    check_index("loc", loc)
    check_same_device(kv_cache=kv_cache, latent=latent, rope=rope, loc=loc)
    tokens, rank_dim = latent.shape
    rope_dim = rope.shape[1]
    latent_cache, rope_part = cache_parts(kv_cache, rope_cache, rank_dim, rope_dim)
    if rope.shape[0] != tokens or loc.shape != (tokens,):
        raise ValueError(
            f"latent [T, R], rope [T, P] and loc [T] must agree on T; got {tuple(latent.shape)}, "
            f"{tuple(rope.shape)}, {tuple(loc.shape)}"
        )
    if tokens == 0:
        return
    latent_row, latent_col, nz_block = row_addressing(latent_cache)
    rope_row, rope_col, _ = row_addressing(rope_part)
    _kv_write_kernel[grid_for(tokens)](
        latent_cache, rope_part, latent, rope, loc, location_error_flag(kv_cache.device),
        tokens, dcp_rank, dcp_size, interleave, layout.logical_capacity(nz.rows_of(kv_cache), dcp_size, interleave),
        latent_row, latent_col,
        rope_row, rope_col,
        latent.stride(0), latent.stride(1),
        rope.stride(0), rope.stride(1),
        loc.stride(0),
        RANK_DIM=rank_dim, ROPE_DIM=rope_dim,
        BLOCK_R=block_size(rank_dim), BLOCK_P=block_size(rope_dim), NZ_BLOCK=nz_block,
    )
