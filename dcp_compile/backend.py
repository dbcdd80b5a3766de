"""The torch.compile backend: run the DCP pass pipeline, then the inner compiler."""

from __future__ import annotations

import logging
import os

import torch
import torch.fx as fx

from dcp_compile.config import DCPConfig
from dcp_compile.debug.dump import writable_folder
from dcp_compile.lowering.npu.inner_compile import torchair_compiler
from dcp_compile.passes import PassConfig, PassManager, PassReport
from dcp_compile.passes.cache_use import check_cache_use
from dcp_compile.passes.sites import count_mla_sites
from dcp_compile.runtime.host_metadata import HostSlot, host_input_feeder
from dcp_compile.runtime.parallel import ParallelState

log = logging.getLogger("dcp_compile")


def pass_config(config: DCPConfig, parallel: ParallelState, strategy: str, page_size: int = 1) -> PassConfig:
    return PassConfig(
        dcp_size=config.dcp_size,
        dcp_rank=parallel.dcp_rank,
        interleave=config.interleave,
        dcp_group_name=parallel.dcp_group_name,
        debug_checks=config.debug_checks,
        attention_strategy=strategy,
        kernels=config.kernels,
        page_size=page_size,
    )


def _own_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """gm with a copy of its graph (nodes and meta), sharing its parameters and buffers."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return fx.GraphModule(gm, graph)


class DCPBackend:
    """A torch.compile backend for one attention strategy. Keeps one PassReport per captured
    graph in `reports`. Graph inputs that a lowering feeds from the host (FIA's lengths) are
    read from `host_slot` on every call; FlashInfer plans are made from it before every call."""

    def __init__(self, config: DCPConfig, parallel: ParallelState, strategy: str = "gather-q", page_size: int = 1,
                 host_slot: HostSlot | None = None, pool=None):
        self.config, self.strategy, self.parallel, self.pool = config, strategy, parallel, pool
        self.host_slot = host_slot or HostSlot()
        dump_dir = config.dump_dir or os.environ.get("DCP_COMPILE_DUMP") or None
        if dump_dir and config.dcp_size > 1:
            dump_dir = os.path.join(dump_dir, strategy)
        if dump_dir:
            writable_folder(dump_dir)  # at apply(), not at the first forward
        self.manager = PassManager(pass_config(config, parallel, strategy, page_size), config.disabled_passes, dump_dir)
        self.reports: list[PassReport] = []

    def __call__(self, gm: fx.GraphModule, example_inputs):
        if self.pool is not None:
            check_cache_use(gm.graph, example_inputs, [self.pool.cache(i) for i in range(self.pool.num_layers)])
        if self.config.dcp_size > 1 and count_mla_sites(gm.graph) == 0:
            raise ValueError(
                "the captured graph has no MLA site (dcp::mla_attention): DCP has nothing to shard. "
                "Write attention with dcp_compile.ops.mla_kv_write / mla_attention."
            )
        # Dynamo reads its graph's placeholders after this call, and a lowering may add inputs.
        gm = _own_graph(gm)
        report = self.manager.run(gm)
        self.reports.append(report)
        log.info("dcp_compile graph %d: %s", len(self.reports) - 1, report.summary())
        if self.config.inner_compile == "inductor":
            from torch._inductor.compile_fx import compile_fx

            return compile_fx(gm, example_inputs)
        feed = host_input_feeder(gm.graph, self.parallel.dcp_rank)
        plans = []
        if "dcp_flashinfer_plans" in gm.meta:
            from dcp_compile.lowering.flashinfer.plans import graph_plans, plan_step

            plans = graph_plans(gm.meta)
        compiled = gm.forward
        if self.config.inner_compile == "torchair":
            compiled = torchair_compiler(self.config.torchair_mode)(gm, list(example_inputs) + self._host_examples(gm, feed))
        if feed is None and not plans:
            return compiled
        slot, fia_args, rank = self.host_slot, gm.meta.get("dcp_fia_host_args"), self.parallel.dcp_rank

        def run(*args):
            slot.fia_args, slot.plans = fia_args, plans
            if plans:
                plan_step(plans, slot.current, rank)
            return compiled(*args, *feed(slot.current)) if feed is not None else compiled(*args)

        return run

    def _host_examples(self, gm: fx.GraphModule, feed) -> list:
        """Example values of the host-fed inputs for an inner compiler: this step's block table,
        and the lengths as the SymInts lower_npu_attention made them (symbolic, not constants)."""
        if feed is None:
            return []
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder" and "dcp_host_input" in n.meta]
        current = feed(self.host_slot.current)
        return [n.meta["val"] if isinstance(n.meta["val"], torch.SymInt) else value for n, value in zip(placeholders, current)]
