"""The pass manager: the only place that knows the order of passes.

Runs each pass under timing and logging, records sites rewritten and node counts, shows observers
the graph before and after each pass (numbered: a dump writer is one), can skip passes by name,
and always ends with cleanup and the verifier. The DCP passes come first; a kernel back end's
lowering passes (lowering.base.Lowering.passes) run after them, before cleanup.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field

import torch.fx as fx

from dcp_compile.passes.base import GraphPass, PassConfig
from dcp_compile.passes.check_locations import CheckLocations
from dcp_compile.passes.check_metadata import CheckMetadata
from dcp_compile.passes.gather_kv_attention import GatherKVAttention
from dcp_compile.passes.guard_batch import GuardBatch
from dcp_compile.passes.cleanup import Cleanup
from dcp_compile.passes.fuse_projections import FuseProjections
from dcp_compile.passes.graph_utils import mutated_inputs, normalize_meta, op_counts, record_example_values
from dcp_compile.passes.local_metadata import LocalMetadata
from dcp_compile.passes.overlap_collectives import OverlapCollectives
from dcp_compile.passes.gather_q_attention import GatherQAttention
from dcp_compile.passes.replicated_q_attention import ReplicatedQAttention
from dcp_compile.passes.shard_kv_write import ShardKVWrite
from dcp_compile.passes.verify import CAPTURED_MUTATIONS, Verify

log = logging.getLogger("dcp_compile.passes")


def default_passes(lowering_passes=(), front_end_passes=()) -> list[GraphPass]:
    """The pipeline: a front end's passes (which turn a known model family's attention into the
    canonical ops, dcp_compile/hf), the DCP passes, a back end's lowering passes, the collective
    schedule, cleanup, verify."""
    return [*front_end_passes, CheckLocations(), CheckMetadata(), GuardBatch(), ShardKVWrite(), LocalMetadata(), GatherQAttention(),
            ReplicatedQAttention(), GatherKVAttention(), FuseProjections(), *lowering_passes, *last_passes()]


def last_passes() -> list[GraphPass]:
    """What runs after the lowering passes, in order: the schedule of the collectives (over the
    lowered graph, whose nodes it orders), cleanup, verify."""
    return [OverlapCollectives(), Cleanup(), Verify()]


PASS_NAMES = tuple(p.name for p in default_passes())
"""The DCP passes, the collective schedule, cleanup and the verifier; each back end adds its
lowering passes' names before the last three."""
ALWAYS_ON = ("guard_batch", "verify")


@dataclass
class PassRecord:
    name: str
    ran: bool
    sites: int
    nodes_before: int
    nodes_after: int
    milliseconds: float
    ops_before: dict = field(default_factory=dict)
    ops_after: dict = field(default_factory=dict)


@dataclass
class PassReport:
    records: list[PassRecord]

    def sites(self, name: str) -> int:
        return sum(r.sites for r in self.records if r.name == name)

    def summary(self) -> dict[str, int]:
        """Sites by pass (summed over a graph's compile regions, each run once)."""
        return {r.name: self.sites(r.name) for r in self.records}

    def as_dict(self) -> dict:
        return {"passes": [asdict(r) for r in self.records]}


def all_pass_names(lowering_passes=()) -> tuple[str, ...]:
    """The DCP passes, with the named lowering passes where a back end runs them (before the last ones)."""
    last = len(last_passes())
    return PASS_NAMES[:-last] + tuple(dict.fromkeys(lowering_passes)) + PASS_NAMES[-last:]


def check_pass_names(names, known: tuple[str, ...] | None = None) -> None:
    """Raise for a pass that cannot be disabled, and for a name not `known` (when given: the
    lowering registry knows every back end's passes, lowering.registry.check_pass_names)."""
    unknown = [n for n in names if known is not None and n not in known]
    if unknown:
        raise ValueError(f"unknown pass name(s) {unknown}; passes are {list(known)}")
    if any(n in ALWAYS_ON for n in names):
        raise ValueError(f"pass(es) {list(ALWAYS_ON)} cannot be disabled")


class PassManager:
    def __init__(self, config: PassConfig, disabled=(), passes: list[GraphPass] | None = None, observers=()):
        """passes: the pipeline, default_passes() (no lowering) by default. observers: callables
        observer(graph_index, order, pass_name, when, gm), called with when = 'before' and
        'after' around every pass (dumps and test harnesses use them); an observer with a
        `pipeline_done(graph_index, report)` method also gets the PassReport."""
        check_pass_names(disabled)
        self.config, self.disabled = config, tuple(disabled)
        self.passes = passes if passes is not None else default_passes()
        self.observers = list(observers)
        self.graphs_run = 0

    def run(self, gm: fx.GraphModule, passes: list[GraphPass] | None = None) -> PassReport:
        """Run the pipeline over `gm`: the manager's, or `passes` (default_passes() with a back end's
        lowering under other options, for a step that graph serves: Lowering.step_options), under
        the same numbering, observers and disabled passes."""
        normalize_meta(gm.graph)
        gm.meta[CAPTURED_MUTATIONS] = mutated_inputs(gm.graph)
        graph_index, self.graphs_run = self.graphs_run, self.graphs_run + 1
        records = []
        for order, graph_pass in enumerate(self.passes if passes is None else passes):
            before_nodes, before_ops = len(gm.graph.nodes), dict(op_counts(gm.graph))
            ran = graph_pass.name not in self.disabled and graph_pass.applies(self.config)
            self._notify(graph_index, order, graph_pass.name, "before", gm)
            start = time.perf_counter()
            sites = graph_pass.run(gm, self.config) if ran else 0
            elapsed = (time.perf_counter() - start) * 1e3
            if ran:
                gm.recompile()
            self._notify(graph_index, order, graph_pass.name, "after", gm)
            record = PassRecord(graph_pass.name, ran, sites, before_nodes, len(gm.graph.nodes), elapsed,
                                before_ops, dict(op_counts(gm.graph)))
            log.info("pass %-18s ran=%s sites=%d nodes %d -> %d in %.2f ms", record.name, ran, sites,
                     record.nodes_before, record.nodes_after, elapsed)
            records.append(record)
        record_example_values(gm.graph)
        report = PassReport(records)
        for observer in self.observers:
            if hasattr(observer, "pipeline_done"):
                observer.pipeline_done(graph_index, report)
        return report

    def _notify(self, graph_index: int, order: int, name: str, when: str, gm: fx.GraphModule) -> None:
        for observer in self.observers:
            observer(graph_index, order, name, when, gm)

