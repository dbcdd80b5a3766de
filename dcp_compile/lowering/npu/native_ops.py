"""The NPU back end's native ops (`dcp_npu::`, npu_kernels='native'): what the Triton kernels do
on an NPU, written as aten ops that torch_npu runs on the device (op-plugin's table, with no CPU
fallback: docs/ascend.md §16), so that an NPU graph needs no triton-ascend. Each has a fake.

- `scatter_kv_cache`: the KV write, torch_npu.npu_scatter_pa_kv_cache over a layer's two parts, in
  calls of at most the cache's slots each (the A2/A3 tiling refuses more tokens than that);
- `slot_mapping`: each token's int32 slot on this rank: its local row, or the reserved row where
  another rank owns it (or it pads): never a negative slot, which the op's contract excludes
  (docs/ascend.md §17);
- `guard_tokens`: the batch guard without the page table (a native graph reads the KV through
  the host-fed block table, which the host checks, never through req_to_token);
- `step_key_counts`: per query token, the local keys it sees among the row's keys before the step
  (host-fed) and this step's tokens this rank owns;
- `step_causal_mask`: the masked verify's rank-local causal mask from those counts;
- `step_window`: window attention over this step's tokens this rank owns, merged with the
  prefix kernel's result: the keys at or after a row's first query are exactly this step's
  tokens (the lowering's assumption, docs/paged-lowerings.md), so no page table is read;
- `partial_attention`: attention over gathered rows for chunks longer than FIA's 16 queries a
  row, dense over each row's keys (static shapes, no host sync; memory O(T x keys)).

Why not the torch reference (ops/reference.py): its KV write and attention index with boolean
masks and loop over rows on the host, a host sync each (data-dependent shapes).
"""

from __future__ import annotations

import torch
from torch.library import custom_op

from dcp_compile.ops import nz
from dcp_compile.ops.reference import cache_rows, check_write_locations, merge_lse
from dcp_compile.runtime import guards, layout

SLOT_DTYPE = torch.int32
"""The slots' dtype, as the engines pass them: the 2025 A2/A3 ND kernel of npu_scatter_pa_kv_cache
reads slot_mapping as int32 whatever its dtype (docs/ascend.md §17)."""


def _flag(device: torch.device, name: str, bad: torch.Tensor) -> None:
    flags = guards.error_flags(device)
    flags[guards.INDEX[name]].bitwise_or_(bad.any().to(flags.dtype))


def slot_mapping(loc, num_rows: int, dcp_rank: int, dcp_size: int, interleave: int):
    """Each token's int32 slot on this rank, of a cache of `num_rows` locations' rows and the
    reserved block past them (lowering/npu/kv_layout.py): the local row of its location where this
    rank keeps it; `num_rows`, the reserved block's first row, which no location maps to and no read
    sees, where another rank owns it, where it is location 0 (padding), or where it lies outside the
    pool (on a device: with the write_location flag set; on the CPU: an IndexError). Slots below
    `num_rows` are exactly this rank's own tokens."""
    capacity = layout.logical_capacity(num_rows, dcp_size, interleave)
    in_pool = (loc >= 0) & (loc < capacity)
    if loc.device.type == "cpu":
        check_write_locations(loc, num_rows, dcp_size, interleave)
    else:
        _flag(loc.device, "write_location", ~in_pool)
    keep = in_pool & (loc != layout.PADDING_LOC) & (layout.owner(loc, dcp_size, interleave) == dcp_rank)
    return torch.where(keep, layout.local_row(loc, dcp_size, interleave), num_rows).to(SLOT_DTYPE)


def guard_tokens(seq_lens, q_seq_ids, out_loc, width: int):
    """guard_batch's checks of the rows and tokens (reference.guard_batch), the page table's left to
    the host: (seq_lens in [0, width], q_seq_ids in [0, rows), out_loc with a padded row's tokens
    writing location 0)."""
    rows = seq_lens.shape[0]
    bad_lens = (seq_lens < 0) | (seq_lens > width)
    lens = seq_lens.clamp(0, width)
    bad_ids = (q_seq_ids < 0) | (q_seq_ids >= rows)
    ids = q_seq_ids.clamp(0, max(rows - 1, 0))
    padded = (lens.index_select(0, ids) == 0) & (out_loc != layout.PADDING_LOC) if rows else torch.zeros_like(bad_ids)
    if seq_lens.device.type == "cpu":
        for bad, error, what in ((bad_lens, ValueError, f"seq_lens must lie in [0, {width}]"),
                                 (bad_ids, ValueError, f"q_seq_ids must lie in [0, {rows})"),
                                 (padded, ValueError, "a row of seq_len 0 (a padded row) has a token writing KV")):
            if bool(bad.any()):
                raise error(f"bad batch input: {what}")
    else:
        for name, bad in (("seq_len", bad_lens), ("row_id", bad_ids), ("padded_row_write", padded)):
            _flag(seq_lens.device, name, bad)
    return lens, ids, torch.where(padded, layout.PADDING_LOC, out_loc)


def _candidates(q_seq_ids, q_positions, slots, num_rows: int, window: int):
    """[T, window] indices of the tokens up to `window` back from each token (itself last), and
    which of them are this rank's keys the token sees: same group (q_seq_ids: its row, or its
    piece of a row), at or before its position, owned (slot below `num_rows`: slot_mapping)."""
    tokens = q_seq_ids.shape[0]
    offsets = torch.arange(window, device=q_seq_ids.device) - (window - 1)
    candidates = torch.arange(tokens, device=q_seq_ids.device)[:, None] + offsets[None, :]
    inside = candidates >= 0
    index = candidates.clamp(min=0)
    flat = index.reshape(-1)
    seen = (inside & (q_seq_ids.index_select(0, flat).view(tokens, window) == q_seq_ids[:, None])
            & (q_positions.index_select(0, flat).view(tokens, window) <= q_positions[:, None])
            & (slots.index_select(0, flat).view(tokens, window) < num_rows))
    return index, seen


def step_key_counts(prefix_lens, slots, num_rows: int, q_seq_ids, q_positions, window: int):
    """Per query token: its row's local keys before the step (prefix_lens, host-fed) plus this
    step's tokens of its row, at or before it, that this rank owns (up to `window` back; `slots`
    and `num_rows` as slot_mapping gives and takes them)."""
    _, seen = _candidates(q_seq_ids, q_positions, slots, num_rows, window)
    return prefix_lens.index_select(0, q_seq_ids).to(torch.int64) + seen.sum(dim=1)


def step_causal_mask(counts, rows: int, width: int):
    """(mask [B, 1, S, width] bool, True = masked): query s of row b sees the row's first counts[t]
    local keys (in position order), t = b * S + s; rows of S = T / B queries each."""
    tokens = counts.shape[0]
    if rows == 0 or tokens % rows:
        raise ValueError(f"step_causal_mask serves rows of equal query counts: {tokens} tokens over {rows} rows")
    visible = counts.view(rows, tokens // rows)
    key_index = torch.arange(width, device=counts.device)
    return (key_index[None, None, :] >= visible[:, :, None]).unsqueeze(1)


def step_window(out_prefix, lse_prefix, q_latent, q_rope, latent, rope, slots, num_rows: int, q_seq_ids, q_positions,
                sm_scale: float, window: int):
    """reference.window_attention over this step's own tokens instead of the page table: latent
    [T, R] and rope [T, P] are the tokens' KV as the cache holds it (its dtype). q_seq_ids groups
    the tokens: a token sees the owned tokens (slot below `num_rows`) of its group up to itself (its
    row's, or those of its piece of <= `window` queries, whose earlier keys the prefix kernel saw)."""
    tokens, heads, rank_dim = q_latent.shape
    index, seen = _candidates(q_seq_ids, q_positions, slots, num_rows, window)
    flat = index.reshape(-1)
    keys_latent = latent.index_select(0, flat).view(tokens, window, rank_dim).float()
    keys_rope = rope.index_select(0, flat).view(tokens, window, rope.shape[-1]).float()
    scores = torch.einsum("thr,twr->thw", q_latent.float(), keys_latent)
    scores = (scores + torch.einsum("thp,twp->thw", q_rope.float(), keys_rope)) * sm_scale
    scores = scores.masked_fill(~seen[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    out = torch.einsum("thw,twr->thr", probs, keys_latent)
    merged, merged_lse = merge_lse(torch.stack([out_prefix.float(), out]), torch.stack([lse_prefix.float(), lse]))
    return merged.to(q_latent.dtype), merged_lse


def partial_attention(q_latent, q_rope, kv_cache, page_table, seq_lens, key_positions, q_seq_ids, q_positions,
                      sm_scale: float, rope_cache=None):
    """reference.partial_attention with static shapes: every query against its row's page-table
    entries, masked by length and position."""
    tokens, heads, rank_dim = q_latent.shape
    width = page_table.shape[1]
    rows = cache_rows(kv_cache, rope_cache, page_table.long().clamp(min=0)).index_select(0, q_seq_ids).float()
    valid = (torch.arange(width, device=q_latent.device)[None, :] < seq_lens.index_select(0, q_seq_ids)[:, None])
    visible = valid & (key_positions.index_select(0, q_seq_ids) <= q_positions[:, None])
    scores = torch.einsum("thr,tlr->thl", q_latent.float(), rows[..., :rank_dim])
    scores = (scores + torch.einsum("thp,tlp->thl", q_rope.float(), rows[..., rank_dim:])) * sm_scale
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    out = torch.einsum("thl,tlr->thr", probs, rows[..., :rank_dim])
    return out.to(q_latent.dtype), lse


def scatter_kv_cache(kv_cache, latent, rope, slots, block: int, rope_cache=None) -> None:
    """torch_npu.npu_scatter_pa_kv_cache over a layer's two cache parts (the split layout: kv_cache
    the latent rows, rope_cache the rope rows, each with the reserved block past the locations'
    rows; [rows, D] each, or NZ [blocks, 1, D/16, block, 16]), as its 4-D caches: ND
    [blocks, block, 1, D] ('Norm'), NZ [blocks, D/16, block, 16] ('PA_NZ'). latent [T, R] and rope
    [T, P] in the cache's dtype, contiguous; slots int32 in [0, blocks x block) (slot_mapping).

    The A2/A3 tiling refuses a call of more tokens than blocks x block ("numBlocks * blockSize should
    larger than numTokens", docs/ascend.md §17): a step of more tokens (a long chunk on a small
    shard) is written in calls of at most that many, static slices of its tokens (no host sync: a
    replayed graph holds each call)."""
    if rope_cache is None:
        raise ValueError("dcp_npu.scatter_kv_cache writes the split KV layout (kv_cache and rope_cache)")
    tokens = slots.shape[0]
    caches = []
    for part in (kv_cache, rope_cache):
        if nz.is_nz(part):
            caches.append(part.view(part.shape[0], part.shape[2], part.shape[3], part.shape[4]))
        else:
            caches.append(part.view(part.shape[0] // block, block, 1, part.shape[1]))
    keys, values = latent.view(tokens, 1, latent.shape[-1]), rope.view(tokens, 1, rope.shape[-1])
    per_call = caches[0].shape[0] * block
    for start in range(0, tokens, per_call):
        end = min(start + per_call, tokens)
        torch.ops.npu.npu_scatter_pa_kv_cache(keys[start:end], values[start:end], *caches, slots[start:end],
                                              cache_mode="PA_NZ" if nz.is_nz(kv_cache) else "Norm")


@custom_op("dcp_npu::scatter_kv_cache", mutates_args=("kv_cache", "rope_cache"))
def scatter_kv_cache_op(kv_cache: torch.Tensor, latent: torch.Tensor, rope: torch.Tensor, slots: torch.Tensor,
                        block: int, rope_cache: torch.Tensor | None) -> None:
    scatter_kv_cache(kv_cache, latent, rope, slots, block, rope_cache)


@scatter_kv_cache_op.register_fake
def _(kv_cache, latent, rope, slots, block, rope_cache):
    return None


@custom_op("dcp_npu::slot_mapping", mutates_args=())
def slot_mapping_op(loc: torch.Tensor, num_rows: int, dcp_rank: int, dcp_size: int, interleave: int) -> torch.Tensor:
    return slot_mapping(loc, num_rows, dcp_rank, dcp_size, interleave)


@slot_mapping_op.register_fake
def _(loc, num_rows, dcp_rank, dcp_size, interleave):
    return torch.empty_like(loc, dtype=SLOT_DTYPE)


@custom_op("dcp_npu::guard_tokens", mutates_args=())
def guard_tokens_op(seq_lens: torch.Tensor, q_seq_ids: torch.Tensor, out_loc: torch.Tensor,
                    width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return guard_tokens(seq_lens, q_seq_ids, out_loc, width)


@guard_tokens_op.register_fake
def _(seq_lens, q_seq_ids, out_loc, width):
    return torch.empty_like(seq_lens), torch.empty_like(q_seq_ids), torch.empty_like(out_loc)


@custom_op("dcp_npu::step_key_counts", mutates_args=())
def step_key_counts_op(prefix_lens: torch.Tensor, slots: torch.Tensor, num_rows: int, q_seq_ids: torch.Tensor,
                       q_positions: torch.Tensor, window: int) -> torch.Tensor:
    return step_key_counts(prefix_lens, slots, num_rows, q_seq_ids, q_positions, window)


@step_key_counts_op.register_fake
def _(prefix_lens, slots, num_rows, q_seq_ids, q_positions, window):
    return q_seq_ids.new_empty(q_seq_ids.shape, dtype=torch.int64)


@custom_op("dcp_npu::step_causal_mask", mutates_args=())
def step_causal_mask_op(counts: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    return step_causal_mask(counts, rows, width)


@step_causal_mask_op.register_fake
def _(counts, rows, width):
    tokens = counts.shape[0]
    if rows == 0 or tokens % rows:
        raise ValueError(f"step_causal_mask serves rows of equal query counts: {tokens} tokens over {rows} rows")
    return counts.new_empty((rows, 1, tokens // rows, width), dtype=torch.bool)


@custom_op("dcp_npu::step_window", mutates_args=())
def step_window_op(out_prefix: torch.Tensor, lse_prefix: torch.Tensor, q_latent: torch.Tensor, q_rope: torch.Tensor,
                   latent: torch.Tensor, rope: torch.Tensor, slots: torch.Tensor, num_rows: int, q_seq_ids: torch.Tensor,
                   q_positions: torch.Tensor, sm_scale: float, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    return step_window(out_prefix, lse_prefix, q_latent, q_rope, latent, rope, slots, num_rows, q_seq_ids, q_positions,
                       sm_scale, window)


@step_window_op.register_fake
def _(out_prefix, lse_prefix, q_latent, q_rope, latent, rope, slots, num_rows, q_seq_ids, q_positions, sm_scale,
      window):
    return torch.empty_like(q_latent), lse_prefix.new_empty(lse_prefix.shape, dtype=torch.float32)


@custom_op("dcp_npu::partial_attention", mutates_args=())
def partial_attention_op(q_latent: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor,
                         page_table: torch.Tensor, seq_lens: torch.Tensor, key_positions: torch.Tensor,
                         q_seq_ids: torch.Tensor, q_positions: torch.Tensor, sm_scale: float,
                         rope_cache: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    return partial_attention(q_latent, q_rope, kv_cache, page_table, seq_lens, key_positions, q_seq_ids, q_positions,
                             sm_scale, rope_cache)


@partial_attention_op.register_fake
def _(q_latent, q_rope, kv_cache, page_table, seq_lens, key_positions, q_seq_ids, q_positions, sm_scale,
      rope_cache=None):
    tokens, heads, _ = q_latent.shape
    return torch.empty_like(q_latent), q_latent.new_empty((tokens, heads), dtype=torch.float32)


SCATTER_KV_CACHE = torch.ops.dcp_npu.scatter_kv_cache.default
SLOT_MAPPING = torch.ops.dcp_npu.slot_mapping.default
GUARD_TOKENS = torch.ops.dcp_npu.guard_tokens.default
STEP_KEY_COUNTS = torch.ops.dcp_npu.step_key_counts.default
STEP_CAUSAL_MASK = torch.ops.dcp_npu.step_causal_mask.default
STEP_WINDOW = torch.ops.dcp_npu.step_window.default
PARTIAL_ATTENTION = torch.ops.dcp_npu.partial_attention.default
