"""The read of the KV pool that a front end's cache shim hands an unmodified model.

mla_cache_view(kv_cache [rows, R+P], req_to_token [B, L] int, seq_lens [B] int,
               q_seq_ids [T] int, q_positions [T] int, kv_lora_rank R)
    -> (latent [B, 1, L, R], rope [B, 1, L, P])

Row b, column p holds the token at position p of request b (location req_to_token[b, p]) where
p < seq_lens[b], and zeros elsewhere: the layout transformers' caches hand their attention
(`keys` = the normalised latent, `values` = the roped k_pe, one "head"). q_seq_ids and
q_positions name the queries this read is for (the step's tokens, request-major); the reference
ignores them, and the absorb pass (dcp_compile/hf/absorb.py) hands them to the canonical
mla_attention that replaces the read and the attention over it.

The op reads the pool as it is on this rank: under DCP (a sharded pool) it is wrong, which is
why a view left in a graph at dcp_size > 1 is an error (the absorb pass raises).
"""

from __future__ import annotations

import torch
from torch.library import custom_op


def _check(kv_cache, req_to_token, seq_lens, kv_lora_rank):
    if kv_cache.dim() != 2 or not 0 < kv_lora_rank <= kv_cache.shape[-1]:
        raise ValueError(f"kv_cache must be [rows, R + P] with R = kv_lora_rank = {kv_lora_rank} <= R + P, "
                         f"got {tuple(kv_cache.shape)}")
    if req_to_token.dim() != 2 or seq_lens.shape != req_to_token.shape[:1]:
        raise ValueError(f"req_to_token must be [B, L] and seq_lens [B], got {tuple(req_to_token.shape)} and "
                         f"{tuple(seq_lens.shape)}")


@custom_op("dcp::mla_cache_view", mutates_args=())
def mla_cache_view(kv_cache: torch.Tensor, req_to_token: torch.Tensor, seq_lens: torch.Tensor, q_seq_ids: torch.Tensor,
                   q_positions: torch.Tensor, kv_lora_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    _check(kv_cache, req_to_token, seq_lens, kv_lora_rank)
    width = req_to_token.shape[1]
    written = torch.arange(width, device=req_to_token.device)[None, :] < seq_lens[:, None]
    rows = kv_cache[torch.where(written, req_to_token, 0).long()]
    rows = torch.where(written[..., None], rows, torch.zeros((), dtype=rows.dtype, device=rows.device))
    return rows[..., :kv_lora_rank].unsqueeze(1).contiguous(), rows[..., kv_lora_rank:].unsqueeze(1).contiguous()


@mla_cache_view.register_fake
def _(kv_cache, req_to_token, seq_lens, q_seq_ids, q_positions, kv_lora_rank):
    _check(kv_cache, req_to_token, seq_lens, kv_lora_rank)
    batch, width = req_to_token.shape
    rope_dim = kv_cache.shape[-1] - kv_lora_rank
    return (kv_cache.new_empty((batch, 1, width, kv_lora_rank)), kv_cache.new_empty((batch, 1, width, rope_dim)))
