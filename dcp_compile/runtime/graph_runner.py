"""Graph capture and replay of decode / verify steps, per batch bucket and tokens per row, on CUDA
graphs or Ascend NPU graphs.

The runner owns static input buffers, one set per (bucket, tokens per row, page-table width),
allocated once at capture and refreshed in place before every replay; a captured buffer is
never reallocated. Batches are padded to the bucket with rows that write to location 0 and see
no key. Graphs are captured on a fully padded batch, so capture itself writes no KV and touches
no request state. A batch larger than the largest bucket runs eagerly, with one warning.

Graphs whose kernels read host-fed inputs (runtime/host_inputs.py) keep their feeds: before
every replay the runner feeds each from the step's host metadata (host work such as plans, and
tensors copied into the buffers the captured graph reads), and hands a back end what it must be
told (an NPU graph's host lengths, for `NPUGraph.update`). In debug mode it checks that every
feed was fed for this step and that no captured address moved, and it runs the metadata check
that the captured graph's own debug checks cannot run inside a capture (they read the device).

No host sync in a replayed step's copies: host tensors reach the static buffers
through pinned staging buffers (runtime/host_inputs.PinnedStaging), tensors already on the device
are copied device-to-device, and a batch input that no graph of the captured step reads (every
feed's `unread_inputs()`) is not copied at all. `h2d_last_step` says what the last replay copied
host-to-device, by input. (The graph back end's own waits are its concern: NPUGraphs waits for a
graph's previous replay before it updates the graph's host lengths.)
"""

from __future__ import annotations

import bisect
import logging
import time
import warnings
from dataclasses import fields

import torch

from dcp_compile.runtime.batch import ForwardBatch
from dcp_compile.runtime.devices import require_torch_npu
from dcp_compile.runtime.failure import FailureLatch
from dcp_compile.runtime.host_inputs import HostFeed, HostSlot, PinnedStaging
from dcp_compile.runtime.host_metadata import HostMetadata

log = logging.getLogger("dcp_compile.runtime")
DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
BATCH_FIELDS = tuple(f.name for f in fields(ForwardBatch) if f.name != "host")
"""ForwardBatch's tensor fields, in args() order: the names HostFeed.unread_inputs() reports."""
FEEDS = "feeds"
"""The key of GraphRunner.h2d_last_step for what the feeds copied (block tables)."""


class StaleAddressError(RuntimeError):
    pass


class StaleHostLengthsError(RuntimeError):
    pass


class _DeviceGraphs:
    """Capture on a side stream after two warm-up runs, into one memory pool. `backend_name`
    names the torch device module (torch.cuda, torch.npu), `graph_class` its graph type."""

    backend_name = graph_class = ""
    capture_options: dict = {}

    def __init__(self):
        self.backend = getattr(torch, self.backend_name)
        self.device = torch.device(self.backend_name, self.backend.current_device())
        self.pool = self.backend.graph_pool_handle()

    def synchronize(self) -> None:
        self.backend.synchronize()

    def capture(self, run, prepare=None):
        """(graph, output) of `run` captured; `prepare`, if given, runs before each warm-up and
        before the capture, outside it (state the runs change, reset)."""
        stream = self.backend.Stream()
        stream.wait_stream(self.backend.current_stream())
        with self.backend.stream(stream):
            for _ in range(2):
                if prepare is not None:
                    prepare()
                run()
            if prepare is not None:
                prepare()
        self.backend.current_stream().wait_stream(stream)
        graph = getattr(self.backend, self.graph_class)()
        with self.backend.graph(graph, pool=self.pool, **self.capture_options):
            output = run()
        return graph, output


class CudaGraphs(_DeviceGraphs):
    """CUDA graphs: collectives and kernels replay as captured; nothing is host-fed."""

    backend_name, graph_class = "cuda", "CUDAGraph"

    def __init__(self):
        if not torch.cuda.is_available():
            raise RuntimeError("GraphRunner needs a CUDA GPU for CUDA graphs; on CPU call the model directly")
        super().__init__()

    def replay(self, graph, updates) -> None:
        graph.replay()

    def applied(self, graph):
        return None


class NPUGraphs(_DeviceGraphs):
    """Ascend NPU graphs (torch.npu.NPUGraph). Capture records ops whose host inputs it bakes in
    with `auto_dispatch_capture`; each replay first pushes the step's values of those with
    `NPUGraph.update(cpu_update_input=...)`, one dict per recorded call (docs/ascend.md §9.3).
    An update under a running replay races it, so it is ordered after the graph's previous replay
    on the device, not on the host: torch_npu issues updates on the stream shared by all graphs,
    `graph.graph_dispatch_mode.update_stream` (torch_npu/npu/graphs.py:430-435, 554), which
    first waits on an event recorded after that replay, as torchair orders its updates
    (docs/ascend.md §17). A replayed step has no host sync."""

    backend_name, graph_class = "npu", "NPUGraph"
    capture_options = {"auto_dispatch_capture": True}

    def __init__(self):
        require_torch_npu("NPU graphs")
        super().__init__()
        self._applied: dict[int, list] = {}
        self._finished: dict[int, object] = {}
        """Per graph: an event recorded after its last replay."""

    def replay(self, graph, updates) -> None:
        if updates:
            finished = self._finished.get(id(graph))
            if finished is not None:
                graph.graph_dispatch_mode.update_stream.wait_event(finished)
            graph.update(cpu_update_input=updates)
            self._applied[id(graph)] = updates
        graph.replay()
        event = self.backend.Event()
        event.record()
        self._finished[id(graph)] = event

    def applied(self, graph):
        return self._applied.get(id(graph))

    def capture(self, run, prepare=None):
        try:
            return super().capture(run, prepare)
        except RuntimeError as exc:
            advice = capture_error_advice(str(exc))
            if advice is None:
                raise
            raise RuntimeError(f"NPU graph capture failed: {advice} (the error: {str(exc).splitlines()[0][:200]})") from exc


NPU_CAPTURE_ERRORS = (
    (("Alloc sq cq fail",), "an Ascend driver (HDK) older than 25.5.1 cannot allocate the streams a capture needs: "
                            "upgrade the HDK to 25.5.1 or later (vllm-ascend's compilation/acl_graph.py reads this "
                            "error so), or capture fewer graphs (fewer batch buckets)"),
    (("507903",), "an HCCL collective failed inside the capture: export HCCL_OP_EXPANSION_MODE=AIV on every rank, "
                  "as vllm-ascend's troubleshooting advises for capture stability"),
    (("207008", "stream resources are insufficient"), "the device ran out of stream resources for the captures: "
                                                      "capture fewer graphs (fewer batch buckets)"),
)
"""Known NPU-graph capture errors, by a marker of their text, and what to do (docs/ascend.md §20.4;
`dcp-compile doctor --device npu` checks the driver and HCCL_OP_EXPANSION_MODE before a first run)."""


def capture_error_advice(message: str) -> str | None:
    """What to do about an NPU-graph capture error, or None for an error not known here."""
    for markers, advice in NPU_CAPTURE_ERRORS:
        if any(marker in message for marker in markers):
            return advice
    return None


def feed_replay(feeds: list[HostFeed], runs: list[HostFeed], host: HostMetadata | None,
                debug: bool = False) -> list[dict] | None:
    """Feed every graph a captured step ran for this step's host metadata; returns what the
    graph back end must push before the replay, or None: each run's HostFeed.graph_updates, in
    the order the step ran its graphs (`runs`, the step's HostSlot.runs: a compile region's graph
    once per call), as the captured graph recorded their calls. NPUGraph.update takes one entry
    per recorded call, in record order (or one for all): torch_npu/npu/graphs.py
    update_capture_record (docs/ascend.md §9.3)."""
    updates = {}
    for feed in feeds:
        rank = feed.rank_view(host)
        feed.prepare(rank)
        feed.values(rank)
        if debug:  # a feed that did not happen would replay another step's inputs
            feed.check_fed(rank)
        updates[feed] = feed.graph_updates(rank) or []
    return [update for feed in runs for update in updates[feed]] or None


def device_graphs(device: torch.device) -> _DeviceGraphs:
    """The graph back end of a device: CUDA graphs, or NPU graphs."""
    backends = {"cuda": CudaGraphs, "npu": NPUGraphs}
    if torch.device(device).type not in backends:
        raise ValueError(f"device graphs run on cuda or npu, not {torch.device(device).type}")
    return backends[torch.device(device).type]()


class _Captured:
    def __init__(self, graph, inputs: ForwardBatch, output: torch.Tensor, addresses: list[int], feeds: list[HostFeed],
                 runs: list[HostFeed]):
        self.graph, self.inputs, self.output, self.addresses = graph, inputs, output, addresses
        self.feeds = feeds
        """The host feeds of the graphs the captured step ran, fed anew before every replay."""
        self.runs = runs
        """The feed of each graph run of the captured step, in order (HostSlot.runs)."""
        self.unread = unread_inputs(feeds)
        """Batch inputs no graph of the step reads: not copied before a replay (their static
        buffers keep the capture's values, which nothing reads)."""
        self.staging = PinnedStaging()
        """Pinned host buffers for the copies into `inputs`."""


def unread_inputs(feeds: list[HostFeed]) -> frozenset[str]:
    """The batch inputs every feed reports unread; none without feeds (then the runner cannot
    know what the step's graphs read, and copies every input).

    A step whose graphs do not all have feeds (a graph with no host-fed input has none) must not
    rely on this: a graph without a feed that reads an input another graph's feed reports unread
    would replay a stale value. A compiled step is one graph (fullgraph=True)."""
    if not feeds:
        return frozenset()
    return frozenset.intersection(*(frozenset(feed.unread_inputs()) for feed in feeds))


class GraphRunner:
    """Replay `step` (a callable taking ForwardBatch.args()) from device graphs.

    step: usually `dcp_model.compiled("gather-q")`, one fixed strategy per graph.
    graphs: the back end, CudaGraphs() by default, or NPUGraphs().
    host_slot: `dcp_compile.state(model).host_slot`, for steps whose graphs read host-fed inputs
    (a paged kernel back end): the runner sets the step's metadata there, and feeds the captured
    graphs' inputs from it before every replay.
    watched: tensors the graphs read that the runner does not own (the KV caches); in debug mode
    their addresses, and the runner's own buffers', are checked before every replay.
    latch: the model's failure latch (runtime/failure.py), by default the step's (`step.latch`, as
    `DCPModel.compiled` gives it): after a failed step or replay every later call raises, so that
    a rank whose replay failed on the host never replays its collectives against its peers'
    earlier step's.
    """

    def __init__(self, step, buckets=DEFAULT_BUCKETS, debug: bool = False, watched=(), graphs=None,
                 host_slot: HostSlot | None = None, latch: FailureLatch | None = None):
        if not buckets or min(buckets) < 1:
            raise ValueError(f"buckets must be positive batch sizes, got {buckets}")
        self.latch = latch if latch is not None else getattr(step, "latch", None)
        self.graphs = graphs if graphs is not None else CudaGraphs()
        self.step, self.buckets, self.debug = step, tuple(sorted(buckets)), debug
        self.watched = list(watched)
        self.host_slot = host_slot
        self.captured: dict[tuple[int, int, int], _Captured] = {}
        self._warned = False
        self.h2d_last_step: dict[str, int] = {}
        """Bytes the last replay copied host-to-device, by batch input (ForwardBatch field) and
        FEEDS for the feeds' buffers; an input not copied is absent."""

    @property
    def h2d_bytes_last_step(self) -> int:
        """Bytes the last replay copied host-to-device: its batch inputs and feeds' buffers."""
        return sum(self.h2d_last_step.values())

    def bucket_for(self, rows: int) -> int | None:
        i = bisect.bisect_left(self.buckets, rows)
        return self.buckets[i] if i < len(self.buckets) else None

    def _addresses(self, inputs: ForwardBatch) -> list[int]:
        return [t.data_ptr() for t in inputs.args()] + [t.data_ptr() for t in self.watched]

    def _run(self, batch: ForwardBatch):
        if self.host_slot is None:
            return self.step(*batch.args())
        self.host_slot.begin(batch.host)
        try:
            return self.step(*batch.args())
        finally:
            self.host_slot.end()

    def _feed(self, captured: _Captured, host: HostMetadata | None) -> list[dict] | None:
        return feed_replay(captured.feeds, captured.runs, host, self.debug)

    @staticmethod
    def _padded(batch: ForwardBatch, bucket: int,
                tokens_per_row: int) -> tuple[dict[str, torch.Tensor], HostMetadata | None]:
        """The batch inputs grown to the bucket as ForwardBatch.padded grows them, by field, and
        its host metadata grown with them, once checked to still describe the batch. The page
        table is left at the batch's rows (padded rows are zeros: the copy into the static buffer
        zeroes them), so that a step builds no [bucket, max_context] table on the host only to
        copy it, or not to copy it when no graph reads it."""
        host = batch._checked_host()
        narrow = ForwardBatch(*(t[:, :0] if name == "req_to_token" else t
                                for name, t in zip(BATCH_FIELDS, batch.args())))  # no host: nothing bound
        padded = dict(zip(BATCH_FIELDS, narrow.padded(bucket, tokens_per_row).args()))
        padded["req_to_token"] = batch.req_to_token
        return padded, host.padded(bucket, tokens_per_row) if host is not None else None

    def _copy_inputs(self, captured: _Captured, fresh: dict[str, torch.Tensor]) -> None:
        """Copy the step's inputs into the captured graph's static buffers, through its pinned
        staging (no host sync); inputs no graph of the step reads are not copied."""
        self.h2d_last_step = {}
        with captured.staging.step() as copies:
            for name, static in zip(BATCH_FIELDS, captured.inputs.args()):
                if name not in captured.unread:
                    self.h2d_last_step[name] = copies.copy(name, static, fresh[name])

    @staticmethod
    def _check_inputs(captured: _Captured, fresh: dict[str, torch.Tensor]) -> None:
        """The metadata check the graph's own debug checks cannot run inside a capture, on the
        step's inputs as the static buffers get them, on the host (read back from the device, the
        check would sync the host every replay). The page table's padded rows are zeros."""
        rows = captured.inputs.req_to_token.shape[0]
        table = fresh["req_to_token"].cpu()
        table = torch.cat([table, table.new_zeros(rows - table.shape[0], table.shape[1])])
        torch.ops.dcp.check_metadata(table, *(fresh[name].cpu() for name in ("seq_lens", "q_seq_ids", "positions",
                                                                              "out_loc")))

    def capture(self, template: ForwardBatch, tokens_per_row: int, bucket: int | None = None) -> _Captured:
        """Capture the graph for `bucket` (template's, by default) and template's page-table width.
        Verify graphs (more than one token per row) return logits for every token; decode graphs,
        for every row."""
        if bucket is None:
            bucket = self.bucket_for(template.rows)
        elif bucket not in self.buckets:
            raise ValueError(f"bucket {bucket} is not one of this runner's {self.buckets}")
        width = template.req_to_token.shape[1]
        inputs = ForwardBatch.empty(width).padded(bucket, tokens_per_row).to(self.graphs.device)
        if template.host is not None:
            inputs.host = HostMetadata.empty_like(template.host, width).padded(bucket, tokens_per_row).bind(*inputs.args())
        graph, output = self.graphs.capture(lambda: self._run(inputs))
        feeds, runs = (list(self.host_slot.fed), list(self.host_slot.runs)) if self.host_slot is not None else ([], [])
        captured = _Captured(graph, inputs, output, self._addresses(inputs), feeds, runs)
        self.captured[(bucket, tokens_per_row, width)] = captured
        log.info("captured a graph for bucket %d x %d tokens", bucket, tokens_per_row)
        return captured

    def capture_buckets(self, template: ForwardBatch, tokens_per_row: int = 1) -> dict[int, float]:
        """Capture every bucket not yet captured for template's page-table width, largest first,
        before serving; returns each one's seconds (the first holds the step's compile). Largest
        first: a step compiled symbolic in the batch (`DCPModel.compiled(..., symbolic=True)`)
        takes its first call's sizes as the compile's hints, and every smaller bucket then
        replays that compile."""
        seconds = {}
        width = template.req_to_token.shape[1]
        synchronize = getattr(self.graphs, "synchronize", lambda: None)  # host-run stand-ins have none
        for bucket in sorted(self.buckets, reverse=True):
            if (bucket, tokens_per_row, width) in self.captured:
                continue
            started = time.perf_counter()
            self.capture(template, tokens_per_row, bucket)
            synchronize()
            seconds[bucket] = time.perf_counter() - started
        return seconds

    def __call__(self, batch: ForwardBatch, tokens_per_row: int = 1) -> torch.Tensor:
        """The step's logits, replayed from the graph of its bucket (captured at its first step).
        Any error latches the model: a peer may have replayed its collectives already."""
        if self.latch is None:
            return self._step(batch, tokens_per_row)
        self.latch.check()
        try:
            return self._step(batch, tokens_per_row)
        except BaseException as exc:
            self.latch.record(exc)
            raise

    def _step(self, batch: ForwardBatch, tokens_per_row: int) -> torch.Tensor:
        bucket = self.bucket_for(batch.rows)
        if bucket is None:
            if not self._warned:
                warnings.warn(
                    f"batch of {batch.rows} rows exceeds the largest captured bucket {self.buckets[-1]}: running eagerly",
                    stacklevel=2,
                )
                self._warned = True
            return self._run(batch.to(self.graphs.device))
        key = (bucket, tokens_per_row, batch.req_to_token.shape[1])
        captured = self.captured.get(key) or self.capture(batch, tokens_per_row)
        if self.debug and self._addresses(captured.inputs) != captured.addresses:
            raise StaleAddressError("an input or KV buffer of a captured graph moved since capture")
        fresh, host = self._padded(batch, bucket, tokens_per_row)
        self._copy_inputs(captured, fresh)
        if self.debug:  # the graph's own debug checks ran at capture only: they cannot read the device there
            self._check_inputs(captured, fresh)
        updates = self._feed(captured, host)
        self.h2d_last_step[FEEDS] = sum(feed.h2d_bytes for feed in captured.feeds)
        self.graphs.replay(captured.graph, updates)
        if self.debug and updates is not None and self.graphs.applied(captured.graph) != updates:
            raise StaleHostLengthsError(
                "the captured graph's host lengths were not refreshed for this step: it would replay another step's lengths"
            )
        real = batch.logits_index.shape[0]
        return captured.output[:real].clone()
