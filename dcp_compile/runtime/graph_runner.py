"""CUDA-graph capture and replay of decode / verify steps, per batch bucket and tokens per row.

The runner owns static input buffers, one set per (bucket, tokens per row, page-table width), allocated once at
capture and refreshed in place before every replay; a captured buffer is never reallocated.
Batches are padded to the bucket with rows that write to location 0 and see no key. Graphs are
captured on a fully padded batch, so capture itself writes no KV and touches no request state.
A batch larger than the largest bucket runs eagerly, with one warning.
"""

from __future__ import annotations

import bisect
import logging
import warnings

import torch

from dcp_compile.runtime.batch import ForwardBatch

log = logging.getLogger("dcp_compile.runtime")
DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


class StaleAddressError(RuntimeError):
    pass


class _Captured:
    def __init__(self, graph, inputs: ForwardBatch, output: torch.Tensor, addresses: list[int]):
        self.graph, self.inputs, self.output, self.addresses = graph, inputs, output, addresses


class GraphRunner:
    """Replay `step` (a callable taking ForwardBatch.args()) from CUDA graphs.

    step: usually `dcp_model.compiled("gather-q")`, one fixed strategy per graph.
    watched: tensors the graphs read that the runner does not own (the KV caches); in debug mode
    their addresses, and the runner's own buffers', are checked before every replay.
    """

    def __init__(self, step, buckets=DEFAULT_BUCKETS, debug: bool = False, watched=()):
        if not torch.cuda.is_available():
            raise RuntimeError("GraphRunner needs a CUDA GPU; on CPU call the model directly")
        if not buckets or min(buckets) < 1:
            raise ValueError(f"buckets must be positive batch sizes, got {buckets}")
        self.step, self.buckets, self.debug = step, tuple(sorted(buckets)), debug
        self.watched = list(watched)
        self.graphs: dict[tuple[int, int], _Captured] = {}
        self.mempool = torch.cuda.graph_pool_handle()
        self._warned = False

    def bucket_for(self, rows: int) -> int | None:
        i = bisect.bisect_left(self.buckets, rows)
        return self.buckets[i] if i < len(self.buckets) else None

    def _addresses(self, inputs: ForwardBatch) -> list[int]:
        return [t.data_ptr() for t in inputs.args()] + [t.data_ptr() for t in self.watched]

    def capture(self, template: ForwardBatch, tokens_per_row: int) -> _Captured:
        """Capture the graph for template's bucket and page-table width. Verify graphs (more than
        one token per row) return logits for every token; decode graphs, for every row."""
        bucket = self.bucket_for(template.rows)
        device = torch.device("cuda", torch.cuda.current_device())
        inputs = ForwardBatch.empty(template.req_to_token.shape[1]).padded(bucket, tokens_per_row).to(device)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.step(*inputs.args())
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.mempool):
            output = self.step(*inputs.args())
        captured = _Captured(graph, inputs, output, self._addresses(inputs))
        self.graphs[(bucket, tokens_per_row, template.req_to_token.shape[1])] = captured
        log.info("captured a CUDA graph for bucket %d x %d tokens", bucket, tokens_per_row)
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
            return self.step(*batch.to("cuda").args())
        key = (bucket, tokens_per_row, batch.req_to_token.shape[1])
        captured = self.graphs.get(key) or self.capture(batch, tokens_per_row)
        if self.debug and self._addresses(captured.inputs) != captured.addresses:
            raise StaleAddressError("an input or KV buffer of a captured graph moved since capture")
        padded = batch.padded(bucket, tokens_per_row)
        for static, fresh in zip(captured.inputs.args(), padded.args()):
            static.copy_(fresh, non_blocking=True)
        captured.graph.replay()
        real = batch.logits_index.shape[0]
        return captured.output[:real].clone()

