"""A transformers `Cache` whose layers live in dcp_compile's KV pool.

transformers' MLA attention (DeepSeek-V2/V3 since 5.17) calls, per layer,

    keys, values = cache.update(latent [B, 1, T, R], k_pe [B, 1, T, P], layer_idx)

and expands `keys`/`values` into per-head K and V itself. `DCPCacheLayer.update` writes the step's
tokens with the canonical `dcp::mla_kv_write` into the pool (so the DCP passes shard the write)
and returns `dcp::mla_cache_view`, a read of the pool in the layout transformers expects. No
per-request cache tensor of transformers' own is ever allocated.

Layout. A cache of `batch_size` rows of `max_length` positions takes batch_size * max_length
locations of the pool from the pool's allocator (dcp_compile/hf/locations.py), disjoint from every
other live cache's, and gives them back when it is released or garbage collected; row b,
position p is `req_to_token[b, p]` (location 0 stays reserved for padding). A cache serves one
batch of rows from position 0: the length counter (columns written) is one 0-d tensor per layer,
as in transformers' StaticLayer (a graph input updated in place, so one graph serves every decode
step); a left-padded batch gives each row its padding (`pads`, set by the first step), columns
never written, so that row b's tokens sit at positions column - pads[b] and its length is the
columns written less its padding. `get_mask_sizes` reports `max_length` keys, so transformers' mask is [B, 1, T, max_length]
and the view's rows past the length are never attended.

What the caller (dcp_compile/hf/model.py) checks before each step, on the host: the step fits in
`max_length`, the attention mask pads nothing and the position ids are the cache's positions.

Cropping (`DCPCache.crop`, what transformers' assisted generation and prompt lookup call after
each verify step to drop the rejected draft tokens) moves the length back: the host's count and
every attention layer's counter. The dropped tokens' KV rows stay where they are, past the
length, which no read sees, until the next step writes its tokens at those columns' locations
(the same locations on every rank, each rank's own share of them). Nothing moves in the pool
and the page table does not change, so the KV locations' checksum is the same; the length is
host state that the DCP peers compare at every step (hf/agreement.py), as after `advance`. A
hybrid model's linear-attention layers are transformers' own: they keep the states of the last
draft's tokens while the cache records its past (`activate_past_recording`), and crop restores
the state before the dropped tokens.
Beam search and batch reordering are refused: the pool's rows do not move.
"""

from __future__ import annotations

import weakref
import zlib
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from dcp_compile import ops
from dcp_compile.hf.locations import allocator, reserved
from dcp_compile.ops.cache_view import mla_cache_view
from dcp_compile.runtime import layout
from dcp_compile.runtime.host_metadata import HostMetadata
from dcp_compile.runtime.kv_pool import MLAKVPool


def check_compiling() -> None:
    if not torch.compiler.is_compiling():
        raise RuntimeError("a DCPCache is updated only inside the step dcp_compile.apply compiled: call the model "
                           "apply() returned")


@dataclass
class StepInputs:
    """A step's KV write and read over one cache (every attention layer's alike): the page table
    [B, W], each row's length after the step [B], each token's row and position [B*T], and the
    location each token writes [B*T] (0 on left padding: the write skips it)."""

    req_to_token: torch.Tensor
    seq_lens: torch.Tensor
    q_seq_ids: torch.Tensor
    q_positions: torch.Tensor
    loc: torch.Tensor


def write_and_read(cache: torch.Tensor, step: StepInputs, key_states: torch.Tensor, value_states: torch.Tensor):
    """Write a step's latent [B, 1, T, R] and rope [B, 1, T, P] into one layer's `cache` and
    return that layer's rows of the batch, (latent [B, 1, L, R], rope [B, 1, L, P])."""
    batch, _, tokens, rank_dim = key_states.shape
    ops.mla_kv_write(cache, key_states.reshape(batch * tokens, rank_dim),
                     value_states.reshape(batch * tokens, value_states.shape[-1]), step.loc)
    return mla_cache_view(cache, step.req_to_token, step.seq_lens, step.q_seq_ids, step.q_positions, rank_dim)


def _refuse(what: str):
    raise NotImplementedError(f"a dcp_compile cache does not support {what}: its tokens live in the sharded KV pool, "
                              "at locations fixed per request row")


class DCPCacheLayer(CacheLayerMixin):
    """One attention layer's view of the pool: layer `layer` of `pool`, rows of `req_to_token`."""

    is_compileable = False
    """False: transformers would otherwise build the 4D mask on the host and, on a GPU, wrap the
    forward in its own torch.compile around dcp_compile's."""
    is_sliding = False
    is_croppable = True
    """crop() moves the length back; the dropped tokens' rows are overwritten by the next writes."""

    def __init__(self, pool: MLAKVPool, layer: int, req_to_token: torch.Tensor, pads: torch.Tensor):
        super().__init__()
        self.pool, self.layer, self.req_to_token, self.pads = pool, layer, req_to_token, pads
        self.batch_size, self.max_length = req_to_token.shape
        self.device = req_to_token.device
        self.cumulative_length = torch.zeros((), dtype=torch.int64, device=self.device)
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to allocate: the pool holds the rows."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write the step's latent [B, 1, T, R] and rope [B, 1, T, P] at the next T columns of
        every row; return the pool's rows of this batch, (latent [B, 1, L, R], rope [B, 1, L, P]).
        Row b's first `pads[b]` columns are its left padding: never written (location 0, which
        the write skips), and its tokens sit at positions column - pads[b].

        Only inside dcp_compile's compiled step: there transformers always builds the causal
        mask (the length is a traced tensor); run eagerly, it skips the mask of a one-token
        step and would attend over the read's unwritten rows."""
        check_compiling()
        batch, _, tokens, _ = key_states.shape
        step = self.step_inputs(batch, tokens)  # from the length, before the in-place add below
        read = write_and_read(self.pool.cache(self.layer), step, key_states, value_states)
        self.cumulative_length.add_(tokens)
        return read

    def step_inputs(self, batch: int, tokens: int) -> "StepInputs":
        """Where a step of `tokens` columns a row writes and what it reads, from this layer's
        length before the step."""
        columns = self.cumulative_length + torch.arange(tokens, device=self.device)
        positions = columns.unsqueeze(0) - self.pads.unsqueeze(1)  # [B, T]; < 0 on padding
        written = positions >= 0
        positions = positions.clamp_min(0)
        return StepInputs(req_to_token=self.req_to_token,
                          seq_lens=self.cumulative_length + tokens - self.pads,
                          q_seq_ids=torch.arange(batch, device=self.device).repeat_interleave(tokens),
                          q_positions=positions.reshape(-1),
                          loc=torch.where(written, self.req_to_token.gather(1, positions), 0).reshape(-1))

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # The table's width, not the int: symbolic where the step marks it so (one graph per width otherwise).
        return self.req_to_token.shape[1], 0

    def get_seq_length(self) -> torch.Tensor:
        """The positions written, a 0-d tensor (as StaticLayer's): reading it in a graph is no break."""
        return self.cumulative_length

    def get_max_length(self) -> int:
        return self.max_length

    def reset(self) -> None:
        self.cumulative_length.zero_()

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last `-tokens_to_remove` columns (0 or a negative count, as transformers'
        StaticLayer takes it): the length counter moves back, a device op with no read-back.
        DCPCache.crop keeps the host's count with it and checks the count against it."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): a cache layer is cropped by a negative count of tokens to "
                             "remove (DCPCache.crop also takes the length to keep)")
        if tokens_to_remove:
            self.cumulative_length.sub_(-tokens_to_remove)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        _refuse("reorder_cache (beam search)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        _refuse("batch_repeat_interleave (num_return_sequences > 1, beam search)")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        _refuse("batch_select_indices")


LINEAR_ATTENTION = "linear_attention"
"""transformers' layer type of a linear-attention layer (Kimi-Linear's KDA): its conv and recurrent
state, a fixed size per row, is kept on every rank as transformers keeps it."""


class DCPCache(Cache):
    """A cache for `batch_size` rows of up to `max_length` positions each. `layer_types`: the
    model's (config.layer_types), for a hybrid model; each attention layer takes the next layer of
    `pool`, each linear-attention layer is transformers' own LinearAttentionLayer. Without it,
    transformers' layer i is the pool's layer i. placeholder: no locations of its own (a table of
    zeros, location 0, which writes skip): the static cache a captured graph reads. group: the DCP
    group's agreement (hf/agreement.GroupAgreement), under which the cache takes the same
    locations on every rank (a collective: every rank makes the same caches in the same order)."""

    def __init__(self, pool: MLAKVPool, batch_size: int, max_length: int, layer_types: list[str] | None = None,
                 placeholder: bool = False, group=None):
        kinds = list(layer_types) if layer_types else ["full_attention"] * pool.num_layers
        if sum(kind != LINEAR_ATTENTION for kind in kinds) != pool.num_layers:
            raise ValueError(f"layer types {kinds}: {pool.num_layers} attention layers in the pool")
        if batch_size < 1 or max_length < 1:
            raise ValueError(f"a DCP cache needs batch_size >= 1 and max_length >= 1, got {batch_size} and {max_length}")
        page = pool.page_size
        row = -(-max_length // page) * page  # a row takes whole pages: whole local blocks on every rank
        needed = page + batch_size * row
        if needed > pool.capacity and not placeholder:
            raise ValueError(
                f"{batch_size} rows of {max_length} positions need {needed} KV locations ({reserved(page)}"
                f"{'' if page == 1 else f'; a row takes whole pages of {page}'}); the pool holds {pool.capacity} over "
                f"its {pool.dcp_size} rank(s): pass a larger kv_capacity to dcp_compile.apply, or a smaller batch / "
                "max_length"
            )
        if placeholder:  # a graph's static cache (hf/graphs.py): each replay copies a real cache's table in
            self._finalizer, self._release = None, lambda: None
            host_table = torch.zeros(batch_size, max_length, dtype=torch.int64)
        else:
            locations = allocator(pool)
            allocation, taken = locations.allocate(batch_size * row,
                                                   f"a cache of {batch_size} row(s) of {max_length} positions", group)
            # Given back when the cache is garbage collected (queued: a finalizer may run inside an allocation).
            self._finalizer = weakref.finalize(self, locations.release_later, allocation)
            self._release = lambda: locations.release(allocation)
            host_table = taken.view(batch_size, row)[:, :max_length].contiguous()
        req_to_token = host_table.to(pool.device)
        pads = torch.zeros(batch_size, dtype=torch.int64, device=pool.device)
        layers, attention = [], 0
        for kind in kinds:
            if kind == LINEAR_ATTENTION:
                from transformers.cache_utils import LinearAttentionLayer

                layers.append(LinearAttentionLayer())
            else:
                layers.append(DCPCacheLayer(pool, attention, req_to_token, pads))
                attention += 1
        super().__init__(layers=layers)
        self.pool, self.max_length, self.rows = pool, max_length, batch_size
        self.req_to_token, self.pad_tensor = req_to_token, pads
        self.host_table = host_table
        """req_to_token on the host, for back ends that plan each step there (host_metadata)."""
        self.locations_code = zlib.crc32(host_table.numpy().tobytes()) if not placeholder else 0
        """A checksum of the cache's KV locations, which the DCP peers compare at every step."""
        self._counter = next(layer for layer in layers if isinstance(layer, DCPCacheLayer)).cumulative_length
        self.hybrid = len(layers) > attention
        self.pads = [0] * batch_size
        """Each row's left padding (columns before its first token), set by its first step."""
        self.released = False
        self.placeholder = placeholder
        self.region_step: StepInputs | None = None
        """Inside a step traced with compile regions (hf/regions.py): its write and read, made by
        the first attention layer for every layer."""
        self._length = 0
        """The columns written, on the host: the device counters' mirror (advance())."""
        self._host_view: HostView | None = None

    def set_padding(self, pads: list[int]) -> None:
        """Each row's left padding, before the first step: those columns are never written and
        the row's positions start after them."""
        if self.length():
            raise ValueError("a cache's padding is set by its first step: this one holds tokens already")
        self.pads = list(pads)
        self.pad_tensor.copy_(torch.tensor(self.pads, dtype=torch.int64))

    def length(self) -> int:
        """Columns written so far (every layer alike), kept on the host: reading the device
        counters would wait for the device at every step."""
        return self._length

    def get_seq_length(self, layer_idx: int = 0):
        """Outside the compiled step (transformers' generate() between steps) the host's count: the
        layer's counter is a device tensor, and using it there would wait for the device at every
        token. Inside the step, the counter itself (a graph input, one graph for every length)."""
        layer = self.layers[layer_idx] if layer_idx < len(self.layers) else None
        if isinstance(layer, DCPCacheLayer) and not torch.compiler.is_compiling():
            return self._length
        return super().get_seq_length(layer_idx)

    def advance(self, tokens: int) -> None:
        """A step of `tokens` columns ran (the front end calls it after each step)."""
        self._length += tokens

    def resync(self) -> None:
        """Read the columns written off the device (after a step that failed part-way)."""
        self._length = int(self._counter)

    def reset(self) -> None:
        super().reset()
        self._length = 0

    def crop(self, tokens_to_remove: int) -> None:
        """Drop tokens from the end of every row, as transformers' assisted generation does after
        each verify step: a negative `tokens_to_remove` drops that many columns (0 drops none, and
        trims a linear-attention layer's recorded states, as transformers' crop(0) does); a
        positive one is the length to keep (transformers before 5.18; a cache no longer than that
        is left as it is). Host-side and alike on every rank, with no collective: the next step's
        agreement compares the cache's length (hf/agreement.py). The page table and each row's
        padding stay; a crop to 0 columns also clears the padding (the next first step sets it)."""
        length = self._length
        if tokens_to_remove > 0:
            tokens_to_remove = -max(length - tokens_to_remove, 0)
        removed = -tokens_to_remove
        if removed > length:
            raise ValueError(f"crop({tokens_to_remove}): the cache holds {length} column(s), fewer than the "
                             f"{removed} to remove")
        kept = length - removed
        if 0 < kept < max(self.pads, default=0):
            raise ValueError(f"crop({tokens_to_remove}) keeps {kept} column(s), inside a row's left padding "
                             f"({max(self.pads)} columns): keep at least the padding, or crop to 0")
        if not all(getattr(layer, "record_past", True) for layer in self.layers):
            raise ValueError("a linear-attention layer's state is cropped only while the cache records its past "
                             "(cache.activate_past_recording(), which transformers' assisted generation calls)")
        for layer in self.layers:
            layer.crop(tokens_to_remove)
        self._length = kept
        if kept == 0:
            self.pads = [0] * self.rows
            self.pad_tensor.zero_()

    def activate_past_recording(self, recurrent_states_to_keep: int | None = None, **kwargs) -> None:
        """transformers' past recording, for a hybrid model's linear-attention layers (an attention
        layer's past stays in the pool): each keeps the recurrent state after each of the last
        `recurrent_states_to_keep` + 1 tokens of a step. transformers 5.25 keeps
        `recurrent_states_to_keep` (the draft's length), one short where a step of more tokens
        than that (a verify step: the last accepted token and the draft) has its whole draft
        rejected: its crop then restored the state from before the step, and Kimi-Linear's
        prompt lookup gave other tokens than its plain greedy decoding."""
        if recurrent_states_to_keep:
            recurrent_states_to_keep += 1
        super().activate_past_recording(recurrent_states_to_keep=recurrent_states_to_keep, **kwargs)

    def host_view(self) -> "HostView":
        """The host-side view of this cache's page table that each step's host metadata reads."""
        if self._host_view is None:
            self._host_view = HostView(self)
        return self._host_view

    def release(self) -> None:
        """Give this cache's KV locations back to the pool now (dropping every reference to the
        cache does it too); a released cache serves no more steps."""
        if not self.released:
            self.released = True
            if self._finalizer is not None:
                self._finalizer.detach()
            self._release()

    def attention_layers(self) -> list[DCPCacheLayer]:
        return [layer for layer in self.layers if isinstance(layer, DCPCacheLayer)]


class HostView:
    """What the host metadata of every step over one cache reads, computed once (the page table
    does not change): each position's owner rank, per rank the positions it holds before each
    column (cumulative), and per rank the block tables of the whole table, so that a step's
    metadata costs O(rows x ranks), not O(context) (HostMetadata.from_tensors, the oracle)."""

    def __init__(self, cache: "DCPCache"):
        table, pool = cache.host_table, cache.pool
        rows, width = table.shape
        self.width = width
        self.owners = layout.owner(table, pool.dcp_size, pool.interleave)
        held = torch.stack([self.owners == rank for rank in range(pool.dcp_size)]).to(torch.int32)
        self.before = torch.nn.functional.pad(held.cumsum(dim=2, dtype=torch.int32), (1, 0))
        """[N, B, width + 1]: positions < p of row b that rank r holds."""
        self.tables: dict[int, torch.Tensor | None] = {}
        self.dcp_size, self.interleave, self.page_size = pool.dcp_size, pool.interleave, pool.page_size
        self._table = table
        self._written = torch.full((rows,), 0 if cache.placeholder else width, dtype=torch.int64)
        """Every column of a real cache has its location (a placeholder's table is all location 0)."""

    def block_tables(self, width: int) -> torch.Tensor | None:
        """[N, B, blocks of `width`] int32: every position's block (entries past a row's length are
        never read), or None where pages are not whole local blocks."""
        if width not in self.tables:
            table = torch.nn.functional.pad(self._table, (0, width - self.width))
            full = HostMetadata.from_tensors(table, self._written, torch.zeros(0, dtype=torch.int64), self.dcp_size,
                                             self.interleave, self.page_size)
            self.tables[width] = full.block_tables
        return self.tables[width]


def step_host_metadata(cache: DCPCache, tokens: int, length: int | None = None,
                       width: int | None = None) -> HostMetadata:
    """A step of `tokens` tokens a row over `cache` (after `length` columns, default the cache's),
    as host metadata: each row's queries are its last `tokens` columns, its keys its columns
    written less its padding (a padding column's query token is stored nowhere, owner -1, and
    attends from position 0). width: the page table's width the step's graph reads (default the
    cache's). O(rows x ranks) on the host, from the cache's HostView."""
    length = cache.length() if length is None else length
    view = cache.host_view()
    pads = torch.tensor(cache.pads, dtype=torch.int64)
    seq_lens = (length + tokens - pads).clamp_min(0)
    first = (seq_lens - tokens).clamp_min(0)
    rows = torch.arange(cache.rows)
    local_lens = view.before[:, rows, seq_lens]  # [N, B]
    prefix_lens = view.before[:, rows, first]
    positions = torch.arange(length, length + tokens).unsqueeze(0) - pads.unsqueeze(1)  # [B, T]; < 0 on padding
    owners = torch.where(positions >= 0, view.owners.gather(1, positions.clamp_min(0)), -1)
    return HostMetadata(view.dcp_size, view.interleave, view.page_size, (tokens,) * cache.rows,
                        tuple(map(tuple, local_lens.tolist())), tuple(map(tuple, prefix_lens.tolist())),
                        view.block_tables(width or cache.max_length), tuple(owners.reshape(-1).tolist()))
