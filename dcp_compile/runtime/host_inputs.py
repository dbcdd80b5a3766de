"""Host-fed graph inputs: the one way values a step computes on the host reach a lowered graph.

A lowering whose kernels plan on the host (a paged kernel that takes its KV lengths as host
lists and reads the KV through a block table, or plans its work on the host) adds placeholders to
the graph, each tagged `meta[HOST_INPUT] = HostInput(kind, index)`, and gives the backend a
`HostFeed` for the graph. Before every run, and before every replay of a captured graph, the
feed is handed the step's host metadata (runtime/host_metadata.py):

- `prepare(host)`: host work for this step (a kernel's plans);
- `values(host)`: the value of each host-fed placeholder, in placeholder order. Lengths are host
  ints; a tensor (the block table) is copied into a device buffer the feed owns and never moves,
  so a captured graph reads this step's table when it is replayed;
- `graph_updates(host)`: the host values an NPU graph bakes in at capture (a kernel's host
  lengths, by argument name), one entry per such kernel call of the graph, for `NPUGraph.update`
  before a replay. A device graph captured of a step records the calls of every graph the step
  ran, run after run (a compile region's graph once per call of the region), and takes one entry
  per recorded call in that order: the step's `HostSlot.runs` lays them out;
- `unread_inputs()`: the batch inputs (ForwardBatch fields, by the `BATCH_INPUT` mark the
  lowering puts on their placeholders) that the lowered graph does not read: a graph runner does
  not copy them before a replay.

Tensors reach the device through pinned staging buffers (`PinnedStaging`): no copy a feed or the
graph runner makes before a replay syncs the host with the device (why two slots of staging
buffers suffice, and what happens when they do not: PinnedStaging).

The runtime and the graph runner know only this interface; lowering/ implements it. The feed
lives with its compiled graph: nothing is kept once the graph is gone.
"""

from __future__ import annotations

import collections
import contextlib
import logging
from dataclasses import dataclass

import torch
import torch.fx as fx

from dcp_compile.runtime import devices
from dcp_compile.runtime.host_metadata import HostMetadata, RankHostMetadata

log = logging.getLogger("dcp_compile.runtime")

HOST_INPUT = "dcp_host_input"
"""Placeholder meta key: the HostInput a host-fed placeholder takes."""

CAPTURE_SKIPPED = "dcp_capture_skipped"
"""Node meta key: a node that does nothing while a device graph is captured (a debug check that
reads the device), so a replay runs nothing of it."""
BATCH_INPUT = "dcp_batch_input"
"""Placeholder meta key: the ForwardBatch field (e.g. "req_to_token") a batch-input placeholder of
a lowered graph takes, set by the lowering on the placeholders it knows. `HostFeed.unread_inputs`
reports those with no users in the lowered graph."""

LENGTH_KINDS = ("local_len", "local_prefix_len", "cumulative_query_len", "query_len")
"""Host-list kinds every feed serves (one int per batch row each)."""


@dataclass(frozen=True)
class HostInput:
    kind: str
    """'block_table' (this rank's [B, W] int32 local block ids), one of LENGTH_KINDS, or a kind
    of the lowering's own that its feed serves (HostFeed.value)."""
    index: int | None = None
    """The row, for a length (a host int); None: every row's length, as one device tensor [B]."""


class StaleHostInputsError(RuntimeError):
    """A replay would read host inputs fed for another step (debug mode)."""


class _StagingSlot:
    """Pinned host buffers (by key) for one step's copies, and the event recorded after them."""

    def __init__(self):
        self.buffers: dict = {}
        self.event = None
        self.device: torch.device | None = None

    def buffer(self, key, like: torch.Tensor) -> torch.Tensor:
        buffer = self.buffers.get(key)
        if buffer is None or buffer.shape != like.shape or buffer.dtype != like.dtype:
            buffer = torch.empty(like.shape, dtype=like.dtype, pin_memory=True)
            self.buffers[key] = buffer
        return buffer


class StagedCopies:
    """One step's copies into device buffers (`PinnedStaging.step()`)."""

    def __init__(self, staging: "PinnedStaging"):
        self._staging = staging
        self.slot: _StagingSlot | None = None
        """The slot of pinned buffers this step writes, taken at its first host-to-device copy
        (none is taken, and no event queried, in a step that makes none: a CUDA capture forbids
        event queries)."""
        self.h2d_bytes = 0
        """Bytes this step copied host-to-device."""

    def copy(self, key, target: torch.Tensor, source: torch.Tensor) -> int:
        """Enqueue `target.copy_(source)` without a host sync; returns the bytes copied
        host-to-device. A host source is written into the slot's pinned buffer `key` first (a host
        memcpy) and copied from there; a source already on the device is copied device-to-device.
        A source of fewer rows than `target` fills its first rows, and the rest are zeroed on the
        device (only the rows given cross to the device)."""
        rows = source.shape[0] if source.dim() and source.shape != target.shape else None
        head = target if rows is None else target[:rows]
        if target.device.type in ("cpu", "meta") or source.device.type != "cpu":  # meta: a shape-only graph's
            head.copy_(source, non_blocking=target.device.type not in ("cpu", "meta"))
            copied = 0
        else:
            if self.slot is None:
                self.slot = self._staging._take()
            staging = self.slot.buffer(key, target)
            staged = staging if rows is None else staging[:rows]
            staged.copy_(source)
            head.copy_(staged, non_blocking=True)
            if self.slot.event is None:
                self.slot.event, self.slot.device = getattr(torch, target.device.type).Event(), target.device
            copied = staged.nbytes
        if rows is not None:
            target[rows:].zero_()
        self.h2d_bytes += copied
        return copied


class PinnedStaging:
    """Host-to-device copies into fixed device buffers with no host sync.

    A copy from pageable host memory syncs the host with the stream (the device copies it through
    a staging buffer of its own and waits, or synchronises the stream after it: docs/ascend.md
    §17). A copy from pinned memory is a DMA
    that the stream runs in its turn. So every copy goes through a pinned staging buffer: the host
    writes the step's value into it (a memcpy), then enqueues `target.copy_(staging,
    non_blocking=True)`.

    The host must not write a staging buffer again while a copy enqueued from it may still be
    pending. Buffers come in slots, one slot per step (`with staging.step() as copies:
    copies.copy(key, target, source)`), and an event is recorded on the stream after a step's
    copies. A step takes the least recently used
    slot if its event has completed (`Event.query()`, which does not block), else a new slot, up
    to `max_slots`; only past that does it wait for the oldest slot's event (counted in `waits`).

    Why two slots (double buffering) are normally enough: step N's copies from slot A are
    enqueued before step N's replay, on the same stream; slot A is next written at step N+2.
    Whatever the host waits for of step N (its sampled tokens, read back before it schedules step
    N+2, even where it schedules step N+1 while step N runs; the graph's previous replay, which
    a graph update waits for) comes after the copies from A in stream order, so they have
    completed. The event query checks this instead of assuming it: a host that runs further
    ahead of the device gets more slots, never a buffer overwritten under a pending copy.
    """

    def __init__(self, slots: int = 2, max_slots: int = 4):
        if not 1 <= slots <= max_slots:
            raise ValueError(f"need 1 <= slots <= max_slots, got {slots}, {max_slots}")
        self.max_slots = max_slots
        self._slots: collections.deque[_StagingSlot] = collections.deque(_StagingSlot() for _ in range(slots))
        """Least recently used first."""
        self.waits = 0
        """Steps that found every slot's copies pending, with max_slots slots, and waited."""

    def __len__(self) -> int:
        return len(self._slots)

    def _take(self) -> _StagingSlot:
        slot = self._slots[0]
        if slot.event is None or slot.event.query():
            self._slots.popleft()
        elif len(self._slots) < self.max_slots:
            slot = _StagingSlot()
        else:  # the host is max_slots steps ahead of the device's copies: wait for the oldest
            self.waits += 1
            if self.waits == 1:
                log.warning("pinned staging: the host ran %d steps ahead of the device's copies; waiting",
                            self.max_slots)
            slot.event.synchronize()
            self._slots.popleft()
        slot.event = None
        return slot

    @contextlib.contextmanager
    def step(self):
        """One step's copies (`copies.copy(key, target, source)`); on leaving, the event after
        them is recorded on the current stream, and their slot goes last in line for reuse."""
        copies = StagedCopies(self)
        try:
            yield copies
        finally:
            slot = copies.slot
            if slot is not None:
                if slot.event is not None:
                    slot.event.record(getattr(torch, slot.device.type).current_stream(slot.device))
                self._slots.append(slot)


def host_placeholders(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op == "placeholder" and HOST_INPUT in n.meta]


def _lengths(host: RankHostMetadata) -> dict[str, tuple[int, ...]]:
    return {"local_len": tuple(host.local_seq_lens), "local_prefix_len": tuple(host.local_prefix_lens),
            "cumulative_query_len": tuple(host.cumulative_query_lens), "query_len": tuple(host.query_lens)}


class HostFeed:
    """Feeds one lowered graph's host-fed placeholders. Lowerings subclass it for host work of
    their own (prepare) and inputs of their own kinds (value); the generic kinds are served here.

    rows: the batch rows the graph was lowered for (host metadata must have as many); by
    default read off its block table, or its per-row lengths; None where neither fixes them (a
    graph symbolic in the batch shape)."""

    def __init__(self, graph: fx.Graph, dcp_rank: int, rows: int | None = None):
        self.placeholders = host_placeholders(graph)
        self.inputs: list[HostInput] = [n.meta[HOST_INPUT] for n in self.placeholders]
        if rows is None:
            tables = [n.meta["val"].shape[0] for n, i in zip(self.placeholders, self.inputs) if i.kind == "block_table"]
            indices = [i.index for i in self.inputs if i.kind in LENGTH_KINDS and i.index is not None]
            rows = tables[0] if tables else 1 + max(indices) if indices else None
            if isinstance(rows, torch.SymInt):
                rows = None
        self.graph, self.dcp_rank, self.rows = graph, dcp_rank, rows
        self._buffers: dict[int, torch.Tensor] = {}
        self._staging = PinnedStaging()
        self.fed: RankHostMetadata | None = None
        """The host metadata the inputs were last fed from."""
        self.h2d_bytes = 0
        """Bytes the last values() call copied host-to-device (the block tables)."""
        self.read_elsewhere: frozenset[str] = frozenset()
        """Batch inputs the step reads outside this graph (the graph is a compile region's and
        the code around it reads them, dcp_compile/regions.py): never reported unread."""

    def unread_inputs(self) -> frozenset[str]:
        """The batch inputs (ForwardBatch field names) whose placeholders, marked
        `meta[BATCH_INPUT]` by the lowering, no node of a replayed graph reads: none but the
        debug checks marked `meta[CAPTURE_SKIPPED]` (they read the device only outside a capture,
        so a captured graph holds nothing of them). A graph runner need not copy them before a
        replay. Unmarked placeholders are taken as read."""
        return frozenset(n.meta[BATCH_INPUT] for n in self.graph.nodes
                         if n.op == "placeholder" and BATCH_INPUT in n.meta
                         and all(user.meta.get(CAPTURE_SKIPPED) for user in n.users)) - self.read_elsewhere

    def rank_view(self, host: HostMetadata | None) -> RankHostMetadata:
        if host is None:
            raise RuntimeError(
                "this graph's attention reads host-side metadata (local lengths, block table): call the model with "
                "host_metadata=batch.host (a ForwardBatch from RequestTable), or with the batch tensors on the CPU"
            )
        if self.rows is not None and host.rows != self.rows:
            raise ValueError(f"host metadata has {host.rows} rows, the graph was lowered for {self.rows}")
        return host.for_rank(self.dcp_rank)

    def prepare(self, host: RankHostMetadata) -> None:
        """Host work before the graph runs or replays for this step (none by default)."""

    def share(self, earlier: list["HostFeed"]) -> None:
        """Feeds of other graphs that run in every step this one runs in (the compile regions of
        one step, dcp_compile/regions.py), made before it: a lowering whose host work they can
        share takes it from them (none by default)."""

    def lists(self, host: RankHostMetadata) -> dict[str, list[int]]:
        """Host lists of the lowering's own kinds, served as the generic ones are: an element by
        index as a host int, or the whole list as one device tensor (index None)."""
        return {}

    def value(self, host_input: HostInput, host: RankHostMetadata, example):
        """The value of an input of the lowering's own kind."""
        raise ValueError(f"no host value for {host_input} in {type(self).__name__}")

    def values(self, host: RankHostMetadata) -> list:
        """This step's value of every host-fed placeholder, in order. While a device graph is
        being captured, buffers are not copied into (a capture must record no host copy): the
        graph runner feeds every replay before it runs."""
        lengths = {**_lengths(host), **self.lists(host)}
        values = []
        with self._staging.step() as copies:
            for i, (node, host_input) in enumerate(zip(self.placeholders, self.inputs)):
                if host_input.kind == "block_table":
                    values.append(self._table(i, node, host, copies))
                elif host_input.kind in lengths and host_input.index is None:  # every row's, as one device tensor
                    values.append(self._copied(i, node.meta["val"], torch.tensor(lengths[host_input.kind]), copies))
                elif host_input.kind in lengths:
                    values.append(lengths[host_input.kind][host_input.index])
                else:
                    values.append(self.value(host_input, host, node.meta["val"]))
        self.h2d_bytes = copies.h2d_bytes
        self.fed = host
        return values

    def _table(self, i: int, node: fx.Node, host: RankHostMetadata, copies: StagedCopies) -> torch.Tensor:
        example = node.meta["val"]
        if host.block_table is None or tuple(host.block_table.shape) != tuple(example.shape):
            raise ValueError(f"the graph reads a {list(example.shape)} block table; host metadata has "
                             f"{None if host.block_table is None else list(host.block_table.shape)}")
        return self._copied(i, example, host.block_table, copies)

    def _copied(self, i: int, example, host_tensor: torch.Tensor, copies: StagedCopies) -> torch.Tensor:
        """The device buffer of placeholder i (made once, never moved), with host_tensor copied in."""
        if i not in self._buffers:
            self._buffers[i] = torch.zeros(example.shape, dtype=example.dtype, device=example.device)
        buffer = self._buffers[i]
        if not devices.capturing(buffer.device):
            copies.copy(i, buffer, host_tensor)  # through pinned memory: no host sync
        return buffer

    def examples(self) -> list:
        """Example values of the host-fed inputs for an inner compiler: the lengths as the
        SymInts the lowering made them (symbolic, so a compiler that captures NPU graphs
        refreshes them instead of baking them in), and the buffers themselves."""
        if self.fed is None:
            raise RuntimeError("HostFeed.examples() needs a values() call first (the buffers are made there)")
        return [node.meta["val"] if isinstance(node.meta["val"], torch.SymInt) else value
                for node, value in zip(self.placeholders, self.values(self.fed))]

    def graph_updates(self, host: RankHostMetadata) -> list[dict] | None:
        """What a captured NPU graph must be told before a replay, for one run of this graph: an
        entry per kernel call that bakes in host values, in graph order (None: nothing)."""
        return None

    def check_fed(self, host: RankHostMetadata) -> None:
        """Debug mode, before a replay: raise unless the inputs were fed from this step's metadata."""
        if self.fed is None or _lengths(self.fed) != _lengths(host) or not _same_table(self.fed, host):
            raise StaleHostInputsError(
                "a captured graph's host inputs were not fed for this step: it would replay another step's lengths "
                "or block table")


def _same_table(a: RankHostMetadata, b: RankHostMetadata) -> bool:
    if a.block_table is None or b.block_table is None:
        return a.block_table is b.block_table
    return torch.equal(a.block_table, b.block_table)


class HostSlot:
    """The host metadata of the step being run, set by the compiled model (or a graph runner)
    around each call, and the feeds of the graphs that ran in it (the runner keeps those of a
    captured step, to feed before every replay). Steps run one at a time per model."""

    def __init__(self, dcp_rank: int = 0):
        self.dcp_rank = dcp_rank
        self.current: HostMetadata | None = None
        self.fed: list[HostFeed] = []
        self.runs: list[HostFeed] = []
        """The feed of every graph run of the step, in the order they ran: a compile region's once
        per call of the region (a step of a dense layer and then MoE layers runs the dense kind's
        graph, then the MoE kind's, again and again). A device graph captured of the step recorded
        their kernels in this order, and takes their `graph_updates` so laid out."""

    def begin(self, host: HostMetadata | None) -> None:
        self.current, self.fed, self.runs = host, [], []

    def ran(self, feed: HostFeed) -> None:
        """`feed`'s graph runs now, in the current step (called at each run, as it starts)."""
        self.runs.append(feed)

    def end(self) -> None:
        self.current = None

    def feed(self, feed: HostFeed) -> list:
        """Prepare and feed `feed` for the current step; returns its values."""
        host = feed.rank_view(self.current)
        feed.prepare(host)
        if feed not in self.fed:
            self.fed.append(feed)
        return feed.values(host)
