"""Random MLA inputs with mixed lengths, empty shards and padded rows, and a naive oracle."""

from __future__ import annotations

import torch

from dcp_compile.ops import reference


def random_batch(lengths, queries_per_request, heads=4, rank_dim=16, rope_dim=8, capacity=None, seed=0, width=None, dtype=torch.float32):
    """Requests with `lengths` tokens (0 = padded row) and their last `q` tokens as queries.

    Locations are a random permutation of 1..capacity-1, so owners are mixed across requests.
    """
    gen = torch.Generator().manual_seed(seed)
    width = width or max(max(lengths), 1)
    total = sum(lengths)
    capacity = capacity or total + 8
    perm = torch.randperm(capacity - 1, generator=gen)[:total] + 1
    req_to_token = torch.zeros(len(lengths), width, dtype=torch.int64)
    offset = 0
    for b, n in enumerate(lengths):
        req_to_token[b, :n] = perm[offset : offset + n]
        offset += n
    seq_lens = torch.tensor(lengths, dtype=torch.int64)
    q_ids, q_pos = [], []
    for b, (n, q) in enumerate(zip(lengths, queries_per_request)):
        if n == 0:
            q_ids.append(b)
            q_pos.append(0)
            continue
        for p in range(n - q, n):
            q_ids.append(b)
            q_pos.append(p)
    tokens = len(q_ids)
    kv_cache = torch.randn(capacity, rank_dim + rope_dim, generator=gen).to(dtype)
    q_latent = torch.randn(tokens, heads, rank_dim, generator=gen).to(dtype)
    q_rope = torch.randn(tokens, heads, rope_dim, generator=gen).to(dtype)
    return dict(
        q_latent=q_latent, q_rope=q_rope, kv_cache=kv_cache, req_to_token=req_to_token, seq_lens=seq_lens,
        q_seq_ids=torch.tensor(q_ids, dtype=torch.int64), q_positions=torch.tensor(q_pos, dtype=torch.int64),
    )


def naive_attention(inputs, sm_scale):
    """Dense softmax per query over its request's visible keys, in float64."""
    q_latent, q_rope = inputs["q_latent"].double(), inputs["q_rope"].double()
    cache = inputs["kv_cache"].double()
    rank_dim = q_latent.shape[-1]
    out = torch.zeros_like(q_latent)
    lse = torch.full(q_latent.shape[:2], float("-inf"), dtype=torch.float64)
    for t in range(q_latent.shape[0]):
        b, p = int(inputs["q_seq_ids"][t]), int(inputs["q_positions"][t])
        visible = min(p + 1, int(inputs["seq_lens"][b]))
        if visible <= 0:
            continue
        rows = cache[inputs["req_to_token"][b, :visible]]
        scores = (q_latent[t] @ rows[:, :rank_dim].T + q_rope[t] @ rows[:, rank_dim:].T) * sm_scale
        lse[t] = torch.logsumexp(scores, dim=-1)
        out[t] = torch.softmax(scores, dim=-1) @ rows[:, :rank_dim]
    return out, lse


def shard_inputs(inputs, dcp_size, interleave, dcp_rank):
    """This rank's physical shard of the cache, as sharded_kv_write would have filled it."""
    capacity = inputs["kv_cache"].shape[0]
    rows = -(-capacity // (interleave * dcp_size)) * interleave
    shard = torch.full((rows, inputs["kv_cache"].shape[1]), float("nan"), dtype=inputs["kv_cache"].dtype)
    locs = torch.arange(1, capacity)
    rank_dim = inputs["q_latent"].shape[-1]
    reference.kv_write(shard, inputs["kv_cache"][locs, :rank_dim], inputs["kv_cache"][locs, rank_dim:], locs, dcp_rank, dcp_size, interleave)
    return shard


def gather_q_attention(inputs, dcp_size, interleave, sm_scale):
    """Each rank's partial attention over its shard, exchanged (by stacking) and LSE-merged."""
    outs, lses = [], []
    for rank in range(dcp_size):
        shard = shard_inputs(inputs, dcp_size, interleave, rank)
        page, lens, pos = torch.ops.dcp.local_metadata(inputs["req_to_token"], inputs["seq_lens"], rank, dcp_size, interleave)
        out, lse = torch.ops.dcp.mla_partial_attention(
            inputs["q_latent"], inputs["q_rope"], shard, page, lens, pos, inputs["q_seq_ids"], inputs["q_positions"], sm_scale
        )
        outs.append(out)
        lses.append(lse)
    return reference.merge_lse(torch.stack(outs), torch.stack(lses))
