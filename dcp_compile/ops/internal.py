"""Internal DCP ops that the passes insert. Model code never calls these.

N = dcp_size, r = dcp_rank, I = interleave; layout math lives in runtime/layout.py.

sharded_kv_write(kv_cache (local shard, mutated), latent, rope, loc, r, N, I, rope_cache)
    Like mla_kv_write, but writes only the locations rank r owns, at their local rows.
    The ops that read or write the pool take an optional rope_cache: given, kv_cache is the split
    layout's latent part [rows, R] and rope_cache its rope part [rows, P] (a back end's choice,
    lowering/kv_layout.py); else kv_cache is the packed [rows, R + P].
local_metadata(req_to_token, seq_lens, r, N, I) -> (local_req_to_token, local_seq_lens, local_positions)
    Rank r's local page table (local rows, position order), lengths and global key positions.
mla_partial_attention(q_latent, q_rope, kv_cache, page_table, seq_lens, key_positions,
                      q_seq_ids, q_positions, sm_scale) -> (out [T, H, R], lse [T, H] fp32)
pack_partials(out [T, N*H, R], lse [T, N*H], N) -> [N, T, H, R + w]   (one all-to-all buffer)
merge_partials(packed [N, T, H, R + w], R) -> [T, H, R]               (LSE merge over shards)
guard_batch(req_to_token, seq_lens, q_seq_ids, out_loc, capacity) -> (req_to_token, seq_lens, q_seq_ids, out_loc)
    Always on: page-table entries in use inside the pool, lengths and row ids in range, no padded
    row writing KV; raises on the CPU, masks and sets the device's error flags elsewhere (a side
    effect: registered as one, so dead-code elimination keeps it when its outputs go unused).
check_locations(loc, num_rows, N, I) -> loc copy; raises on a location outside the pool.
    The debug checks (check_*) read the device back to the host, so they check nothing while a
    device graph is being captured; a GraphRunner in debug mode runs check_metadata between
    replays instead.
check_metadata(req_to_token, seq_lens, q_seq_ids, q_positions, out_loc) -> q_positions copy; raises
    on positions inconsistent with the sequence lengths, negative page-table entries, or a row
    of seq_len 0 whose tokens write KV.
gather_local_rows(kv_cache, local_req_to_token, local_seq_lens) -> [B, L, D]   (extend, gather-kv)
gathered_kv_metadata(req_to_token, seq_lens, N, I) -> (page_table [B, N*L], seq_lens, key_positions)
    A page table over the all-gathered rows of every rank, for the gather-kv strategy.
window_attention(out_prefix, lse_prefix, q_latent, q_rope, kv_cache, page_table, seq_lens, key_positions,
                 q_seq_ids, q_positions, sm_scale, window) -> (out, lse)
    Adds each row's keys at or after its first query (the last <= window entries) to a paged
    kernel's unmasked attention over the keys before it (verify under the paged lowerings:
    docs/paged-lowerings.md). window <= WINDOW_QUERIES.
(The NPU back end's own ops, dcp_npu::prefix_key_counts, rank_causal_mask, nz_kv_blocks and
split_partials, are in lowering/npu/ops.py.)
check_host_metadata(block_table, req_to_token, seq_lens, q_seq_ids, q_positions, r, N, I, block_size,
                    host lengths...) -> block_table copy; raises where the host-fed inputs of a paged
    kernel disagree with the batch tensors (debug; a registered side effect).
"""

from __future__ import annotations

import torch
from torch.library import custom_op

from dcp_compile.ops import reference
from dcp_compile.ops import nz
from dcp_compile.runtime import devices


# rope_cache has no default: torch 2.10-2.12's custom_op versions a mutated argument by position,
# and a trailing one left at its default is not passed (an IndexError there).
@custom_op("dcp::sharded_kv_write", mutates_args=("kv_cache", "rope_cache"))
def sharded_kv_write(
    kv_cache: torch.Tensor,
    latent: torch.Tensor,
    rope: torch.Tensor,
    loc: torch.Tensor,
    dcp_rank: int,
    dcp_size: int,
    interleave: int,
    rope_cache: torch.Tensor | None,
) -> None:
    reference.kv_write(kv_cache, latent, rope, loc, dcp_rank, dcp_size, interleave, rope_cache)


@sharded_kv_write.register_fake
def _(kv_cache, latent, rope, loc, dcp_rank, dcp_size, interleave, rope_cache):
    return None


@custom_op("dcp::local_metadata", mutates_args=())
def local_metadata(
    req_to_token: torch.Tensor, seq_lens: torch.Tensor, dcp_rank: int, dcp_size: int, interleave: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return reference.local_metadata(req_to_token, seq_lens, dcp_rank, dcp_size, interleave)


@local_metadata.register_fake
def _(req_to_token, seq_lens, dcp_rank, dcp_size, interleave):
    return req_to_token.new_empty(req_to_token.shape), seq_lens.new_empty(seq_lens.shape), req_to_token.new_empty(req_to_token.shape)


@custom_op("dcp::mla_partial_attention", mutates_args=())
def mla_partial_attention(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    key_positions: torch.Tensor,
    q_seq_ids: torch.Tensor,
    q_positions: torch.Tensor,
    sm_scale: float,
    rope_cache: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return reference.partial_attention(
        q_latent, q_rope, kv_cache, page_table, seq_lens, key_positions, q_seq_ids, q_positions, sm_scale, rope_cache
    )


@mla_partial_attention.register_fake
def _(q_latent, q_rope, kv_cache, page_table, seq_lens, key_positions, q_seq_ids, q_positions, sm_scale,
      rope_cache=None):
    tokens, heads, _ = q_latent.shape
    return q_latent.new_empty(q_latent.shape), q_latent.new_empty((tokens, heads), dtype=torch.float32)


@custom_op("dcp::pack_partials", mutates_args=())
def pack_partials(out: torch.Tensor, lse: torch.Tensor, dcp_size: int) -> torch.Tensor:
    return reference.pack_partials(out, lse, dcp_size)


@pack_partials.register_fake
def _(out, lse, dcp_size):
    tokens, all_heads, rank_dim = out.shape
    if all_heads % dcp_size:
        raise ValueError(f"{all_heads} gathered heads do not split over dcp_size {dcp_size}")
    words = reference.lse_words(out.dtype)
    return out.new_empty((dcp_size, tokens, all_heads // dcp_size, rank_dim + words))


@custom_op("dcp::merge_partials", mutates_args=())
def merge_partials(packed: torch.Tensor, kv_lora_rank: int) -> torch.Tensor:
    return reference.merge_partials(packed, kv_lora_rank)


@merge_partials.register_fake
def _(packed, kv_lora_rank):
    _, tokens, heads, _ = packed.shape
    return packed.new_empty((tokens, heads, kv_lora_rank))


@custom_op("dcp::guard_batch", mutates_args=())
def guard_batch(req_to_token: torch.Tensor, seq_lens: torch.Tensor, q_seq_ids: torch.Tensor, out_loc: torch.Tensor | None,
                capacity: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return reference.guard_batch(req_to_token, seq_lens, q_seq_ids, out_loc, capacity)


@guard_batch.register_fake
def _(req_to_token, seq_lens, q_seq_ids, out_loc, capacity):
    return (req_to_token.new_empty(req_to_token.shape), seq_lens.new_empty(seq_lens.shape), q_seq_ids.new_empty(q_seq_ids.shape),
            q_seq_ids.new_empty(0) if out_loc is None else out_loc.new_empty(out_loc.shape))


torch.fx.node.has_side_effect(torch.ops.dcp.guard_batch.default)


@custom_op("dcp::check_locations", mutates_args=())
def check_locations(loc: torch.Tensor, num_rows: int, dcp_size: int, interleave: int) -> torch.Tensor:
    if not devices.capturing(loc.device):
        reference.check_write_locations(loc, num_rows, dcp_size, interleave)
    return loc.clone()


@check_locations.register_fake
def _(loc, num_rows, dcp_size, interleave):
    return loc.new_empty(loc.shape)


@custom_op("dcp::gather_local_rows", mutates_args=())
def gather_local_rows(kv_cache: torch.Tensor, local_req_to_token: torch.Tensor, local_seq_lens: torch.Tensor,
                      rope_cache: torch.Tensor | None = None) -> torch.Tensor:
    return reference.gather_local_rows(kv_cache, local_req_to_token, local_seq_lens, rope_cache)


@gather_local_rows.register_fake
def _(kv_cache, local_req_to_token, local_seq_lens, rope_cache=None):
    batch, width = local_req_to_token.shape
    row_dim = nz.width_of(kv_cache) + (0 if rope_cache is None else nz.width_of(rope_cache))
    return kv_cache.new_empty((batch, width, row_dim))


@custom_op("dcp::gathered_kv_metadata", mutates_args=())
def gathered_kv_metadata(
    req_to_token: torch.Tensor, seq_lens: torch.Tensor, dcp_size: int, interleave: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return reference.gathered_kv_metadata(req_to_token, seq_lens, dcp_size, interleave)


@gathered_kv_metadata.register_fake
def _(req_to_token, seq_lens, dcp_size, interleave):
    batch, width = req_to_token.shape
    wide = req_to_token.new_empty((batch, dcp_size * width))
    return wide, seq_lens.new_empty(seq_lens.shape), req_to_token.new_empty((batch, dcp_size * width))


@custom_op("dcp::check_metadata", mutates_args=())
def check_metadata(req_to_token: torch.Tensor, seq_lens: torch.Tensor, q_seq_ids: torch.Tensor, q_positions: torch.Tensor,
                   out_loc: torch.Tensor | None = None) -> torch.Tensor:
    if not devices.capturing(req_to_token.device):
        reference.check_attention_metadata(req_to_token, seq_lens, q_seq_ids, q_positions, out_loc)
    return q_positions.clone()


@check_metadata.register_fake
def _(req_to_token, seq_lens, q_seq_ids, q_positions, out_loc=None):
    return q_positions.new_empty(q_positions.shape)


@custom_op("dcp::window_attention", mutates_args=())
def window_attention(
    out_prefix: torch.Tensor,
    lse_prefix: torch.Tensor,
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    key_positions: torch.Tensor,
    q_seq_ids: torch.Tensor,
    q_positions: torch.Tensor,
    sm_scale: float,
    window: int,
    rope_cache: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return reference.window_attention(out_prefix, lse_prefix, q_latent, q_rope, kv_cache, page_table, seq_lens,
                                      key_positions, q_seq_ids, q_positions, sm_scale, window, rope_cache)


@window_attention.register_fake
def _(out_prefix, lse_prefix, q_latent, q_rope, kv_cache, page_table, seq_lens, key_positions, q_seq_ids, q_positions,
      sm_scale, window, rope_cache=None):
    tokens, heads, _ = q_latent.shape
    return q_latent.new_empty(q_latent.shape), q_latent.new_empty((tokens, heads), dtype=torch.float32)


@custom_op("dcp::check_host_metadata", mutates_args=())
def check_host_metadata(
    block_table: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    q_seq_ids: torch.Tensor,
    q_positions: torch.Tensor,
    dcp_rank: int,
    dcp_size: int,
    interleave: int,
    block_size: int,
    host_local_lens: list[int] | None,
    host_prefix_lens: list[int] | None,
    host_cumulative_query_lens: list[int] | None,
) -> torch.Tensor:
    if not devices.capturing(req_to_token.device):
        reference.check_host_metadata(block_table, req_to_token, seq_lens, q_seq_ids, q_positions, dcp_rank, dcp_size,
                                      interleave, block_size, host_local_lens, host_prefix_lens,
                                      host_cumulative_query_lens)
    return block_table.clone()


@check_host_metadata.register_fake
def _(block_table, req_to_token, seq_lens, q_seq_ids, q_positions, dcp_rank, dcp_size, interleave, block_size,
      host_local_lens, host_prefix_lens, host_cumulative_query_lens):
    return block_table.new_empty(block_table.shape)


# A debug check: its copy may go unused (a lowering that reads no block table on the device),
# and the check must still run.
torch.fx.node.has_side_effect(torch.ops.dcp.check_host_metadata.default)
