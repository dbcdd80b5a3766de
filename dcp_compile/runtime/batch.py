"""Forward-batch metadata and a minimal request table that hands out KV locations.

The scheduler's address space (logical locations) is the same with and without DCP.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field, fields

import torch

from dcp_compile.runtime import layout
from dcp_compile.runtime.host_metadata import HostMetadata, block_table_width

WINDOW_QUERIES = 16
"""Most query tokens per row that window attention completes (its `window`): the verify drafts
and short extend chunks the paged lowerings serve, and FIA's MLA limit (docs/ascend.md §4.3)."""


@dataclass
class ForwardBatch:
    """Inputs of one model step, all tensors. T query tokens over B request rows.

    input_ids [T], positions [T] (global position of each query token), q_seq_ids [T] (its row),
    out_loc [T] (where its KV goes; 0 = padding), req_to_token [B, L], seq_lens [B] (length
    including this step's tokens; 0 for a padded row), state_slots [B] (recurrent-state slot of
    each row for non-MLA layers; 0 = padding), logits_index [B] (token whose logits row b gets).
    `host` is the host-side local metadata (not a model input; see runtime/host_metadata.py),
    bound to this batch's tensors.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    q_seq_ids: torch.Tensor
    out_loc: torch.Tensor
    req_to_token: torch.Tensor
    seq_lens: torch.Tensor
    state_slots: torch.Tensor
    logits_index: torch.Tensor
    host: HostMetadata | None = field(default=None, compare=False)

    def __post_init__(self):
        if self.host is not None:
            self.host.bind(*self.args())

    def args(self) -> tuple[torch.Tensor, ...]:
        """The model's inputs, in forward() order."""
        return tuple(getattr(self, f.name) for f in fields(self) if f.name != "host")

    def to(self, device, non_blocking: bool = False) -> "ForwardBatch":
        return ForwardBatch(*(t.to(device, non_blocking=non_blocking) for t in self.args()), host=self._checked_host())

    def _checked_host(self) -> HostMetadata | None:
        """The host metadata, checked to still describe this batch before a copy is bound to it
        (else a copy of an edited batch would pass as the batch the metadata was built for)."""
        if self.host is not None:
            self.host.check_batch(self.args(), {"req_to_token": self.req_to_token, "seq_lens": self.seq_lens,
                                                "q_seq_ids": self.q_seq_ids})
        return self.host

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
            host=self._checked_host().padded(rows, tokens_per_row) if self.host is not None else None,
        )




def _next_power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def padded_row_tokens(rows: int, counts: list[int], pad_rows: int, bucket: bool) -> list[int]:
    """Query tokens of each padded row: one each, or, bucketed, enough rows and tokens to reach
    the bucket shape (see RequestTable.extend_batch)."""
    if not bucket:
        return [1] * pad_rows
    if counts and len(set(counts)) == 1 and counts[0] <= WINDOW_QUERIES:
        return [counts[0]] * (_next_power_of_two(rows + pad_rows) - rows)
    padded_rows = _next_power_of_two(rows + max(pad_rows, 1)) - rows
    tokens = sum(counts) + padded_rows
    return [1 + _next_power_of_two(tokens) - tokens] + [1] * (padded_rows - 1)


def _check_size(name: str, value, minimum: int, why: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}{why}, got {value!r}")


def check_draft_len(k: int) -> None:
    if not 1 <= k <= WINDOW_QUERIES:
        raise ValueError(f"verify length k must be in [1, {WINDOW_QUERIES}], got {k}")


class RequestTable:
    """Requests' page-table rows and a page allocator over the KV pool's logical locations.

    Pages are `page_size` consecutive locations; page 0 holds the reserved location 0 and is
    never handed out. A page may be shared by several requests (prefix caching): it returns to
    the free list when its last user lets go.

    It also keeps each request's host-side local metadata for a DCP group of `dcp_size` ranks
    with interleave `interleave`: the keys each rank stores, and, where pages map onto whole
    local blocks (runtime/layout.local_block_size), each rank's local block ids. They are updated
    at O(tokens appended or released) per call, with no device sync, and every batch carries them
    (`ForwardBatch.host`).

    With `vocab_size`, extend_batch rejects token ids outside [0, vocab_size) (and ids that are not
    ints) before anything changes.
    """

    def __init__(self, max_requests: int, max_context: int, capacity: int, page_size: int = 1,
                 dcp_size: int = 1, interleave: int = 1, *, vocab_size: int | None = None):
        for name, value in (("max_requests", max_requests), ("max_context", max_context), ("page_size", page_size),
                            ("dcp_size", dcp_size), ("interleave", interleave)):
            _check_size(name, value, 1)
        _check_size("capacity", capacity, 2, " (location 0 is reserved)")
        if vocab_size is not None:
            _check_size("vocab_size", vocab_size, 1)
        if capacity % page_size:
            raise ValueError(f"page_size {page_size} must divide the capacity {capacity}")
        layout.validate(dcp_size, 0, interleave)
        if page_size % interleave:
            raise ValueError(f"interleave size {interleave} must divide the page size {page_size}")
        self.max_context, self.capacity, self.page_size = max_context, capacity, page_size
        self.dcp_size, self.interleave, self.vocab_size = dcp_size, interleave, vocab_size
        self.req_to_token = torch.zeros(max_requests, max_context, dtype=torch.int64)
        self.seq_lens = torch.zeros(max_requests, dtype=torch.int64)
        self.pages: list[list[int]] = [[] for _ in range(max_requests)]
        self.page_users: dict[int, int] = {}
        self.free_pages = list(range(capacity // page_size - 1, 0, -1))
        self.local_seq_lens = torch.zeros(max_requests, dcp_size, dtype=torch.int64)
        self.block_size = layout.local_block_size(page_size, dcp_size, interleave)
        self.local_blocks_used = torch.zeros(max_requests, dcp_size, dtype=torch.int64)
        self.block_tables = (torch.zeros(dcp_size, max_requests, block_table_width(max_context, page_size), dtype=torch.int32)
                             if self.block_size else None)

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

    def _add_pages(self, request: int, pages: list[int]) -> None:
        self.pages[request].extend(pages)
        if self.block_tables is None:
            return
        for page in pages:
            for rank, block in layout.local_blocks_of_page(page, self.page_size, self.dcp_size, self.interleave):
                self.block_tables[rank, request, self.local_blocks_used[request, rank]] = block
                self.local_blocks_used[request, rank] += 1

    def _drop_pages(self, request: int, keep: int) -> None:
        """Release the request's pages past the first `keep`, newest first."""
        for page in reversed(self.pages[request][keep:]):
            self._release_page(page)
            if self.block_tables is not None:
                for rank, _ in layout.local_blocks_of_page(page, self.page_size, self.dcp_size, self.interleave):
                    self.local_blocks_used[request, rank] -= 1
                    self.block_tables[rank, request, self.local_blocks_used[request, rank]] = 0
        del self.pages[request][keep:]

    def _count_local(self, locs: torch.Tensor) -> torch.Tensor:
        """How many of `locs` each DCP rank stores."""
        return torch.bincount(layout.owner(locs, self.dcp_size, self.interleave), minlength=self.dcp_size)

    def free_locations(self) -> int:
        return len(self.free_pages) * self.page_size

    def _check_request(self, request) -> None:
        if isinstance(request, bool) or not isinstance(request, numbers.Integral) or not 0 <= request < len(self.pages):
            raise ValueError(f"request must be an int in [0, {len(self.pages)}), got {request!r}")

    def _pages_needed(self, request: int, count: int) -> int:
        """Pages `request` needs for `count` more tokens; raises if it may not have them."""
        self._check_request(request)
        if isinstance(count, bool) or not isinstance(count, numbers.Integral) or count < 0:
            raise ValueError(f"a request appends a whole number of tokens >= 0, got {count!r}")
        start = int(self.seq_lens[request])
        end = start + count
        if end > self.max_context:
            raise ValueError(f"request {request} would reach {end} tokens, max_context is {self.max_context}")
        if count and start % self.page_size and self.page_users.get(self.pages[request][-1], 0) > 1:
            raise ValueError(f"request {request} would append into a shared page; fork at a page boundary")
        return -(-end // self.page_size) - len(self.pages[request])

    def _check_free(self, pages_needed: int, what: str) -> None:
        if pages_needed * self.page_size > self.free_locations():
            raise MemoryError(
                f"{what} overflows the KV pool: it needs {pages_needed} more pages of {self.page_size}, "
                f"{len(self.free_pages)} free"
            )

    def append(self, request: int, count: int) -> torch.Tensor:
        """Give `request` `count` new tokens; return their locations. Nothing changes on error."""
        pages_needed = self._pages_needed(request, count)
        self._check_free(pages_needed, f"a chunk of {count} tokens for request {request}")
        start = int(self.seq_lens[request])
        end = start + count
        self._add_pages(request, [self._take_page() for _ in range(pages_needed)])
        positions = torch.arange(start, end)
        pages = torch.tensor(self.pages[request], dtype=torch.int64)
        locs = pages[positions // self.page_size] * self.page_size + positions % self.page_size
        self.req_to_token[request, start:end] = locs
        self.seq_lens[request] = end
        self.local_seq_lens[request] += self._count_local(locs)
        return locs

    def truncate(self, request: int, length: int) -> None:
        """Keep the first `length` tokens (e.g. the accepted drafts); release the rest. A hybrid
        model's recurrent state is not here: after a verify step, MLAModel.commit_verify keeps the
        accepted tokens' state."""
        self._check_request(request)
        current = int(self.seq_lens[request])
        if isinstance(length, bool) or not isinstance(length, numbers.Integral):
            raise ValueError(f"a request is truncated to a whole number of tokens in [0, {current}], got {length!r}")
        if not 0 <= length <= current:
            raise ValueError(f"cannot truncate request {request} of {current} tokens to {length}")
        self.local_seq_lens[request] -= self._count_local(self.req_to_token[request, length:current])
        self._drop_pages(request, -(-length // self.page_size))
        self.req_to_token[request, length:] = 0
        self.seq_lens[request] = length

    def fork(self, source: int, target: int, prefix_len: int) -> None:
        """Make empty request `target` share the first `prefix_len` tokens of `source`."""
        self._check_request(source)
        self._check_request(target)
        if prefix_len % self.page_size or prefix_len > int(self.seq_lens[source]):
            raise ValueError(f"a shared prefix must be whole pages of {self.page_size} within the source, got {prefix_len}")
        if int(self.seq_lens[target]):
            raise ValueError(f"request {target} is not empty")
        shared = self.pages[source][: prefix_len // self.page_size]
        for page in shared:
            self.page_users[page] += 1
        self._add_pages(target, list(shared))
        self.req_to_token[target, :prefix_len] = self.req_to_token[source, :prefix_len]
        self.seq_lens[target] = prefix_len
        self.local_seq_lens[target] = self._count_local(self.req_to_token[target, :prefix_len])

    @staticmethod
    def state_slots(requests: list[int]) -> torch.Tensor:
        """Each request's recurrent-state slot, as its batch rows name it (slot 0 takes padded
        rows): what MLAModel.commit_verify takes after a verify step."""
        return torch.tensor(requests, dtype=torch.int64) + 1

    def extend_batch(self, requests: list[int], tokens: list[list[int]], pad_rows: int = 0,
                     all_logits: bool = False, bucket: bool = False) -> ForwardBatch:
        """A batch that appends tokens[i] to requests[i] (prefill, extend, decode or verify).

        Logits come for each request's last token, or for every token with all_logits (verify).
        Each padded row is one query token that writes to location 0 and sees no key.

        bucket=True pads the batch to one of few shapes, so that a server compiles O(log) graphs
        instead of one per token count: rows are rounded up to a power of two; when every row
        has the same k <= 16 tokens (decode, verify), padded rows get k tokens each, else the
        tokens are rounded up to a power of two too, the extra ones on the first padded row.
        """
        self._check_batch(requests, tokens, pad_rows)
        ids, positions, q_seq_ids, out_loc, logits_index = [], [], [], [], []
        prefix_lens = []
        for row, (request, new_tokens) in enumerate(zip(requests, tokens)):
            start = int(self.seq_lens[request])
            prefix_lens.append(self.local_seq_lens[request].clone())
            out_loc.append(self.append(request, len(new_tokens)))
            first = len(ids)
            ids.extend(new_tokens)
            positions.extend(range(start, start + len(new_tokens)))
            q_seq_ids.extend([row] * len(new_tokens))
            logits_index.extend(range(first, len(ids)) if all_logits else [len(ids) - 1])
        pad_tokens = padded_row_tokens(len(requests), [len(t) for t in tokens], pad_rows, bucket)
        rows = len(requests) + len(pad_tokens)
        req_to_token = torch.zeros(rows, self.max_context, dtype=torch.int64)
        seq_lens = torch.zeros(rows, dtype=torch.int64)
        req_to_token[: len(requests)] = self.req_to_token[requests]
        seq_lens[: len(requests)] = self.seq_lens[requests]
        state_slots = torch.zeros(rows, dtype=torch.int64)
        state_slots[: len(requests)] = self.state_slots(requests)
        padded = sum(pad_tokens)
        for row, count in enumerate(pad_tokens, start=len(requests)):
            first = len(q_seq_ids)
            q_seq_ids.extend([row] * count)
            logits_index.extend(range(first, len(q_seq_ids)) if all_logits else [first])
        return ForwardBatch(
            input_ids=torch.tensor(ids + [0] * padded, dtype=torch.int64),
            positions=torch.tensor(positions + [0] * padded, dtype=torch.int64),
            q_seq_ids=torch.tensor(q_seq_ids, dtype=torch.int64),
            out_loc=torch.cat(out_loc + [torch.zeros(padded, dtype=torch.int64)]),
            req_to_token=req_to_token,
            seq_lens=seq_lens,
            state_slots=state_slots,
            logits_index=torch.tensor(logits_index, dtype=torch.int64),
            host=self._host_metadata(requests, [len(t) for t in tokens] + pad_tokens, prefix_lens, len(pad_tokens),
                                     out_loc, padded),
        )

    def _check_batch(self, requests: list[int], tokens: list[list[int]], pad_rows: int) -> None:
        """Everything extend_batch could fail on, before anything is allocated: a batch is
        taken whole or not at all."""
        if len(requests) != len(tokens):
            raise ValueError(f"{len(requests)} requests but {len(tokens)} token lists")
        if len(set(requests)) != len(requests):
            raise ValueError(f"a request appears twice in one batch: {requests}")
        if isinstance(pad_rows, bool) or not isinstance(pad_rows, int) or pad_rows < 0:
            raise ValueError(f"pad_rows must be an int >= 0, got {pad_rows!r}")
        for request, new_tokens in zip(requests, tokens):
            if not new_tokens:
                raise ValueError(f"request {request} has an empty token list: each row of a batch needs >= 1 token")
            if self.vocab_size is not None:
                self._check_token_ids(request, new_tokens)
        needed = sum(self._pages_needed(request, len(new_tokens)) for request, new_tokens in zip(requests, tokens))
        self._check_free(needed, f"a batch of {sum(len(t) for t in tokens)} tokens")

    def _check_token_ids(self, request: int, ids: list[int]) -> None:
        """Every id an int in [0, vocab_size): a type check per distinct type and a min and max,
        all at C speed over the ids."""
        for kind in set(map(type, ids)):
            if kind is bool or not issubclass(kind, numbers.Integral):
                bad = next(t for t in ids if type(t) is kind)
                raise ValueError(f"request {request}'s token ids must be ints, got {bad!r}")
        for bad in (min(ids), max(ids)):
            if not 0 <= bad < self.vocab_size:
                raise ValueError(f"request {request}'s token id {bad} is outside the vocabulary [0, {self.vocab_size})")

    def _host_metadata(self, requests: list[int], query_lens: list[int], prefix_lens: list[torch.Tensor],
                       pad_rows: int, out_loc: list[torch.Tensor], pad_tokens: int) -> HostMetadata:
        zeros = (0,) * pad_rows
        local = self.local_seq_lens[requests].T.tolist() if requests else [[] for _ in range(self.dcp_size)]
        prefix = torch.stack(prefix_lens).T.tolist() if requests else [[] for _ in range(self.dcp_size)]
        tables = None
        if self.block_tables is not None:
            tables = self.block_tables[:, requests]
            tables = torch.cat([tables, tables.new_zeros(self.dcp_size, pad_rows, tables.shape[2])], dim=1)
        locations = torch.cat(out_loc) if out_loc else torch.zeros(0, dtype=torch.int64)
        owners = layout.owner(locations, self.dcp_size, self.interleave).tolist() + [-1] * pad_tokens
        return HostMetadata(
            self.dcp_size, self.interleave, self.page_size, tuple(query_lens),
            tuple(tuple(r) + zeros for r in local), tuple(tuple(r) + zeros for r in prefix), tables, tuple(owners),
        )
