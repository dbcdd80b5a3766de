"""The torch.compile backend: run the DCP pass pipeline and the kernel back end's lowering passes,
then the inner compiler; feed the lowered graph's host inputs on every call."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
import torch.fx as fx

from dcp_compile.config import DCPConfig
from dcp_compile.debug.dump import TextDump, env_folder, writable_folder
from dcp_compile.lowering.base import Lowering
from dcp_compile.passes import PassConfig, PassManager, PassReport, default_passes
from dcp_compile import regions
from dcp_compile.passes.cache_use import PER_CALL_INPUTS, bind_pool, bind_region_pool, check_cache_use, pool_inputs
from dcp_compile.passes.fuse_projections import bind_weights, finish_fusion
from dcp_compile.passes.graph_utils import fake_mode_of, fake_value
from dcp_compile.passes.sites import count_cache_views, count_mla_sites
from dcp_compile.runtime.failure import agreeing
from dcp_compile.runtime.host_inputs import BATCH_INPUT, HostSlot
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


def _telling_runs(compiled, slot: HostSlot, feed):
    """A compiled region that tells `slot` of each of its runs: the order in which the step's
    region calls run their kernels is the order a device graph captured of the step records them
    in, and its updates follow (HostSlot.runs)."""

    def run(*args):
        slot.ran(feed)
        return compiled(*args)

    return run


def _inner_compiler(config: DCPConfig, lowering: Lowering):
    if config.inner_compile == "inductor":
        from torch._inductor.compile_fx import compile_fx

        return compile_fx
    if config.inner_compile == "eager":
        return lambda gm, example_inputs: gm.forward
    return lowering.inner_compiler(config.inner_compile)  # one of the back end's own


class DCPBackend:
    """A torch.compile backend for one attention strategy. Keeps one PassReport per lowered
    graph in `reports`. A lowered graph's host-fed inputs (runtime.host_inputs) are fed from
    `host_slot` on every call, whatever the inner compiler. A back end that lowers a graph per
    step's host metadata (Lowering.step_options) gets one lowering of the captured graph per
    answer, picked at each call from the host slot."""

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
        self._pipelines = {lowering.options: self.manager.passes}
        """The pipeline per options of the back end (Lowering.step_options), made when first needed."""
        self.reports: list[PassReport] = []

    def __call__(self, gm: fx.GraphModule, example_inputs):
        found = regions.find_regions(gm)
        if self.pool is not None:
            check_cache_use(gm.graph, example_inputs, self._caches(), front_end=bool(self.front_end), regions=found)
        outside = count_mla_sites(gm.graph) + count_cache_views(gm.graph)
        inside = sum(count_mla_sites(r.module.graph) + count_cache_views(r.module.graph) for r in found)
        if self.config.dcp_size > 1 and outside + inside == 0:
            raise ValueError(
                "the captured graph has no MLA site (dcp::mla_attention): DCP has nothing to shard. "
                "Write attention with dcp_compile.ops.mla_kv_write / mla_attention."
            )
        if inside:
            if outside:
                raise ValueError(
                    f"the captured graph has {outside} MLA site(s) outside its compile regions and {inside} inside: "
                    "put every MLA layer in a region (torch.compiler.nested_compile_region) or none")
        options = self.lowering.step_options(self.host_slot.current)
        if options is None:
            return self._lower(gm, example_inputs, self.lowering, bool(inside))
        return self._lowered_per_step(gm, example_inputs, options, bool(inside))

    def _lowered_per_step(self, gm: fx.GraphModule, example_inputs, options, in_regions: bool):
        """gm lowered once per options the steps' host metadata ask for (Lowering.step_options):
        this step's now, another's when a step first asks for it (with that step's inputs as the
        examples); each call runs the lowering its host metadata picks, decided on the host."""
        lowering, slot = self.lowering, self.host_slot
        lowered = {options: self._lower(gm, example_inputs, lowering.configured(options), in_regions)}

        def run(*args):
            options = lowering.step_options(slot.current)
            if options not in lowered:
                # As at dynamo's compile: decided before the step's first collective, from the shapes
                # and host metadata every rank has alike, so a refusal leaves the model serving.
                with agreeing():
                    lowered[options] = self._lower(gm, list(args), lowering.configured(options), in_regions)
            return lowered[options](*args)

        return run

    def _passes(self, lowering: Lowering) -> list:
        """The pipeline with `lowering`'s passes (this backend's back end under some options)."""
        if lowering.options not in self._pipelines:
            self._pipelines[lowering.options] = default_passes(lowering.passes(), self.front_end)
        return self._pipelines[lowering.options]

    def _lower(self, gm: fx.GraphModule, example_inputs, lowering: Lowering, in_regions: bool):
        """gm through the pipeline with `lowering`'s passes and the inner compiler, fed its host inputs."""
        if in_regions:
            return self._compile_regions(gm, example_inputs, lowering)
        # Dynamo reads its graph's placeholders after this call, and a lowering may add inputs.
        gm = _own_graph(gm)
        if self.pool is not None:
            bind_pool(gm, example_inputs, self.pool)
        bind_weights(gm, example_inputs)  # also when off: a later fusing graph must know what this one reads
        report = self.manager.run(gm, self._passes(lowering))
        self.reports.append(report)
        log.info("dcp_compile graph %d: %s", len(self.reports) - 1, report.summary())
        feed = lowering.host_feed(gm, self.parallel.dcp_rank)
        if feed is not None:
            self.host_slot.feed(feed)  # this step's values: the examples the inner compiler sees
            example_inputs = list(example_inputs) + feed.examples()
        compiled = _inner_compiler(self.config, lowering)(gm, example_inputs)
        finish_fusion(gm)
        if feed is None:
            return compiled
        slot = self.host_slot

        def run(*args):
            values = slot.feed(feed)
            slot.ran(feed)
            return compiled(*args, *values)

        return run

    def _caches(self) -> list:
        return [self.pool.cache(i) for i in range(self.pool.num_layers)]

    def _compile_regions(self, gm: fx.GraphModule, example_inputs, lowering: Lowering):
        """The passes, `lowering` and the inner compiler once per compile region
        (dcp_compile/regions.py); the graph around the regions runs as FX code."""
        gm = _own_graph(gm)
        bind_weights(gm, example_inputs)  # marks the layers' weights read: nothing fuses them later
        if self.config.fuse_projections == "on":
            # A fused group's parameters are views of one weight, and dynamo's invoke_subgraph
            # refuses a region's inputs that share a storage: every later trace would fail.
            log.info("fuse_projections: not inside compile regions "
                     "(invoke_subgraph refuses inputs that share a storage)")
        pool_nodes = pool_inputs(gm.graph, example_inputs, self._caches()) if self.pool is not None else {}
        inner = _inner_compiler(self.config, lowering)
        records, feeds, lowered = [], [], {}
        found = regions.find_regions(gm)
        state = regions.written_operands(gm, found)
        context = torch._guards.TracingContext.try_get()
        mode = context.fake_mode if context is not None and context.fake_mode is not None else fake_mode_of(gm.graph)
        for region in map(regions.own_region, found):
            regions.adopt_fake_mode(region, mode)
            if self.pool is not None:
                bind_region_pool(region, self.pool, pool_nodes)
            bind_weights(region.module, [])  # its weights differ per call: none to fuse
            region.module.meta[regions.OUTER_SOURCES] = regions.OuterSources(region)
            captured = {node: i for i, node in enumerate(region.placeholders())}
            common = region.common_operands()
            records += self.manager.run(region.module, self._passes(lowering)).records
            del region.module.meta[regions.OUTER_SOURCES]  # the outer graph changes from here on
            feed = lowering.host_feed(region.module, self.parallel.dcp_rank)
            host = {}  # host-fed placeholder: (the outer placeholder, its example)
            if feed is not None:
                feed.share([earlier for _, earlier in feeds])
                self.host_slot.feed(feed)
                made = regions.add_outer_inputs(
                    gm, [f"{region.name}_host_{i}" for i in range(len(feed.examples()))], feed.examples())
                host = dict(zip(feed.placeholders, zip(made, feed.examples())))
                feeds.append((region, feed))
            invariant = {node: common[i] for node, i in captured.items()
                         if isinstance(common.get(i), fx.Node) and common[i] not in state}
            invariant.update({node: outer for node, (outer, _) in host.items()})
            # A region called once passes every operand alike: moving what it computes from them out
            # would run the layer's own work as FX code, outside the inner compiler; nothing to share.
            hoisted = regions.hoist_invariants(gm, region, invariant) if len(region.calls) > 1 else {}
            per_call = region.module.meta.get(PER_CALL_INPUTS, {})
            sources, inputs = [], []
            for node in region.placeholders():
                if node in captured:
                    sources.append(captured[node])
                elif node in host:
                    sources.append(host[node][0])
                elif node in hoisted:
                    sources.append(hoisted[node])
                elif node.name in per_call:
                    sources.append(regions.per_call_attributes(gm, per_call[node.name], region.calls))
                else:
                    raise RuntimeError(f"compile region {region.name}: nothing feeds its input {node.name}")
                inputs.append(host[node][1] if node in host else fake_value(node))
            compiled = inner(region.module, inputs)
            finish_fusion(region.module)
            if feed is not None:
                compiled = _telling_runs(compiled, self.host_slot, feed)
            regions.replace_calls(gm, region, compiled, sources)
            lowered[regions.module_name(region)] = region
        for region, feed in feeds:
            feed.read_elsewhere = frozenset(holder.meta[BATCH_INPUT] for i, holder in enumerate(region.placeholders())
                                            if BATCH_INPUT in holder.meta and regions.read_outside(region, i, lowered))
        gm.recompile()
        report = PassReport(records)
        self.reports.append(report)
        log.info("dcp_compile graph %d (%d compile regions): %s", len(self.reports) - 1, len(lowered), report.summary())
        if not feeds:
            return gm.forward
        slot, step = self.host_slot, gm.forward

        def run(*args):
            return step(*args, *(value for _, feed in feeds for value in slot.feed(feed)))

        return run
