"""A Kimi-Linear style recurrent (linear-attention) layer op. DCP never rewrites it.

State S[slot] is [H, d, d] per request slot; slot 0 absorbs padded rows. Per token, in order:
S = decay * S + k^T v (S taken as 0 at position 0: a request that reuses a slot starts afresh);
o = q S. Its state is replicated on every DCP rank, like the weights.
"""

from __future__ import annotations

import torch
from torch.library import custom_op


@custom_op("dcp_models::linear_attention", mutates_args=("state",))
def linear_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: torch.Tensor,
    q_seq_ids: torch.Tensor, state_slots: torch.Tensor, positions: torch.Tensor, decay: float,
) -> torch.Tensor:
    out = torch.empty_like(v)
    slots = state_slots[q_seq_ids]
    carried = (positions != 0).to(state.dtype) * decay  # a request's first token drops what its slot held
    for t in range(q.shape[0]):  # device work only (no slot read on the host): it replays in a device graph
        slot = slots[t:t + 1]
        updated = carried[t] * state.index_select(0, slot)[0] + k[t, :, :, None].float() * v[t, :, None, :].float()
        state.index_copy_(0, slot, updated[None])
        out[t] = torch.einsum("hd,hde->he", q[t].float(), updated).to(v.dtype)
    return out


@linear_attention.register_fake
def _(q, k, v, state, q_seq_ids, state_slots, positions, decay):
    return torch.empty_like(v)
