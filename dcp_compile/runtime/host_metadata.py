"""Host-side local attention metadata: each DCP rank's local lengths and local block tables.

Kernels that plan on the host need these before a step: Ascend's paged attention takes its KV
lengths as a host list (SymInt[]) and reads the KV through a block table, and other paged kernels
plan their work on the host (docs/paged-lowerings.md). The in-graph `dcp::local_metadata`
derives the same view on the device, which serves the kernels that need no host values.

`RequestTable` keeps this incrementally (O(tokens appended or released) per step, no device
sync). `HostMetadata.from_tensors` computes it from CPU batch tensors in O(context): for
schedulers of their own, and as the oracle the incremental version is tested against.
"""

from __future__ import annotations

import itertools
import zlib
from dataclasses import dataclass, field

import torch
from torch.utils.weak import WeakIdKeyDictionary

from dcp_compile.runtime import layout

def block_table_width(max_context: int, page_size: int) -> int:
    """Local blocks a request can hold on one rank: at most one per logical page."""
    return -(-max_context // page_size)


@dataclass(frozen=True)
class RankHostMetadata:
    """One DCP rank's view of a batch of B rows."""

    query_lens: tuple[int, ...]
    """Query tokens of each row (tokens are grouped by row, in row order)."""
    local_seq_lens: tuple[int, ...]
    """Keys of each row stored on this rank, this step's included."""
    local_prefix_lens: tuple[int, ...]
    """Keys of each row on this rank at positions before the row's first query."""
    block_table: torch.Tensor | None
    """[B, W] int32 local block ids in position order (host); None if pages are not block-aligned.
    Entries past a row's last used block are not read."""
    query_owned: tuple[bool, ...] | None = None
    """Per query token, whether this rank stores its KV (None: not known)."""

    @property
    def cumulative_query_lens(self) -> list[int]:
        return list(itertools.accumulate(self.query_lens))


class StaleHostMetadataError(ValueError):
    """Host metadata given with a batch it was not built for, or a batch changed after it was."""


_SERIALS = itertools.count(1)
_BOUND: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""Batch tensor -> (serial of the HostMetadata built for it, the tensor's version then, its
fingerprint then)."""
_METADATA_INPUTS = ("req_to_token", "seq_lens", "q_seq_ids")
"""The tensors of a step (by the model's attention_metadata() names) that host metadata is made
from: each must be one it was bound to."""


def fingerprint(tensor: torch.Tensor) -> int | None:
    """A checksum of a host tensor's contents, which catches the writes its version counter does
    not see (through .numpy() or .data); None for a device tensor (reading it would sync) and for
    a 2-D CPU tensor of a batch (the page table, [rows, max_context]: too large to read every step,
    so only its version is checked). crc32 reads about 3 GB/s."""
    if tensor.device.type != "cpu" or tensor.dim() > 1:
        return None
    return _crc(tensor)


@dataclass(frozen=True)
class HostMetadata:
    """A batch's host-side local metadata for every rank of the DCP group.

    It is bound to the tensors of the batch it describes (`bind`; RequestTable's batches and
    from_tensors bind theirs, ForwardBatch.to and padded bind the copies they make), and a
    compiled model checks the binding on the host before each step (`check_batch`): metadata
    of another step, a copy with changed lengths or tables, or a batch tensor changed in place
    after the metadata was built would make a paged kernel read wrong keys without any error.
    """

    dcp_size: int
    interleave: int
    page_size: int
    query_lens: tuple[int, ...]
    local_seq_lens: tuple[tuple[int, ...], ...]
    """[N][B]"""
    local_prefix_lens: tuple[tuple[int, ...], ...]
    """[N][B]"""
    block_tables: torch.Tensor | None
    """[N, B, W] int32 on the host."""
    query_owners: tuple[int, ...] | None = None
    """Per query token, the rank that stores its KV (-1: a padding token, stored nowhere); None:
    not known."""
    serial: int = field(init=False, compare=False, repr=False)
    """This object's identity in batch bindings: a copy made with dataclasses.replace gets a new one."""
    _table_version: int = field(init=False, compare=False, repr=False)
    _table_fingerprint: int | None = field(init=False, compare=False, repr=False)
    max_block: int = field(init=False, compare=False, repr=False)
    """The largest local block id in the block tables (-1 without any): what a paged kernel may read."""

    def __post_init__(self):
        object.__setattr__(self, "serial", next(_SERIALS))
        tables = self.block_tables
        object.__setattr__(self, "_table_version", tables._version if tables is not None else 0)
        object.__setattr__(self, "_table_fingerprint", _table_fingerprint(tables))
        object.__setattr__(self, "max_block", -1)
        if tables is not None and tables.numel():
            object.__setattr__(self, "max_block", int(tables.max()))
            block_size = layout.local_block_size(self.page_size, self.dcp_size, self.interleave)
            cover = tables.shape[-1] * block_size
            longest = max((max(lens, default=0) for lens in self.local_seq_lens), default=0)
            if longest > cover or int(tables.min()) < 0:
                raise ValueError(f"host block tables of {tables.shape[-1]} blocks of {block_size} cover {cover} local keys "
                                 f"a row, with ids >= 0; a local length is {longest}, the smallest id {int(tables.min())}")

    def bind(self, *tensors: torch.Tensor) -> "HostMetadata":
        """Declare `tensors` (as they are now) the batch this metadata describes."""
        for tensor in tensors:
            _BOUND[tensor] = (self.serial, tensor._version, fingerprint(tensor))
        return self

    def check_batch(self, tensors, metadata_inputs: dict | None = None) -> None:
        """Raise StaleHostMetadataError unless this metadata was built for these batch tensors and
        neither they nor its block tables changed since. `metadata_inputs` (the model's
        attention_metadata() of the step, where it has one) names the tensors it is made from:
        each of those must be one it was bound to, not a replacement. O(tensors) on the host, and
        O(size) of its block tables and of the batch's 1-D host tensors (fingerprint); no device
        sync."""
        bound = False
        for tensor in tensors:
            binding = _BOUND.get(tensor)
            if binding is None:
                continue
            serial, version, content = binding
            if serial != self.serial:
                raise StaleHostMetadataError(
                    "stale host metadata: host_metadata belongs to another batch (a previous step's, or a copy with "
                    "changed lengths or tables); pass the host metadata of this step's batch (batch.host)")
            if tensor._version != version or content is not None and fingerprint(tensor) != content:
                raise StaleHostMetadataError(
                    "stale host metadata: a batch tensor was changed in place after its host metadata was built; build "
                    "the batch again (RequestTable.extend_batch) instead of editing it")
            bound = True
        if not bound:
            raise StaleHostMetadataError(
                "stale host metadata: host_metadata was not built for this batch's tensors; pass batch.host with "
                "batch.args() (a ForwardBatch from RequestTable), or HostMetadata.from_tensors(...) of these tensors, "
                "or declare them with host.bind(...)")
        for name in _METADATA_INPUTS:
            tensor = (metadata_inputs or {}).get(name)
            if isinstance(tensor, torch.Tensor) and _BOUND.get(tensor) is None:
                raise StaleHostMetadataError(
                    f"stale host metadata: this step's {name} is not a tensor host_metadata was built for (a replaced "
                    "or cloned batch tensor); build the batch again, or bind the new tensors with host.bind(...)")
        tables = self.block_tables
        if tables is not None and (tables._version != self._table_version
                                   or _table_fingerprint(tables) != self._table_fingerprint):
            raise StaleHostMetadataError("stale host metadata: its block tables were changed in place after it was built")

    @property
    def rows(self) -> int:
        return len(self.query_lens)

    def for_rank(self, rank: int) -> RankHostMetadata:
        table = self.block_tables[rank] if self.block_tables is not None else None
        owned = None if self.query_owners is None else tuple(owner == rank for owner in self.query_owners)
        return RankHostMetadata(self.query_lens, self.local_seq_lens[rank], self.local_prefix_lens[rank], table, owned)

    @classmethod
    def empty_like(cls, host: "HostMetadata", width: int) -> "HostMetadata":
        """No rows, in host's layout, for a page table `width` wide (padded(), a capture batch)."""
        empty = ((),) * host.dcp_size
        tables = None
        if host.block_tables is not None:
            tables = torch.zeros(host.dcp_size, 0, block_table_width(width, host.page_size), dtype=torch.int32)
        return cls(host.dcp_size, host.interleave, host.page_size, (), empty, empty, tables, ())

    def padded(self, rows: int, tokens_per_row: int) -> "HostMetadata":
        """Grown to `rows` rows; padded rows have `tokens_per_row` queries and no key."""
        extra = rows - self.rows
        if extra < 0:
            raise ValueError(f"cannot pad host metadata of {self.rows} rows to {rows}")
        zeros = (0,) * extra
        tables = self.block_tables
        if tables is not None:
            tables = torch.cat([tables, tables.new_zeros(tables.shape[0], extra, tables.shape[2])], dim=1)
        return HostMetadata(
            self.dcp_size, self.interleave, self.page_size, self.query_lens + (tokens_per_row,) * extra,
            tuple(lens + zeros for lens in self.local_seq_lens), tuple(lens + zeros for lens in self.local_prefix_lens),
            tables, None if self.query_owners is None else self.query_owners + (-1,) * (extra * tokens_per_row),
        )

    @classmethod
    def from_tensors(cls, req_to_token: torch.Tensor, seq_lens: torch.Tensor, q_seq_ids: torch.Tensor,
                     dcp_size: int, interleave: int, page_size: int) -> "HostMetadata":
        """From CPU batch tensors, in O(context). Queries of row b must be its last
        query_lens[b] positions, grouped by row in row order (as RequestTable builds them)."""
        for name, t in (("req_to_token", req_to_token), ("seq_lens", seq_lens), ("q_seq_ids", q_seq_ids)):
            if t.device.type != "cpu":
                raise ValueError(
                    f"host metadata is built from CPU tensors, but {name} is on {t.device}: pass the "
                    "ForwardBatch's host metadata (RequestTable keeps it) instead of recomputing it"
                )
        batch, width = req_to_token.shape
        if q_seq_ids.numel() and (int(q_seq_ids.min()) < 0 or int(q_seq_ids.max()) >= batch):
            raise ValueError(f"q_seq_ids must lie in [0, {batch})")
        if q_seq_ids.numel() > 1 and bool((q_seq_ids[1:] < q_seq_ids[:-1]).any()):
            raise ValueError("host metadata needs query tokens grouped by row, in row order")
        query_lens = torch.bincount(q_seq_ids, minlength=batch).tolist()
        first_query = (seq_lens - torch.tensor(query_lens, dtype=seq_lens.dtype)).clamp_min(0)
        block_size = layout.local_block_size(page_size, dcp_size, interleave)
        blocks = block_table_width(width, page_size)
        tables = torch.zeros(dcp_size, batch, blocks, dtype=torch.int32) if block_size else None
        local_lens, prefix_lens = [], []
        for rank in range(dcp_size):
            rows, lens, positions = layout.local_view(req_to_token, seq_lens, rank, dcp_size, interleave)
            valid = torch.arange(width)[None, :] < lens[:, None]
            local_lens.append(tuple(lens.tolist()))
            prefix_lens.append(tuple((valid & (positions < first_query[:, None])).sum(dim=1).tolist()))
            if tables is not None:
                tables[rank] = _blocks_of(rows, lens, block_size, blocks)
        row_start = torch.cumsum(torch.tensor([0] + query_lens[:-1]), 0)
        if q_seq_ids.numel():
            positions = first_query[q_seq_ids] + torch.arange(q_seq_ids.numel()) - row_start[q_seq_ids]
            locations = req_to_token[q_seq_ids, positions.clamp(0, max(width - 1, 0))]
            owners = torch.where(locations == layout.PADDING_LOC, -1, layout.owner(locations, dcp_size, interleave))
        else:
            owners = torch.zeros(0, dtype=torch.int64)
        host = cls(dcp_size, interleave, page_size, tuple(query_lens), tuple(local_lens), tuple(prefix_lens), tables,
                   tuple(owners.tolist()))
        return host.bind(req_to_token, seq_lens, q_seq_ids)


def _crc(tensor: torch.Tensor) -> int:
    return zlib.crc32(tensor.detach().contiguous().view(-1).view(torch.uint8).numpy())


def _table_fingerprint(tables: torch.Tensor | None) -> int | None:
    return None if tables is None else _crc(tables)


def _blocks_of(local_rows: torch.Tensor, local_lens: torch.Tensor, block_size: int, blocks: int) -> torch.Tensor:
    """Local block ids of each row's local rows; raises if the rows are not whole aligned blocks."""
    cover = blocks * block_size
    if bool((local_lens > cover).any()):
        raise ValueError(f"a row holds more local keys than {blocks} blocks of {block_size}")
    width = local_rows.shape[1]
    rows = torch.nn.functional.pad(local_rows, (0, cover - width)) if cover > width else local_rows[:, :cover]
    table = rows[:, ::block_size] // block_size
    column = torch.arange(cover)
    expected = table.repeat_interleave(block_size, dim=1) * block_size + column % block_size
    valid = column[None, :] < local_lens[:, None]
    if bool((valid & (expected != rows)).any()):
        raise ValueError("the page table's local rows do not form whole, aligned local blocks")
    used = torch.arange(blocks)[None, :] * block_size < local_lens[:, None]
    return torch.where(used, table, 0).to(torch.int32)


class HostMetadataSource:
    """Each step's host metadata for a compiled model whose kernels read it: the metadata the
    caller passes (checked on the host: bound to this batch, built for this layout, its block
    ids inside the pool), or, where the caller passes none, computed from the batch's CPU
    tensors through the model's attention_metadata()."""

    def __init__(self, dcp_size: int, interleave: int, page_size: int, rows_per_rank: int, reader: str):
        self.dcp_size, self.interleave, self.page_size, self.reader = dcp_size, interleave, page_size, reader
        self.block_size = layout.local_block_size(page_size, dcp_size, interleave)
        self.blocks = rows_per_rank // self.block_size if self.block_size else None

    def for_step(self, model, args, kwargs, host: HostMetadata | None) -> HostMetadata:
        if host is None:
            metadata = getattr(model, "attention_metadata", None)
            if metadata is None:
                raise ValueError(
                    f"{self.reader} needs the batch's host-side metadata: pass host_metadata=batch.host (a ForwardBatch "
                    "from RequestTable), or give the model an attention_metadata() method (README, model contract)"
                )
            meta = metadata(*args, **kwargs)
            host = HostMetadata.from_tensors(meta["req_to_token"], meta["seq_lens"], meta["q_seq_ids"],
                                             self.dcp_size, self.interleave, self.page_size)
        else:
            metadata = getattr(model, "attention_metadata", None)
            host.check_batch([a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)],
                             metadata(*args, **kwargs) if metadata is not None else None)
        expected = (self.dcp_size, self.interleave, self.page_size)
        if (host.dcp_size, host.interleave, host.page_size) != expected:
            raise ValueError(
                f"host metadata was built for dcp_size {host.dcp_size}, interleave {host.interleave}, page size "
                f"{host.page_size}; this model has {expected[0]}, {expected[1]}, {expected[2]}: build the RequestTable "
                "with the model's dcp_size, interleave and page size"
            )
        if self.blocks is not None and host.max_block >= self.blocks:
            raise IndexError(f"the host block tables name local block {host.max_block}, but a rank's KV shard holds "
                             f"{self.blocks} blocks of {self.block_size}: the request table hands out locations past the "
                             "pool (build it with the pool's capacity)")
        return host
