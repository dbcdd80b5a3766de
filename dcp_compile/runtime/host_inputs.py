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
  lengths, by argument name), for `NPUGraph.update` before a replay.

The runtime and the graph runner know only this interface; lowering/ implements it. The feed
lives with its compiled graph: nothing is kept once the graph is gone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from dcp_compile.runtime import devices
from dcp_compile.runtime.host_metadata import HostMetadata, RankHostMetadata

HOST_INPUT = "dcp_host_input"
"""Placeholder meta key: the HostInput a host-fed placeholder takes."""

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


def host_placeholders(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op == "placeholder" and HOST_INPUT in n.meta]


def _lengths(host: RankHostMetadata) -> dict[str, tuple[int, ...]]:
    return {"local_len": tuple(host.local_seq_lens), "local_prefix_len": tuple(host.local_prefix_lens),
            "cumulative_query_len": tuple(host.cumulative_query_lens), "query_len": tuple(host.query_lens)}


class HostFeed:
    """Feeds one lowered graph's host-fed placeholders. Lowerings subclass it for host work of
    their own (prepare) and inputs of their own kinds (value); the generic kinds are served here.

    rows: the batch rows the graph was lowered for (host metadata must have as many); by
    default read off its block table, or its per-row lengths."""

    def __init__(self, graph: fx.Graph, dcp_rank: int, rows: int | None = None):
        self.placeholders = host_placeholders(graph)
        self.inputs: list[HostInput] = [n.meta[HOST_INPUT] for n in self.placeholders]
        if rows is None:
            tables = [n.meta["val"].shape[0] for n, i in zip(self.placeholders, self.inputs) if i.kind == "block_table"]
            rows = tables[0] if tables else 1 + max(i.index for i in self.inputs if i.kind in LENGTH_KINDS)
        self.dcp_rank, self.rows = dcp_rank, rows
        self._buffers: dict[int, torch.Tensor] = {}
        self.fed: RankHostMetadata | None = None
        """The host metadata the inputs were last fed from."""

    def rank_view(self, host: HostMetadata | None) -> RankHostMetadata:
        if host is None:
            raise RuntimeError(
                "this graph's attention reads host-side metadata (local lengths, block table): call the model with "
                "host_metadata=batch.host (a ForwardBatch from RequestTable), or with the batch tensors on the CPU"
            )
        if host.rows != self.rows:
            raise ValueError(f"host metadata has {host.rows} rows, the graph was lowered for {self.rows}")
        return host.for_rank(self.dcp_rank)

    def prepare(self, host: RankHostMetadata) -> None:
        """Host work before the graph runs or replays for this step (none by default)."""

    def value(self, host_input: HostInput, host: RankHostMetadata, example):
        """The value of an input of the lowering's own kind."""
        raise ValueError(f"no host value for {host_input} in {type(self).__name__}")

    def values(self, host: RankHostMetadata) -> list:
        """This step's value of every host-fed placeholder, in order. While a device graph is
        being captured, buffers are not copied into (a capture must record no host copy): the
        graph runner feeds every replay before it runs."""
        lengths = _lengths(host)
        values = []
        for i, (node, host_input) in enumerate(zip(self.placeholders, self.inputs)):
            if host_input.kind == "block_table":
                values.append(self._table(i, node, host))
            elif host_input.kind in lengths and host_input.index is None:  # every row's, as one device tensor
                values.append(self._copied(i, node.meta["val"], torch.tensor(lengths[host_input.kind])))
            elif host_input.kind in lengths:
                values.append(lengths[host_input.kind][host_input.index])
            else:
                values.append(self.value(host_input, host, node.meta["val"]))
        self.fed = host
        return values

    def _table(self, i: int, node: fx.Node, host: RankHostMetadata) -> torch.Tensor:
        example = node.meta["val"]
        if host.block_table is None or tuple(host.block_table.shape) != tuple(example.shape):
            raise ValueError(f"the graph reads a {list(example.shape)} block table; host metadata has "
                             f"{None if host.block_table is None else list(host.block_table.shape)}")
        return self._copied(i, example, host.block_table)

    def _copied(self, i: int, example, host_tensor: torch.Tensor) -> torch.Tensor:
        """The device buffer of placeholder i (made once, never moved), with host_tensor copied in."""
        if i not in self._buffers:
            self._buffers[i] = torch.zeros(example.shape, dtype=example.dtype, device=example.device)
        buffer = self._buffers[i]
        if not devices.capturing(buffer.device):
            buffer.copy_(host_tensor, non_blocking=True)
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
        """What a captured NPU graph must be told before a replay (None: nothing)."""
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

    def begin(self, host: HostMetadata | None) -> None:
        self.current, self.fed = host, []

    def end(self) -> None:
        self.current = None

    def feed(self, feed: HostFeed) -> list:
        """Prepare and feed `feed` for the current step; returns its values."""
        host = feed.rank_view(self.current)
        feed.prepare(host)
        if feed not in self.fed:
            self.fed.append(feed)
        return feed.values(host)
