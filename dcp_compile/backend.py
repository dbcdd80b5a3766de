"""The torch.compile backend: run the DCP pass pipeline and the kernel back end's lowering passes,
then the inner compiler; feed the lowered graph's host inputs on every call."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch.fx as fx

from dcp_compile.config import DCPConfig
from dcp_compile.debug.dump import TextDump, env_folder, writable_folder
from dcp_compile.lowering.base import Lowering
from dcp_compile.passes import PassConfig, PassManager, PassReport, default_passes
from dcp_compile.passes.cache_use import bind_pool, check_cache_use
from dcp_compile.passes.fuse_projections import bind_weights, finish_fusion
from dcp_compile.passes.sites import count_cache_views, count_mla_sites
from dcp_compile.runtime.host_inputs import HostSlot
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
        fuse_projections=config.fuse_projections == "on",
        page_size=page_size,
    )


def _own_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """gm with a copy of its graph (nodes and meta), sharing its parameters and buffers."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return fx.GraphModule(gm, graph)


def _inner_compiler(config: DCPConfig, lowering: Lowering):
    if config.inner_compile == "inductor":
        from torch._inductor.compile_fx import compile_fx

        return compile_fx
    if config.inner_compile == "eager":
        return lambda gm, example_inputs: gm.forward
    return lowering.inner_compiler(config.inner_compile)  # one of the back end's own


class DCPBackend:
    """A torch.compile backend for one attention strategy. Keeps one PassReport per captured
    graph in `reports`. A lowered graph's host-fed inputs (runtime.host_inputs) are fed from
    `host_slot` on every call, whatever the inner compiler."""

    def __init__(self, config: DCPConfig, parallel: ParallelState, lowering: Lowering, strategy: str = "gather-q",
                 page_size: int = 1, host_slot: HostSlot | None = None, pool=None, front_end_passes=()):
        """front_end_passes: passes that rewrite a known model family's attention into the
        canonical ops (dcp_compile/hf), run first."""
        self.config, self.strategy, self.parallel, self.pool, self.lowering = config, strategy, parallel, pool, lowering
        self.front_end = tuple(front_end_passes)
        self.host_slot = host_slot or HostSlot(parallel.dcp_rank)
        dump_dir = config.dump_dir or env_folder()
        if dump_dir and config.dcp_size > 1:
            dump_dir = os.path.join(dump_dir, strategy)
        observers = []
        if dump_dir:
            writable_folder(dump_dir)  # at apply(), not at the first forward
            observers.append(TextDump(Path(dump_dir)))
        self.manager = PassManager(pass_config(config, parallel, strategy, page_size), config.disabled_passes,
                                   passes=default_passes(lowering.passes(), self.front_end), observers=observers)
        self.reports: list[PassReport] = []

    def __call__(self, gm: fx.GraphModule, example_inputs):
        if self.pool is not None:
            check_cache_use(gm.graph, example_inputs, [self.pool.cache(i) for i in range(self.pool.num_layers)],
                            front_end=bool(self.front_end))
        if self.config.dcp_size > 1 and count_mla_sites(gm.graph) + count_cache_views(gm.graph) == 0:
            raise ValueError(
                "the captured graph has no MLA site (dcp::mla_attention): DCP has nothing to shard. "
                "Write attention with dcp_compile.ops.mla_kv_write / mla_attention."
            )
        # Dynamo reads its graph's placeholders after this call, and a lowering may add inputs.
        gm = _own_graph(gm)
        if self.pool is not None:
            bind_pool(gm, example_inputs, self.pool)
        bind_weights(gm, example_inputs)  # also when off: a later fusing graph must know what this one reads
        report = self.manager.run(gm)
        self.reports.append(report)
        log.info("dcp_compile graph %d: %s", len(self.reports) - 1, report.summary())
        feed = self.lowering.host_feed(gm, self.parallel.dcp_rank)
        if feed is not None:
            self.host_slot.feed(feed)  # this step's values: the examples the inner compiler sees
            example_inputs = list(example_inputs) + feed.examples()
        compiled = _inner_compiler(self.config, self.lowering)(gm, example_inputs)
        finish_fusion(gm)
        if feed is None:
            return compiled
        slot = self.host_slot

        def run(*args):
            return compiled(*args, *slot.feed(feed))

        return run
