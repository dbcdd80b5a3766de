"""Pass test harness: capture a model's dynamo graph once, run passes on copies, record each
pass's graph before and after, and count ops. No process group is needed: passes only embed the
group name, and the verifier propagates fake tensors. fake_graph() captures any preset (up to
61-layer Kimi-K2) with shapes only, as `dcp-compile dump` does."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from dcp_compile.debug import fake_capture
from dcp_compile.debug.dump import op_diff
from dcp_compile.models.config import preset
from dcp_compile.models.mla import MLAModel
from dcp_compile.lowering import registry
from dcp_compile.passes import PassConfig, PassManager, default_passes
from dcp_compile.passes.graph_utils import op_counts
from dcp_compile.runtime.batch import RequestTable


def capture(model: torch.nn.Module, *args) -> fx.GraphModule:
    """The full dynamo graph of model(*args), with fake values on every node."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(copy.deepcopy(gm))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=backend, fullgraph=True, dynamic=False)(*args)
    assert len(graphs) == 1, f"expected one graph, got {len(graphs)}"
    return graphs[0]


def fake_graph(model: str = "tiny", mode: str = "decode", **spec_fields) -> fx.GraphModule:
    """A preset's graph captured with shapes only (meta weights, fake TP group, nothing run);
    spec_fields are dcp_compile.debug.fake_capture.GraphSpec fields (layers, tp_size, batch, ...).
    Pass dcp_size to run_passes; here it only sets the default TP size and the KV shard shape."""
    return fake_capture.capture(fake_capture.GraphSpec(model=model, mode=mode, **spec_fields)).gm


def tiny_graph(layer_types=None, batch_lengths=((3, 1), (1, 1), (0, 1)), capacity=128) -> fx.GraphModule:
    """Capture the tiny model on a small extend batch: (prefix, new tokens) per request."""
    cfg = preset("tiny")
    if layer_types is not None:
        cfg = cfg.replace(layer_types=tuple(layer_types))
    model = MLAModel(cfg, kv_capacity=capacity, max_requests=len(batch_lengths))
    table = RequestTable(len(batch_lengths), 16, capacity)
    requests = list(range(len(batch_lengths)))
    for r, (prefix, _) in enumerate(batch_lengths):
        if prefix:
            table.append(r, prefix)
    batch = table.extend_batch(requests, [[1] * new for _, new in batch_lengths], pad_rows=1)
    return capture(model, *batch.args())


@dataclass
class Recorder:
    """Keeps readable copies of the graph and op counts before and after each pass."""

    snapshots: dict = field(default_factory=dict)

    def __call__(self, graph_index, order, name, when, gm):
        self.snapshots[(name, when)] = (gm.code, op_counts(gm.graph))

    def ops(self, name: str, when: str) -> dict:
        return self.snapshots[(name, when)][1]

    def op_diff(self, name: str) -> dict[str, tuple[int, int]]:
        """{op: (count before, count after)} for the ops whose count pass `name` changed."""
        return op_diff(self.ops(name, "before"), self.ops(name, "after"))

    def code(self, name: str, when: str) -> str:
        return self.snapshots[(name, when)][0]


def run_passes(gm: fx.GraphModule, dcp_size=2, dcp_rank=0, interleave=1, debug_checks=False, disabled=(),
               attention_strategy="gather-q", kernels="torch", page_size=1):
    """Run the pipeline of back end `kernels` on a copy of gm (the graphs here are on the CPU,
    where 'auto' is 'torch'). Returns (rewritten gm, report, recorder)."""
    gm = copy.deepcopy(gm)
    recorder = Recorder()
    config = PassConfig(dcp_size, dcp_rank, interleave, "fake-dcp-group" if dcp_size > 1 else None, debug_checks,
                        attention_strategy, page_size)
    lowering = registry.get("torch" if kernels == "auto" else kernels)
    report = PassManager(config, disabled, passes=default_passes(lowering.passes()), observers=[recorder]).run(gm)
    return gm, report, recorder
