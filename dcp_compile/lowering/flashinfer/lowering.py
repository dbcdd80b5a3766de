"""FlashInfer's batch MLA kernel (fa3, Hopper) as the back end of attention over the pool, the
Triton kernels for the rest (so the Triton back end's options and choices are its own too); on a
CPU pool, the torch stand-in of FlashInfer's wrapper (dcp_compile/testing)."""

from __future__ import annotations

import torch.fx as fx

from dcp_compile.lowering import flashinfer
from dcp_compile.lowering.base import POOL_STRATEGIES
from dcp_compile.lowering.flashinfer.lower_attention import LowerFlashInferAttention, flashinfer_block_size
from dcp_compile.lowering.flashinfer import plans
from dcp_compile.lowering.flashinfer.plans import PLAN_SPECS, FlashInferFeed
from dcp_compile.lowering.triton.lower_kernels import LowerKernels
from dcp_compile.lowering.triton.lowering import TritonLowering
from dcp_compile.ops.targets import WINDOW_QUERIES


class FlashInferLowering(TritonLowering):
    name = "flashinfer"
    description = "FlashInfer's MLA kernel over the pool (CUDA, Hopper; a torch stand-in on CPU), Triton for the rest"
    window = WINDOW_QUERIES
    plans_on_host = True

    def unsupported_reasons(self, pool, config, model=None) -> list[str]:
        if pool.device.type not in ("cpu", "meta"):  # the stand-in; the dump's shape-only capture
            reason = flashinfer.unsupported_reason(pool.device, pool.kv_lora_rank, pool.rope_dim, pool.dtype)
            if reason is not None:
                return [reason]
        try:
            self.check_layout(pool.page_size, config.dcp_size, config.interleave)
        except ValueError as exc:
            return [str(exc)]
        return []

    def check_layout(self, page_size: int, dcp_size: int, interleave: int) -> None:
        flashinfer_block_size(page_size, dcp_size, interleave)

    def prepare(self, pool, config) -> None:
        if pool.device.type == "cuda":  # the nvcc build of its kernel here, not in the first step
            block_size = flashinfer_block_size(pool.page_size, config.dcp_size, config.interleave)
            plans.warm_up(pool.device, pool.kv_lora_rank, pool.rope_dim, pool.dtype, block_size)

    def windowed(self, dcp_size: int) -> bool:
        return dcp_size > 1  # at dcp_size 1 FlashInfer's own causal mask serves any chunk

    def static_shapes(self, strategy: str, config) -> bool:
        # Its plans are sized by each step (plans.py), so a graph serves every batch shape; the
        # debug check of the host inputs reads one length per row.
        return strategy in POOL_STRATEGIES and config.debug_checks

    def folds_verify(self, pool) -> bool:
        # fa3 already packs a request's queries x heads into its tiles of 64/128 rows, and measured
        # faster than the folded Triton kernel: 2.2-4.4x at every verify case on an H100
        # (bench/results/gpu_h100_2026-12-06d/).
        return False

    def passes(self) -> list:
        fold = self.options.verify_attention == "folded"
        return [LowerFlashInferAttention(fold_verify=fold), LowerKernels(devices=("cuda",), fold_verify=fold),
                *self.projection_passes()]

    def host_feed(self, gm: fx.GraphModule, dcp_rank: int):
        return FlashInferFeed(gm, dcp_rank) if gm.meta.get(PLAN_SPECS) else None
