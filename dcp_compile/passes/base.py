"""The pass interface and the slice of configuration passes receive."""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx


@dataclass(frozen=True)
class PassConfig:
    """What passes may know: the DCP layout of this rank, never the model nor the kernels (a
    back end contributes its own lowering passes)."""

    dcp_size: int = 1
    dcp_rank: int = 0
    interleave: int = 1
    dcp_group_name: str | None = None
    debug_checks: bool = False
    attention_strategy: str = "gather-q"
    """How attention reaches the sharded KV: 'gather-q' (Q all-gather, partial attention, LSE
    merge) or 'gather-kv' (all-gather this batch's KV rows, attend with local heads)."""
    fuse_projections: bool = False
    """Fuse the projections that read one input into one matmul (passes/fuse_projections.py)."""
    page_size: int = 1
    """Locations per logical KV page (the pool's); paged kernels (FIA, FlashInfer) read local blocks of it."""


class GraphPass:
    """A graph pass. `applies` decides for itself; `run` rewrites in place, returns sites rewritten."""

    name: str = ""

    def applies(self, config: PassConfig) -> bool:
        return True

    def run(self, gm: fx.GraphModule, config: PassConfig) -> int:
        raise NotImplementedError
