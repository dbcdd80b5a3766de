"""Forward-batch metadata and a minimal request table that hands out KV locations.

The scheduler's address space (logical locations) is the same with and without DCP.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from dcp_compile.runtime import layout


@dataclass
class ForwardBatch:
    """Inputs of one model step, all tensors. T query tokens over B request rows.

    input_ids [T], positions [T] (global position of each query token), q_seq_ids [T] (its row),
    out_loc [T] (where its KV goes; 0 = padding), req_to_token [B, L], seq_lens [B] (length
    including this step's tokens; 0 for a padded row), state_slots [B] (recurrent-state slot of
    each row for non-MLA layers; 0 = padding), logits_index [B] (token whose logits row b gets).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    q_seq_ids: torch.Tensor
    out_loc: torch.Tensor
    req_to_token: torch.Tensor
    seq_lens: torch.Tensor
    state_slots: torch.Tensor
    logits_index: torch.Tensor

    def args(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, f.name) for f in fields(self))

    def to(self, device) -> "ForwardBatch":
        return ForwardBatch(*(t.to(device) for t in self.args()))


class RequestTable:
    """Requests' page-table rows and a free list of KV locations (location 0 is reserved)."""

    def __init__(self, max_requests: int, max_context: int, capacity: int):
        self.max_context = max_context
        self.capacity = capacity
        self.req_to_token = torch.zeros(max_requests, max_context, dtype=torch.int64)
        self.seq_lens = torch.zeros(max_requests, dtype=torch.int64)
        self.free_locations = list(range(capacity - 1, layout.PADDING_LOC, -1))

    def allocate(self, count: int) -> list[int]:
        if count > len(self.free_locations):
            raise MemoryError(f"KV pool exhausted: asked for {count} locations, {len(self.free_locations)} free")
        return [self.free_locations.pop() for _ in range(count)]

    def append(self, request: int, count: int) -> torch.Tensor:
        """Give `request` `count` new tokens; return their locations."""
        start = int(self.seq_lens[request])
        if start + count > self.max_context:
            raise ValueError(f"request {request} would reach {start + count} tokens, max_context is {self.max_context}")
        locs = torch.tensor(self.allocate(count), dtype=torch.int64)
        self.req_to_token[request, start : start + count] = locs
        self.seq_lens[request] = start + count
        return locs

    def extend_batch(self, requests: list[int], tokens: list[list[int]], pad_rows: int = 0) -> ForwardBatch:
        """A batch that appends tokens[i] to requests[i] (prefill, extend, decode or verify)."""
        ids, positions, q_seq_ids, out_loc, logits_index = [], [], [], [], []
        for row, (request, new_tokens) in enumerate(zip(requests, tokens)):
            start = int(self.seq_lens[request])
            out_loc.append(self.append(request, len(new_tokens)))
            ids.extend(new_tokens)
            positions.extend(range(start, start + len(new_tokens)))
            q_seq_ids.extend([row] * len(new_tokens))
            logits_index.append(len(ids) - 1)
        rows = len(requests) + pad_rows
        req_to_token = torch.zeros(rows, self.max_context, dtype=torch.int64)
        seq_lens = torch.zeros(rows, dtype=torch.int64)
        req_to_token[: len(requests)] = self.req_to_token[requests]
        seq_lens[: len(requests)] = self.seq_lens[requests]
        state_slots = torch.zeros(rows, dtype=torch.int64)
        state_slots[: len(requests)] = torch.tensor(requests) + 1
        # Each padded row is one query token that writes to location 0 and sees no key.
        pad = list(range(len(requests), rows))
        return ForwardBatch(
            input_ids=torch.tensor(ids + [0] * pad_rows, dtype=torch.int64),
            positions=torch.tensor(positions + [0] * pad_rows, dtype=torch.int64),
            q_seq_ids=torch.tensor(q_seq_ids + pad, dtype=torch.int64),
            out_loc=torch.cat(out_loc + [torch.zeros(pad_rows, dtype=torch.int64)]),
            req_to_token=req_to_token,
            seq_lens=seq_lens,
            state_slots=state_slots,
            logits_index=torch.tensor(logits_index + [len(ids) + i for i in range(pad_rows)], dtype=torch.int64),
        )
