"""Torch reference kernels: the semantics every other lowering is tested against.

Written for clarity, not speed. They run on any device torch runs on.
"""

from __future__ import annotations

import torch

from dcp_compile.ops import nz
from dcp_compile.runtime import guards, layout


def check_write_locations(loc: torch.Tensor, num_rows: int, dcp_size: int, interleave: int) -> None:
    """Raise if any location falls outside a pool of `num_rows` rows per rank."""
    if loc.numel() == 0:
        return
    capacity = layout.logical_capacity(num_rows, dcp_size, interleave)
    bad = (loc < 0) | (loc >= capacity)
    if bool(bad.any()):
        first = int(loc[bad][0])
        raise IndexError(
            f"KV write location {first} is outside the pool: valid locations are 1..{capacity - 1} "
            f"({num_rows} rows per rank x dcp_size {dcp_size}); location 0 is reserved for padding"
        )


def guard_batch(req_to_token, seq_lens, q_seq_ids, out_loc, capacity: int):
    """The batch metadata attention reads, made safe: every page-table entry in use inside the
    pool [1, capacity), seq_lens inside [0, width], row ids inside [0, rows); and no token of a
    padded row (seq_len 0) writing KV. On the CPU a violation raises at once; on a device it is
    masked (see sanitize_batch) and its device error flag set without a host sync
    (runtime/guards.py). Returns (req_to_token, seq_lens, q_seq_ids, out_loc), out_loc with a
    padded row's tokens writing location 0 (empty where out_loc is None)."""
    table, lens, ids, found = sanitize_batch(req_to_token, seq_lens, q_seq_ids, out_loc, capacity)
    if req_to_token.device.type == "cpu":
        _raise_bad_batch(req_to_token, seq_lens, q_seq_ids, out_loc, capacity, found)
    else:
        flags = guards.error_flags(req_to_token.device)
        for name, bad in found.items():
            flags[guards.INDEX[name]].bitwise_or_(bad.any().to(flags.dtype))
    if out_loc is None:
        return table, lens, ids, q_seq_ids.new_empty(0)
    return table, lens, ids, torch.where(found["padded_row_write"], layout.PADDING_LOC, out_loc)


def sanitize_batch(req_to_token, seq_lens, q_seq_ids, out_loc, capacity: int):
    """(req_to_token, seq_lens, q_seq_ids) with every violation masked, and a bool tensor per
    error kind of runtime.guards marking where it occurred. Masked: a bad page-table entry reads
    location 0 (reserved, inside the pool), lengths clamp to [0, width], row ids to [0, rows)."""
    batch, width = req_to_token.shape
    bad_lens = (seq_lens < 0) | (seq_lens > width)
    lens = seq_lens.clamp(0, width)
    in_use = torch.arange(width, device=req_to_token.device)[None, :] < lens[:, None]
    bad_entries = in_use & ((req_to_token < 1) | (req_to_token >= capacity))
    bad_ids = (q_seq_ids < 0) | (q_seq_ids >= batch)
    ids = q_seq_ids.clamp(0, max(batch - 1, 0))
    padded_writes = torch.zeros_like(bad_ids)
    if out_loc is not None and out_loc.shape == q_seq_ids.shape and batch:
        padded_writes = (lens.index_select(0, ids) == 0) & (out_loc != layout.PADDING_LOC)
    found = {"page_table_entry": bad_entries, "seq_len": bad_lens, "row_id": bad_ids, "padded_row_write": padded_writes}
    return torch.where(bad_entries, layout.PADDING_LOC, req_to_token), lens, ids, found


def _raise_bad_batch(req_to_token, seq_lens, q_seq_ids, out_loc, capacity: int, found: dict) -> None:
    if bool(found["seq_len"].any()):
        row = int(found["seq_len"].nonzero()[0])
        raise ValueError(f"seq_lens[{row}] is {int(seq_lens[row])}: sequence lengths must lie in [0, "
                         f"{req_to_token.shape[1]}] (the page table's width)")
    if bool(found["page_table_entry"].any()):
        row, position = found["page_table_entry"].nonzero()[0].tolist()
        raise IndexError(f"page-table entry [{row}, {position}] is {int(req_to_token[row, position])}, in use by a row of "
                         f"seq_len {int(seq_lens[row])}: locations in use must lie in 1..{capacity - 1} (the pool; "
                         "location 0 is reserved for padding)")
    if bool(found["row_id"].any()):
        token = int(found["row_id"].nonzero()[0])
        raise ValueError(f"q_seq_ids[{token}] is {int(q_seq_ids[token])}: row ids must lie in [0, {req_to_token.shape[0]})")
    if bool(found["padded_row_write"].any()):
        token = int(found["padded_row_write"].nonzero()[0])
        raise ValueError(f"row {int(q_seq_ids[token])} has seq_len 0 (a padded row) but its token {token} writes KV at "
                         f"location {int(out_loc[token])}: a real row's seq_len counts its tokens, this step's included")


def cache_rows(kv_cache, rope_cache, index):
    """Rows [..., R + P] of the cache at `index`: of the packed kv_cache [rows, R + P], or of the
    split layout's latent kv_cache [rows, R] and rope_cache [rows, P] (docs/ascend.md §11.1), each
    [rows, D] or NZ (ops/nz.py)."""
    rows = nz.read_rows(kv_cache, index)
    return rows if rope_cache is None else torch.cat([rows, nz.read_rows(rope_cache, index)], dim=-1)


def kv_write(kv_cache, latent, rope, loc, dcp_rank: int = 0, dcp_size: int = 1, interleave: int = 1,
             rope_cache=None) -> None:
    """Write [latent | rope] for each token whose location this rank owns; skip location 0. With
    rope_cache, kv_cache holds the latent part [rows, R] and rope_cache the rope part [rows, P].

    Every rank checks every location, not only those it owns: a location outside the pool (-1
    would otherwise wrap to the last row) fails the step on all ranks of the group at the same
    point, so none goes on to a collective the others never reach."""
    check_write_locations(loc, nz.rows_of(kv_cache), dcp_size, interleave)
    keep = (loc != layout.PADDING_LOC) & (layout.owner(loc, dcp_size, interleave) == dcp_rank)
    rows = layout.local_row(loc[keep], dcp_size, interleave)
    if rope_cache is None:
        kv_cache[rows] = torch.cat([latent[keep], rope[keep]], dim=-1).to(kv_cache.dtype)
    else:
        nz.write_rows(kv_cache, rows, latent[keep].to(kv_cache.dtype))
        nz.write_rows(rope_cache, rows, rope[keep].to(rope_cache.dtype))


def local_metadata(req_to_token, seq_lens, dcp_rank: int, dcp_size: int, interleave: int):
    """A rank's local view of each request (runtime.layout.local_view, the one place of that math)."""
    return layout.local_view(req_to_token, seq_lens, dcp_rank, dcp_size, interleave)


def partial_attention(q_latent, q_rope, kv_cache, page_table, seq_lens, key_positions, q_seq_ids, q_positions, sm_scale: float,
                      rope_cache=None):
    """Causal MLA attention of each query over its request's rows of `kv_cache` (cache_rows).

    A query at global position p sees keys whose global position is <= p. Returns
    out [T, H, R] in q's dtype and lse [T, H] in fp32 (natural log). A query that sees no key
    gets out = 0 and lse = -inf.
    """
    tokens, heads, rank_dim = q_latent.shape
    out = torch.zeros(tokens, heads, rank_dim, dtype=torch.float32, device=q_latent.device)
    lse = torch.full((tokens, heads), float("-inf"), dtype=torch.float32, device=q_latent.device)
    if tokens == 0:
        return out.to(q_latent.dtype), lse
    for b in torch.unique(q_seq_ids).tolist():
        length = int(seq_lens[b])
        if length == 0:
            continue
        rows = cache_rows(kv_cache, rope_cache, page_table[b, :length].long()).float()
        k_latent, k_rope = rows[:, :rank_dim], rows[:, rank_dim:]
        idx = (q_seq_ids == b).nonzero().squeeze(1)
        scores = torch.einsum("thr,lr->thl", q_latent[idx].float(), k_latent)
        scores += torch.einsum("thp,lp->thl", q_rope[idx].float(), k_rope)
        scores *= sm_scale
        visible = key_positions[b, :length][None, :] <= q_positions[idx][:, None]
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        row_lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - torch.where(torch.isinf(row_lse), 0.0, row_lse)[..., None])
        out[idx] = torch.einsum("thl,lr->thr", probs, k_latent)
        lse[idx] = row_lse
    return out.to(q_latent.dtype), lse


def global_positions(req_to_token):
    """Key positions for a global (unsharded) page table: column index."""
    batch, width = req_to_token.shape
    return torch.arange(width, device=req_to_token.device).expand(batch, width)


def lse_words(dtype: torch.dtype) -> int:
    """How many elements of `dtype` hold one fp32 LSE in a packed buffer."""
    size = torch.empty((), dtype=dtype).element_size()
    if 4 % size:
        raise TypeError(f"cannot pack an fp32 LSE into {dtype}")
    return 4 // size


def pack_partials(out, lse, dcp_size: int):
    """[T, N*H, R] out + [T, N*H] lse -> one [N, T, H, R + w] buffer, slice j for DCP peer j.

    Heads are gathered in peer order, so peer j owns heads [j*H, (j+1)*H). The fp32 LSE is stored
    bit-for-bit in the trailing w = 4 / itemsize elements. Empty-shard rows get out = 0.
    """
    tokens, all_heads, rank_dim = out.shape
    heads = all_heads // dcp_size
    out = torch.where(torch.isinf(lse)[..., None], 0, out)
    out = out.view(tokens, dcp_size, heads, rank_dim).transpose(0, 1)
    lse_bits = lse.float().view(tokens, dcp_size, heads, 1).transpose(0, 1).contiguous().view(out.dtype)
    return torch.cat([out, lse_bits], dim=-1).contiguous()


def unpack_partials(packed, kv_lora_rank: int):
    out = packed[..., :kv_lora_rank]
    lse = packed[..., kv_lora_rank:].contiguous().view(torch.float32).squeeze(-1)
    return out, lse


def merge_lse(outs, lses):
    """LSE-weighted merge over the leading (shard) axis. Returns (out, lse).

    The shift m treats -inf as 0, a zero weight contributes nothing (so a NaN in an empty
    shard's output cannot leak) and a row whose every shard is empty gives out = 0.
    """
    lses = lses.float()
    shift = lses.max(dim=0).values
    shift = torch.where(torch.isinf(shift), 0.0, shift)
    weights = torch.exp(lses - shift)
    terms = torch.where(weights[..., None] > 0, weights[..., None] * outs.float(), 0.0)
    total = weights.sum(dim=0)
    merged = torch.where(total[..., None] > 0, terms.sum(dim=0) / total[..., None].clamp_min(1e-30), 0.0)
    return merged.to(outs.dtype), shift + torch.log(total)


def merge_partials(packed, kv_lora_rank: int):
    outs, lses = unpack_partials(packed, kv_lora_rank)
    return merge_lse(outs, lses)[0]


NEVER_VISIBLE = torch.iinfo(torch.int32).max
"""Key position given to padding entries so that no query's causal mask admits them."""


def gather_local_rows(kv_cache, local_req_to_token, local_seq_lens, rope_cache=None):
    """This rank's cache rows for the batch, compacted to [B, L, D]; zeros past each local length."""
    width = local_req_to_token.shape[1]
    valid = torch.arange(width, device=kv_cache.device)[None, :] < local_seq_lens[:, None]
    rows = cache_rows(kv_cache, rope_cache, local_req_to_token.long())
    return torch.where(valid[..., None], rows, torch.zeros((), dtype=kv_cache.dtype))


def gathered_kv_metadata(req_to_token, seq_lens, dcp_size: int, interleave: int):
    """Page table over the all-gathered [N * B * L, D] rows of every rank's gather_local_rows.

    Returns (page_table [B, N*L], seq_lens [B], key_positions [B, N*L]): request b's keys from
    every shard, compacted to the front; the first seq_lens[b] entries are valid.
    """
    batch, width = req_to_token.shape
    device = req_to_token.device
    column = torch.arange(width, device=device)
    pages, positions, valid = [], [], []
    for rank in range(dcp_size):
        _, lens, pos = local_metadata(req_to_token, seq_lens, rank, dcp_size, interleave)
        base = (rank * batch + torch.arange(batch, device=device))[:, None] * width
        pages.append(base + column[None, :])
        positions.append(pos)
        valid.append(column[None, :] < lens[:, None])
    valid = torch.cat(valid, dim=1)
    order = torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices
    kept = torch.gather(valid, 1, order)
    page_table = torch.where(kept, torch.gather(torch.cat(pages, dim=1), 1, order), 0)
    key_positions = torch.where(kept, torch.gather(torch.cat(positions, dim=1), 1, order), NEVER_VISIBLE)
    return page_table.to(req_to_token.dtype), kept.sum(dim=1).to(seq_lens.dtype), key_positions.to(req_to_token.dtype)


def check_attention_metadata(req_to_token, seq_lens, q_seq_ids, q_positions, out_loc=None) -> None:
    """Raise if the query metadata contradicts the sequence lengths or the page table."""
    batch, width = req_to_token.shape
    if seq_lens.shape != (batch,):
        raise ValueError(f"seq_lens has shape {tuple(seq_lens.shape)}, expected ({batch},) to match req_to_token")
    if bool((seq_lens < 0).any()) or bool((seq_lens > width).any()):
        raise ValueError(f"seq_lens must lie in [0, {width}] (the page table's width), got {seq_lens.tolist()}")
    in_use = torch.arange(width, device=req_to_token.device)[None, :] < seq_lens[:, None]
    if bool((in_use & (req_to_token < 0)).any()):
        row, position = (in_use & (req_to_token < 0)).nonzero()[0].tolist()
        raise ValueError(f"page-table entry [{row}, {position}] is {int(req_to_token[row, position])}: locations are >= 0")
    if q_seq_ids.numel() == 0:
        return
    if bool((q_seq_ids < 0).any()) or bool((q_seq_ids >= batch).any()):
        raise ValueError(f"q_seq_ids must lie in [0, {batch}), got {q_seq_ids.tolist()}")
    if out_loc is not None and out_loc.shape == q_seq_ids.shape:
        writes_kv = (seq_lens[q_seq_ids] == 0) & (out_loc != layout.PADDING_LOC)
        if bool(writes_kv.any()):
            t = int(writes_kv.nonzero()[0])
            raise ValueError(
                f"row {int(q_seq_ids[t])} has seq_len 0 (a padded row) but its token {t} writes KV at location "
                f"{int(out_loc[t])}: a real row's seq_len counts its tokens, this step's included"
            )
    lens = seq_lens[q_seq_ids]
    bad = (lens > 0) & ((q_positions < 0) | (q_positions >= lens))
    if bool(bad.any()):
        t = int(bad.nonzero()[0])
        raise ValueError(
            f"query token {t} of request {int(q_seq_ids[t])} sits at position {int(q_positions[t])}, "
            f"but that request has seq_len {int(lens[t])}: positions must lie in [0, seq_len)"
        )


def first_query_positions(q_seq_ids, q_positions, rows: int):
    """Each row's smallest query position; NEVER_VISIBLE for a row without queries.

    A masked minimum over [rows, tokens], in any token order, with no scatter: torch_npu runs an
    int64 `scatter_reduce(..., "amin")` on the host (docs/ascend.md §16)."""
    row_ids = torch.arange(rows, dtype=q_seq_ids.dtype, device=q_seq_ids.device)
    mine = q_seq_ids[None, :] == row_ids[:, None]
    never = torch.full((), NEVER_VISIBLE, dtype=q_positions.dtype, device=q_positions.device)
    return torch.where(mine, q_positions[None, :], never).amin(dim=1) if q_seq_ids.numel() else never.expand(rows).clone()


def window_attention(out_prefix, lse_prefix, q_latent, q_rope, kv_cache, page_table, seq_lens, key_positions,
                     q_seq_ids, q_positions, sm_scale: float, window: int, rope_cache=None):
    """Complete attention over a row's keys before its first query (out_prefix, lse_prefix, from
    a paged kernel without a mask) with the row's keys at or after that position, merged by LSE.

    Those keys are the last <= `window` entries of the row's (local) page table, since a row
    holds at most `window` queries at the positions ending its sequence; each query sees those
    at or before its own position. Static shapes, no host sync: O(T x window) keys are read.
    Returns (out [T, H, R] in q's dtype, lse [T, H] fp32).
    """
    tokens, heads, rank_dim = q_latent.shape
    width = page_table.shape[1]
    offsets = torch.arange(window, device=q_latent.device) - window
    columns = seq_lens.index_select(0, q_seq_ids)[:, None].to(offsets.dtype) + offsets[None, :]
    in_table = columns >= 0
    flat = q_seq_ids[:, None] * width + columns.clamp(0, width - 1)
    rows = page_table.reshape(-1)[flat]
    positions = key_positions.reshape(-1)[flat]
    first = first_query_positions(q_seq_ids, q_positions, seq_lens.shape[0]).index_select(0, q_seq_ids)
    visible = in_table & (positions >= first[:, None]) & (positions <= q_positions[:, None])
    keys = cache_rows(kv_cache, rope_cache, rows.long()).float()
    scores = torch.einsum("thr,twr->thw", q_latent.float(), keys[..., :rank_dim])
    scores = (scores + torch.einsum("thp,twp->thw", q_rope.float(), keys[..., rank_dim:])) * sm_scale
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    out = torch.einsum("thw,twr->thr", probs, keys[..., :rank_dim])
    merged, merged_lse = merge_lse(torch.stack([out_prefix.float(), out]), torch.stack([lse_prefix.float(), lse]))
    return merged.to(q_latent.dtype), merged_lse


def check_host_metadata(block_table, req_to_token, seq_lens, q_seq_ids, q_positions, dcp_rank: int, dcp_size: int,
                        interleave: int, block_size: int, host_local_lens, host_prefix_lens, host_cumulative_query_lens) -> None:
    """Raise if the host-side metadata a paged kernel is given disagrees with the device tensors
    (a stale host length after a rejected draft, a block table of another step)."""
    batch, _ = req_to_token.shape
    rows, lens, positions = local_metadata(req_to_token, seq_lens, dcp_rank, dcp_size, interleave)
    if host_local_lens is not None and lens.tolist() != list(host_local_lens):
        raise ValueError(f"stale host metadata on DCP rank {dcp_rank}: local lengths {list(host_local_lens)} on the host, "
                         f"{lens.tolist()} from the batch tensors")
    if host_cumulative_query_lens is not None:
        counts = torch.diff(torch.tensor([0] + list(host_cumulative_query_lens)))
        expected = torch.repeat_interleave(torch.arange(batch), counts).to(q_seq_ids.device)
        if expected.shape != q_seq_ids.shape or not torch.equal(expected, q_seq_ids.to(expected.dtype)):
            raise ValueError(f"host query lengths {counts.tolist()} do not match q_seq_ids (tokens grouped by row, in row order)")
    if host_prefix_lens is not None:
        first = first_query_positions(q_seq_ids, q_positions, batch)
        width = rows.shape[1]
        valid = torch.arange(width, device=rows.device)[None, :] < lens[:, None]
        prefix = (valid & (positions < first[:, None])).sum(dim=1)
        if prefix.tolist() != list(host_prefix_lens):
            raise ValueError(f"stale host metadata on DCP rank {dcp_rank}: keys before the first query {list(host_prefix_lens)} "
                             f"on the host, {prefix.tolist()} from the batch tensors")
    column = torch.arange(rows.shape[1], device=rows.device)
    valid = column[None, :] < lens[:, None]
    block_index = (column // block_size).clamp(max=block_table.shape[1] - 1)
    expected = block_table.long()[:, block_index] * block_size + column % block_size
    if bool((valid & (expected != rows)).any()):
        raise ValueError(f"the host block table of DCP rank {dcp_rank} does not address this batch's local rows")
