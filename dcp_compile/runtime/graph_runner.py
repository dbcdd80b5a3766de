"""Graph capture and replay of decode / verify steps, per batch bucket and tokens per row, on CUDA
graphs or Ascend NPU graphs.

The runner owns static input buffers, one set per (bucket, tokens per row, page-table width),
allocated once at capture and refreshed in place before every replay; a captured buffer is
never reallocated. Batches are padded to the bucket with rows that write to location 0 and see
no key. Graphs are captured on a fully padded batch, so capture itself writes no KV and touches
no request state. A batch larger than the largest bucket runs eagerly, with one warning.

What differs per device lives in a back end: how to capture and replay, and, for NPU graphs,
the host values FIA bakes into its captured tiling (its kv lengths, ASCEND.md §3.2), which must
be refreshed before every replay. The runner hands each replay the current step's values; in
debug mode it checks that the back end holds them (a skipped update would replay another step's
lengths) and that no captured address moved. Graphs that run FlashInfer are planned from the
step's host metadata before every replay (plan() writes the buffers the captured kernels read);
debug mode checks every plan was made for this step's lengths.
"""

from __future__ import annotations

import bisect
import logging
import warnings

import torch

from dcp_compile.runtime.batch import ForwardBatch
from dcp_compile.runtime.host_metadata import HostMetadata, HostSlot, fia_update_inputs

log = logging.getLogger("dcp_compile.runtime")
DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


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

    def capture(self, run):
        stream = self.backend.Stream()
        stream.wait_stream(self.backend.current_stream())
        with self.backend.stream(stream):
            for _ in range(2):
                run()
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
    """Ascend NPU graphs (torch.npu.NPUGraph). Capture records FIA calls with
    `auto_dispatch_capture`; each replay first pushes the step's FIA lengths with
    `NPUGraph.update(cpu_update_input=...)`, one dict per recorded FIA call (ASCEND.md §3.2)."""

    backend_name, graph_class = "npu", "NPUGraph"
    capture_options = {"auto_dispatch_capture": True}

    def __init__(self):
        from dcp_compile.lowering.npu import require_torch_npu

        require_torch_npu("NPU graphs")
        super().__init__()
        self._applied: dict[int, list] = {}

    def replay(self, graph, updates) -> None:
        if updates:
            graph.update(cpu_update_input=updates)
            self._applied[id(graph)] = updates
        graph.replay()

    def applied(self, graph):
        return self._applied.get(id(graph))


class _Captured:
    def __init__(self, graph, inputs: ForwardBatch, output: torch.Tensor, addresses: list[int], fia_args: list,
                 plans: list):
        self.graph, self.inputs, self.output, self.addresses = graph, inputs, output, addresses
        self.fia_args = fia_args
        """Per FIA call of the graph, in order: {FIA argument: host input kind} to refresh."""
        self.plans = plans
        """The graph's FlashInfer plans, made anew from each step's host metadata before replay."""


class GraphRunner:
    """Replay `step` (a callable taking ForwardBatch.args()) from device graphs.

    step: usually `dcp_model.compiled("gather-q")`, one fixed strategy per graph.
    graphs: the back end, CudaGraphs() by default, or NPUGraphs().
    host_slot: `dcp_compile.state(model).host_slot`, for steps whose graphs read host-side
    metadata (kernels='npu' or 'flashinfer'): the runner sets the step's metadata there, and
    refreshes the captured FIA lengths (or FlashInfer plans) from it before every replay.
    watched: tensors the graphs read that the runner does not own (the KV caches); in debug mode
    their addresses, and the runner's own buffers', are checked before every replay.
    """

    def __init__(self, step, buckets=DEFAULT_BUCKETS, debug: bool = False, watched=(), graphs=None,
                 host_slot: HostSlot | None = None):
        if not buckets or min(buckets) < 1:
            raise ValueError(f"buckets must be positive batch sizes, got {buckets}")
        self.graphs = graphs if graphs is not None else CudaGraphs()
        self.step, self.buckets, self.debug = step, tuple(sorted(buckets)), debug
        self.watched = list(watched)
        self.host_slot = host_slot
        self.captured: dict[tuple[int, int, int], _Captured] = {}
        self._warned = False

    def bucket_for(self, rows: int) -> int | None:
        i = bisect.bisect_left(self.buckets, rows)
        return self.buckets[i] if i < len(self.buckets) else None

    def _addresses(self, inputs: ForwardBatch) -> list[int]:
        return [t.data_ptr() for t in inputs.args()] + [t.data_ptr() for t in self.watched]

    def _run(self, batch: ForwardBatch):
        if self.host_slot is None:
            return self.step(*batch.args())
        self.host_slot.current = batch.host
        try:
            return self.step(*batch.args())
        finally:
            self.host_slot.current = None

    def _plan(self, plans: list, host: HostMetadata | None) -> None:
        from dcp_compile.lowering.flashinfer.plans import plan_step

        plan_step(plans, host, self.host_slot.dcp_rank)
        if self.debug:  # a plan that did not happen would replay another step's lengths
            for plan in plans:
                plan.check_planned(host.for_rank(self.host_slot.dcp_rank))

    def capture(self, template: ForwardBatch, tokens_per_row: int) -> _Captured:
        """Capture the graph for template's bucket and page-table width. Verify graphs (more than
        one token per row) return logits for every token; decode graphs, for every row."""
        bucket = self.bucket_for(template.rows)
        width = template.req_to_token.shape[1]
        inputs = ForwardBatch.empty(width).padded(bucket, tokens_per_row).to(self.graphs.device)
        if template.host is not None:
            inputs.host = HostMetadata.empty_like(template.host, width).padded(bucket, tokens_per_row).bind(*inputs.args())
        if self.host_slot is not None:
            self.host_slot.fia_args = self.host_slot.plans = None
        graph, output = self.graphs.capture(lambda: self._run(inputs))
        fia_args = self.host_slot.fia_args if self.host_slot is not None else None
        plans = self.host_slot.plans if self.host_slot is not None else None
        captured = _Captured(graph, inputs, output, self._addresses(inputs), fia_args or [], plans or [])
        self.captured[(bucket, tokens_per_row, width)] = captured
        log.info("captured a graph for bucket %d x %d tokens", bucket, tokens_per_row)
        return captured

    def __call__(self, batch: ForwardBatch, tokens_per_row: int = 1) -> torch.Tensor:
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
        padded = batch.padded(bucket, tokens_per_row)
        for static, fresh in zip(captured.inputs.args(), padded.args()):
            static.copy_(fresh, non_blocking=True)
        updates = None
        if captured.fia_args:
            updates = fia_update_inputs(captured.fia_args, padded.host.for_rank(self.host_slot.dcp_rank))
        if captured.plans:
            self._plan(captured.plans, padded.host)
        self.graphs.replay(captured.graph, updates)
        if self.debug and updates is not None and self.graphs.applied(captured.graph) != updates:
            raise StaleHostLengthsError(
                "the captured graph's FIA lengths were not refreshed for this step: it would replay another step's lengths"
            )
        real = batch.logits_index.shape[0]
        return captured.output[:real].clone()
