"""Canonical MLA ops: the contract between model code and dcp_compile's passes.

Model code calls these two ops and nothing else for MLA attention; the passes match them.

Absorbed MLA. R = kv_lora_rank, P = rope dim, H = heads on this rank, T = query tokens,
B = requests. Each cache row holds one token: [latent (R) | rope (P)].

mla_kv_write(kv_cache [rows, R+P] (mutated), latent [T, R], rope [T, P], loc [T] int)
    Writes token t's row at location loc[t]. loc == 0 is padding and is skipped.

mla_attention(q_latent [T, H, R], q_rope [T, H, P], kv_cache, req_to_token [B, L] int,
              seq_lens [B] int, q_seq_ids [T] int, q_positions [T] int, sm_scale) -> [T, H, R]
    Query t belongs to request q_seq_ids[t] and sits at global position q_positions[t]. It attends
    causally over the keys at positions 0 .. min(q_positions[t], seq_lens[b] - 1) whose locations
    are req_to_token[b, position]. The output stays in latent space (before W_UV).
    Decode: one query per request at seq_lens - 1. Verify: k queries at seq_lens - k .. seq_lens - 1.
    Extend: a chunk of queries over a cached prefix. A padded request has seq_lens[b] == 0 and
    gets zeros.
"""

from __future__ import annotations

import torch
from torch.library import custom_op

from dcp_compile.ops import reference


def check_mla_shapes(q_latent, q_rope, kv_cache) -> None:
    if q_latent.dim() != 3 or q_rope.dim() != 3 or q_latent.shape[:2] != q_rope.shape[:2]:
        raise ValueError(
            f"q_latent and q_rope must be [T, H, R] and [T, H, P] with equal T and H; "
            f"got {tuple(q_latent.shape)} and {tuple(q_rope.shape)}"
        )
    if kv_cache.shape[-1] != q_latent.shape[-1] + q_rope.shape[-1]:
        raise ValueError(
            f"kv_cache rows must hold R + P = {q_latent.shape[-1]} + {q_rope.shape[-1]} values, "
            f"got {kv_cache.shape[-1]}"
        )


@custom_op("dcp::mla_kv_write", mutates_args=("kv_cache",))
def mla_kv_write(kv_cache: torch.Tensor, latent: torch.Tensor, rope: torch.Tensor, loc: torch.Tensor) -> None:
    reference.kv_write(kv_cache, latent, rope, loc)


@mla_kv_write.register_fake
def _(kv_cache, latent, rope, loc):
    if kv_cache.shape[-1] != latent.shape[-1] + rope.shape[-1]:
        raise ValueError(
            f"kv_cache rows hold {kv_cache.shape[-1]} values but latent + rope give "
            f"{latent.shape[-1]} + {rope.shape[-1]}"
        )
    return None


@custom_op("dcp::mla_attention", mutates_args=())
def mla_attention(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    q_seq_ids: torch.Tensor,
    q_positions: torch.Tensor,
    sm_scale: float,
) -> torch.Tensor:
    positions = reference.global_positions(req_to_token)
    out, _ = reference.partial_attention(
        q_latent, q_rope, kv_cache, req_to_token, seq_lens, positions, q_seq_ids, q_positions, sm_scale
    )
    return out


@mla_attention.register_fake
def _(q_latent, q_rope, kv_cache, req_to_token, seq_lens, q_seq_ids, q_positions, sm_scale):
    check_mla_shapes(q_latent, q_rope, kv_cache)
    return q_latent.new_empty(q_latent.shape)
