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

    def to(self, device, non_blocking: bool = False) -> "ForwardBatch":
        return ForwardBatch(*(t.to(device, non_blocking=non_blocking) for t in self.args()))

    @classmethod
    def empty(cls, width: int) -> "ForwardBatch":
        """Zero rows over a page table `width` wide; padded(), it is a batch that touches nothing."""
        zero = torch.zeros(0, dtype=torch.int64)
        return cls(zero, zero, zero, zero, torch.zeros(0, width, dtype=torch.int64), zero, zero, zero)

    @property
    def rows(self) -> int:
        return self.seq_lens.shape[0]

    def padded(self, rows: int, tokens_per_row: int) -> "ForwardBatch":
        """This batch (rows x tokens_per_row tokens, logits for every token or each row's last)
        grown to `rows` rows. Padded tokens write to location 0 and see no key."""
        if rows < self.rows:
            raise ValueError(f"cannot pad a batch of {self.rows} rows to {rows}")
        if self.input_ids.shape[0] != self.rows * tokens_per_row:
            raise ValueError(f"batch has {self.input_ids.shape[0]} tokens, not {self.rows} rows x {tokens_per_row}")
        tokens, device = rows * tokens_per_row, self.input_ids.device
        all_logits = self.logits_index.shape[0] == self.input_ids.shape[0]

        def grow(t, length, fill=0):
            out = torch.full((length,) + tuple(t.shape[1:]), fill, dtype=t.dtype, device=t.device)
            out[: t.shape[0]] = t
            return out

        q_seq_ids = grow(self.q_seq_ids, tokens)
        q_seq_ids[self.input_ids.shape[0] :] = torch.arange(self.rows, rows, device=device).repeat_interleave(tokens_per_row)
        logits_index = grow(self.logits_index, tokens if all_logits else rows)
        padded_first = torch.arange(self.input_ids.shape[0], tokens, device=device)
        logits_index[self.logits_index.shape[0] :] = padded_first if all_logits else padded_first[tokens_per_row - 1 :: tokens_per_row]
        return ForwardBatch(
            input_ids=grow(self.input_ids, tokens), positions=grow(self.positions, tokens), q_seq_ids=q_seq_ids,
            out_loc=grow(self.out_loc, tokens), req_to_token=grow(self.req_to_token, rows), seq_lens=grow(self.seq_lens, rows),
            state_slots=grow(self.state_slots, rows), logits_index=logits_index,
        )


MAX_DRAFT_LEN = 16


def check_draft_len(k: int) -> None:
    if not 1 <= k <= MAX_DRAFT_LEN:
        raise ValueError(f"verify length k must be in [1, {MAX_DRAFT_LEN}], got {k}")


class RequestTable:
    """Requests' page-table rows and a page allocator over the KV pool's logical locations.

    Pages are `page_size` consecutive locations; page 0 holds the reserved location 0 and is
    never handed out. A page may be shared by several requests (prefix caching): it returns to
    the free list when its last user lets go.
    """

    def __init__(self, max_requests: int, max_context: int, capacity: int, page_size: int = 1):
        if page_size < 1 or capacity % page_size:
            raise ValueError(f"page_size must be >= 1 and divide the capacity {capacity}, got {page_size}")
        self.max_context, self.capacity, self.page_size = max_context, capacity, page_size
        self.req_to_token = torch.zeros(max_requests, max_context, dtype=torch.int64)
        self.seq_lens = torch.zeros(max_requests, dtype=torch.int64)
        self.pages: list[list[int]] = [[] for _ in range(max_requests)]
        self.page_users: dict[int, int] = {}
        self.free_pages = list(range(capacity // page_size - 1, 0, -1))

    def _take_page(self) -> int:
        if not self.free_pages:
            raise MemoryError(f"KV pool exhausted: all {self.capacity // self.page_size - 1} pages are in use")
        page = self.free_pages.pop()
        self.page_users[page] = 1
        return page

    def _release_page(self, page: int) -> None:
        self.page_users[page] -= 1
        if self.page_users[page] == 0:
            del self.page_users[page]
            self.free_pages.append(page)

    def free_locations(self) -> int:
        return len(self.free_pages) * self.page_size

    def append(self, request: int, count: int) -> torch.Tensor:
        """Give `request` `count` new tokens; return their locations."""
        start = int(self.seq_lens[request])
        end = start + count
        if end > self.max_context:
            raise ValueError(f"request {request} would reach {end} tokens, max_context is {self.max_context}")
        pages_needed = -(-end // self.page_size) - len(self.pages[request])
        if pages_needed * self.page_size > self.free_locations():
            raise MemoryError(
                f"a chunk of {count} tokens overflows the KV pool: request {request} needs {pages_needed} "
                f"more pages of {self.page_size}, {len(self.free_pages)} free"
            )
        if start % self.page_size and self.page_users.get(self.pages[request][-1], 0) > 1:
            raise ValueError(f"request {request} would append into a shared page; fork at a page boundary")
        for _ in range(pages_needed):
            self.pages[request].append(self._take_page())
        positions = torch.arange(start, end)
        pages = torch.tensor(self.pages[request], dtype=torch.int64)
        locs = pages[positions // self.page_size] * self.page_size + positions % self.page_size
        self.req_to_token[request, start:end] = locs
        self.seq_lens[request] = end
        return locs

    def truncate(self, request: int, length: int) -> None:
        """Keep the first `length` tokens (e.g. the accepted drafts); release the rest."""
        if not 0 <= length <= int(self.seq_lens[request]):
            raise ValueError(f"cannot truncate request {request} of {int(self.seq_lens[request])} tokens to {length}")
        keep_pages = -(-length // self.page_size)
        for page in self.pages[request][keep_pages:]:
            self._release_page(page)
        del self.pages[request][keep_pages:]
        self.req_to_token[request, length:] = 0
        self.seq_lens[request] = length

    def fork(self, source: int, target: int, prefix_len: int) -> None:
        """Make empty request `target` share the first `prefix_len` tokens of `source`."""
        if prefix_len % self.page_size or prefix_len > int(self.seq_lens[source]):
            raise ValueError(f"a shared prefix must be whole pages of {self.page_size} within the source, got {prefix_len}")
        if int(self.seq_lens[target]):
            raise ValueError(f"request {target} is not empty")
        shared = self.pages[source][: prefix_len // self.page_size]
        for page in shared:
            self.page_users[page] += 1
        self.pages[target] = list(shared)
        self.req_to_token[target, :prefix_len] = self.req_to_token[source, :prefix_len]
        self.seq_lens[target] = prefix_len

    def extend_batch(self, requests: list[int], tokens: list[list[int]], pad_rows: int = 0,
                     all_logits: bool = False) -> ForwardBatch:
        """A batch that appends tokens[i] to requests[i] (prefill, extend, decode or verify).

        Logits come for each request's last token, or for every token with all_logits (verify).
        Each padded row is one query token that writes to location 0 and sees no key.
        """
        ids, positions, q_seq_ids, out_loc, logits_index = [], [], [], [], []
        for row, (request, new_tokens) in enumerate(zip(requests, tokens)):
            start = int(self.seq_lens[request])
            out_loc.append(self.append(request, len(new_tokens)))
            first = len(ids)
            ids.extend(new_tokens)
            positions.extend(range(start, start + len(new_tokens)))
            q_seq_ids.extend([row] * len(new_tokens))
            logits_index.extend(range(first, len(ids)) if all_logits else [len(ids) - 1])
        rows = len(requests) + pad_rows
        req_to_token = torch.zeros(rows, self.max_context, dtype=torch.int64)
        seq_lens = torch.zeros(rows, dtype=torch.int64)
        req_to_token[: len(requests)] = self.req_to_token[requests]
        seq_lens[: len(requests)] = self.seq_lens[requests]
        state_slots = torch.zeros(rows, dtype=torch.int64)
        state_slots[: len(requests)] = torch.tensor(requests) + 1
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
