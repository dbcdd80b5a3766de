"""The NPU back end's own ops (`dcp_npu::`), each with its torch reference and a fake: the graph
pieces its lowering inserts around FIA and npu_attention_update. They run on the device as
aten ops (the emulated one included); docs/ascend.md cites the facts they serve.

- `prefix_key_counts`: per query token, the keys FIA attended over for it (to mask the rows FIA
  saw empty, whatever it returned for them);
- `rank_causal_mask`: the rank-local causal mask of the masked verify (npu_verify='mask');
- `nz_kv_blocks`: a packed cache's two parts in the NZ layout (the lowering's view of the cache,
  which the split_kv_cache pass replaces by the pool's NZ tensors);
- `split_partials`: the exchanged partials as npu_attention_update's inputs;
- `all_to_all`: the exchange of equal slices with no split lists, which ProcessGroupHCCL runs as
  HcclAlltoAll; explicit splits (the functional collective always passes them) take its AlltoAllV
  path (torch_npu ProcessGroupHCCL.cpp alltoall_base, docs/ascend.md §17, §19), which no engine's
  DCP uses. vllm-ascend calls dist.all_to_all_single without splits, as this does.
"""

from __future__ import annotations

import torch
from torch.library import custom_op

from dcp_compile.ops import nz
from dcp_compile.ops.reference import first_query_positions, unpack_partials


def prefix_key_counts(local_lens, key_positions, q_seq_ids, q_positions, whole_rows: bool):
    """Per query token, the keys a paged prefix kernel attends over for it (docs/paged-lowerings.md):
    every local key of its row (`whole_rows`, decode), else the local keys before its row's first
    query. From the batch's device tensors, so a lowering can mask the rows a kernel saw empty
    whatever the kernel returned for them. key_positions None: a key's position is its column."""
    if whole_rows:
        return local_lens.index_select(0, q_seq_ids)
    rows = local_lens.shape[0]
    if key_positions is None:
        raise ValueError("prefix_key_counts needs key positions unless whole_rows")
    width = key_positions.shape[1]
    valid = torch.arange(width, device=local_lens.device)[None, :] < local_lens[:, None]
    first = first_query_positions(q_seq_ids, q_positions, rows)
    before = valid & (key_positions < first[:, None].to(key_positions.dtype))
    return before.sum(dim=1).to(local_lens.dtype).index_select(0, q_seq_ids)


def rank_causal_mask(key_positions, local_lens, q_positions, width: int):
    """(mask [B, 1, S, width] bool, True = masked; visible [T]): query t of row b = t // S sees the
    row's first visible[t] local keys (those at or before its position; the local keys are in
    position order), and no column past them, so a row is at least one column wide whatever its
    lengths. Tokens are grouped by row, S = T / B each."""
    rows, tokens = local_lens.shape[0], q_positions.shape[0]
    if rows == 0 or tokens % rows:
        raise ValueError(f"rank_causal_mask serves rows of equal query counts: {tokens} tokens over {rows} rows")
    per_row = tokens // rows
    columns = key_positions.shape[1]
    stored = torch.arange(columns, device=key_positions.device)[None, :] < local_lens[:, None].long()
    positions = torch.where(stored, key_positions.long(), torch.iinfo(torch.int64).max)
    visible = torch.searchsorted(positions, q_positions.long().reshape(rows, per_row), right=True)
    key_index = torch.arange(width, device=key_positions.device)
    mask = key_index[None, None, :] >= visible[:, :, None]
    return mask.unsqueeze(1), visible.reshape(tokens)


def split_partials(packed, kv_lora_rank: int):
    """The exchanged [N, T, H, R + w] buffer as the inputs of Ascend's npu_attention_update:
    outs [N, T*H, R] and fp32 lses [N, T*H].

    npu_attention_update is undefined (NaN) where every shard is empty (docs/ascend.md §7.4): there
    shard 0's LSE is set to 0, so that row's result is shard 0's output, which pack_partials
    zeroed for an empty shard.
    """
    shards, tokens, heads, _ = packed.shape
    outs, lses = unpack_partials(packed, kv_lora_rank)
    all_empty = torch.isinf(lses).all(dim=0)  # +inf is FIA's empty shard, -inf ours
    lses = torch.cat([torch.where(all_empty, 0.0, lses[0])[None], lses[1:]])
    return outs.reshape(shards, tokens * heads, kv_lora_rank).contiguous(), lses.reshape(shards, tokens * heads)


@custom_op("dcp_npu::prefix_key_counts", mutates_args=())
def prefix_key_counts_op(local_lens: torch.Tensor, key_positions: torch.Tensor | None, q_seq_ids: torch.Tensor,
                         q_positions: torch.Tensor, whole_rows: bool) -> torch.Tensor:
    return prefix_key_counts(local_lens, key_positions, q_seq_ids, q_positions, whole_rows)


@prefix_key_counts_op.register_fake
def _(local_lens, key_positions, q_seq_ids, q_positions, whole_rows):
    return local_lens.new_empty(q_seq_ids.shape)


@custom_op("dcp_npu::rank_causal_mask", mutates_args=())
def rank_causal_mask_op(key_positions: torch.Tensor, local_lens: torch.Tensor, q_positions: torch.Tensor,
                        width: int) -> tuple[torch.Tensor, torch.Tensor]:
    return rank_causal_mask(key_positions, local_lens, q_positions, width)


@rank_causal_mask_op.register_fake
def _(key_positions, local_lens, q_positions, width):
    rows, tokens = local_lens.shape[0], q_positions.shape[0]
    if rows == 0 or tokens % rows:
        raise ValueError(f"rank_causal_mask serves rows of equal query counts: {tokens} tokens over {rows} rows")
    return (q_positions.new_empty((rows, 1, tokens // rows, width), dtype=torch.bool),
            q_positions.new_empty((tokens,), dtype=torch.int64))


@custom_op("dcp_npu::nz_kv_blocks", mutates_args=())
def nz_kv_blocks(kv_cache: torch.Tensor, kv_lora_rank: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (nz.from_rows(kv_cache[:, :kv_lora_rank], block), nz.from_rows(kv_cache[:, kv_lora_rank:], block))


@nz_kv_blocks.register_fake
def _(kv_cache, kv_lora_rank, block):
    rows, row_dim = kv_cache.shape
    return (kv_cache.new_empty(nz.shape(rows, kv_lora_rank, block)),
            kv_cache.new_empty(nz.shape(rows, row_dim - kv_lora_rank, block)))


@custom_op("dcp_npu::split_partials", mutates_args=())
def split_partials_op(packed: torch.Tensor, kv_lora_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    return split_partials(packed, kv_lora_rank)


@split_partials_op.register_fake
def _(packed, kv_lora_rank):
    shards, tokens, heads, _ = packed.shape
    return (packed.new_empty((shards, tokens * heads, kv_lora_rank)),
            packed.new_empty((shards, tokens * heads), dtype=torch.float32))


@custom_op("dcp_npu::all_to_all", mutates_args=())
def all_to_all(packed: torch.Tensor, group_name: str) -> torch.Tensor:
    exchanged = torch.empty_like(packed)
    group = torch.distributed.distributed_c10d._resolve_process_group(group_name)
    torch.distributed.all_to_all_single(exchanged, packed, group=group)  # no split lists: equal slices
    return exchanged


@all_to_all.register_fake
def _(packed, group_name):
    return torch.empty_like(packed)


ALL_TO_ALL = torch.ops.dcp_npu.all_to_all.default
PREFIX_KEY_COUNTS = torch.ops.dcp_npu.prefix_key_counts.default
RANK_CAUSAL_MASK = torch.ops.dcp_npu.rank_causal_mask.default
NZ_KV_BLOCKS = torch.ops.dcp_npu.nz_kv_blocks.default
SPLIT_PARTIALS = torch.ops.dcp_npu.split_partials.default
