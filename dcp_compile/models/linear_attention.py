"""A Kimi-Linear style recurrent (linear-attention) layer op. DCP never rewrites it.

State S[slot] is [H, d, d] per request slot; slot 0 absorbs padded rows. Per token, in order:
S = decay * S + k^T v (S taken as 0 at position 0: a request that reuses a slot starts afresh);
o = q S. Its state is replicated on every DCP rank, like the weights.

Speculative decoding: a verify step runs k draft tokens through S, and only some are accepted.
Every step therefore records, per row's slot, the state before the step (`StepRecord.start`) and
the first WINDOW_QUERIES tokens' update terms (decay factor, k, v); `commit_linear_attention`
then sets S[slot] to the state after the first `accepted` of them, replayed from the record on
the device (no host sync). It is the checkpoint-and-replay form of the engines' per-draft state
caches: two states per slot instead of k + 1.
"""

from __future__ import annotations

import torch
from torch.library import custom_op

from dcp_compile.runtime.batch import WINDOW_QUERIES


class StepRecord:
    """The buffers a step leaves for a commit, over `slots` state slots: `start` [slots, H, d, d]
    (each slot's state before its row's first token of the step), `carried` [slots, W + 1] (the
    factor on S of each token: decay, or 0 at position 0), `keys` and `values` [slots, W + 1, H, d]
    (fp32), W = WINDOW_QUERIES. Column W takes the tokens of a row past its first W (an extend
    chunk): a commit never reads it."""

    def __init__(self, slots: int, heads: int, head_dim: int, device) -> None:
        columns = WINDOW_QUERIES + 1
        self.start = torch.zeros(slots, heads, head_dim, head_dim, device=device)
        self.carried = torch.zeros(slots, columns, device=device)
        self.keys = torch.zeros(slots, columns, heads, head_dim, device=device)
        self.values = torch.zeros(slots, columns, heads, head_dim, device=device)


@custom_op("dcp_models::linear_attention",
           mutates_args=("state", "step_start", "step_carried", "step_keys", "step_values"))
def linear_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: torch.Tensor,
    q_seq_ids: torch.Tensor, state_slots: torch.Tensor, positions: torch.Tensor, decay: float,
    step_start: torch.Tensor, step_carried: torch.Tensor, step_keys: torch.Tensor, step_values: torch.Tensor,
) -> torch.Tensor:
    out = torch.empty_like(v)
    tokens = q.shape[0]
    slots = state_slots[q_seq_ids]
    carried = (positions != 0).to(state.dtype) * decay  # a request's first token drops what its slot held
    # Each token's column in its row's record: how many of the row's tokens come before it (a
    # running count, not a segment minimum: op-plugin runs an int64 scatter_reduce on the host).
    in_row = q_seq_ids[:, None] == torch.arange(state_slots.shape[0], device=q.device)
    before = torch.cumsum(in_row.to(torch.int64), 0).gather(1, q_seq_ids[:, None])[:, 0] - 1
    columns = before.clamp(max=step_keys.shape[1] - 1)
    step_start.index_copy_(0, state_slots, state.index_select(0, state_slots))
    step_carried.index_put_((slots, columns), carried.to(step_carried.dtype))
    step_keys.index_put_((slots, columns), k.float())
    step_values.index_put_((slots, columns), v.float())
    for t in range(tokens):  # device work only (no slot read on the host): it replays in a device graph
        slot = slots[t:t + 1]
        updated = carried[t] * state.index_select(0, slot)[0] + k[t, :, :, None].float() * v[t, :, None, :].float()
        state.index_copy_(0, slot, updated[None])
        out[t] = torch.einsum("hd,hde->he", q[t].float(), updated).to(v.dtype)
    return out


@linear_attention.register_fake
def _(q, k, v, state, q_seq_ids, state_slots, positions, decay, step_start, step_carried, step_keys, step_values):
    return torch.empty_like(v)


@custom_op("dcp_models::commit_linear_attention", mutates_args=("state",))
def commit_linear_attention(
    state: torch.Tensor, step_start: torch.Tensor, step_carried: torch.Tensor, step_keys: torch.Tensor,
    step_values: torch.Tensor, state_slots: torch.Tensor, accepted: torch.Tensor,
) -> None:
    """S[state_slots[b]] = the state after the first accepted[b] tokens of that slot's last step
    (0 <= accepted[b] <= min(its tokens, WINDOW_QUERIES)): the record's start, with the accepted
    tokens' updates applied in order, the same arithmetic as the step."""
    kept = step_start.index_select(0, state_slots)
    carried, keys, values = (t.index_select(0, state_slots) for t in (step_carried, step_keys, step_values))
    for column in range(step_keys.shape[1] - 1):
        updated = carried[:, column, None, None, None] * kept + keys[:, column, :, :, None] * values[:, column, :, None, :]
        kept = torch.where((accepted > column)[:, None, None, None], updated, kept)
    state.index_copy_(0, state_slots, kept.to(state.dtype))


@commit_linear_attention.register_fake
def _(state, step_start, step_carried, step_keys, step_values, state_slots, accepted):
    return None
