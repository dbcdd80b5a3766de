"""The torch.compile backend: run the DCP pass pipeline, then the inner compiler."""

from __future__ import annotations

import logging
import os

import torch
import torch.fx as fx

from dcp_compile.config import DCPConfig
from dcp_compile.passes import PassConfig, PassManager, PassReport
from dcp_compile.passes.sites import count_mla_sites
from dcp_compile.runtime.parallel import ParallelState

log = logging.getLogger("dcp_compile")


def pass_config(config: DCPConfig, parallel: ParallelState, strategy: str) -> PassConfig:
    return PassConfig(
        dcp_size=config.dcp_size,
        dcp_rank=parallel.dcp_rank,
        interleave=config.interleave,
        dcp_group_name=parallel.dcp_group_name,
        debug_checks=config.debug_checks,
        attention_strategy=strategy,
        kernels=config.kernels,
    )


class DCPBackend:
    """A torch.compile backend for one attention strategy. Keeps one PassReport per captured
    graph in `reports`."""

    def __init__(self, config: DCPConfig, parallel: ParallelState, strategy: str = "gather-q"):
        self.config, self.strategy = config, strategy
        dump_dir = config.dump_dir or os.environ.get("DCP_COMPILE_DUMP") or None
        if dump_dir and config.dcp_size > 1:
            dump_dir = os.path.join(dump_dir, strategy)
        self.manager = PassManager(pass_config(config, parallel, strategy), config.disabled_passes, dump_dir)
        self.reports: list[PassReport] = []

    def __call__(self, gm: fx.GraphModule, example_inputs):
        if self.config.dcp_size > 1 and count_mla_sites(gm.graph) == 0:
            raise ValueError(
                "the captured graph has no MLA site (dcp::mla_attention): DCP has nothing to shard. "
                "Write attention with dcp_compile.ops.mla_kv_write / mla_attention."
            )
        report = self.manager.run(gm)
        self.reports.append(report)
        log.info("dcp_compile graph %d: %s", len(self.reports) - 1, report.summary())
        if self.config.inner_compile == "inductor":
            from torch._inductor.compile_fx import compile_fx

            return compile_fx(gm, example_inputs)
        return gm.forward
