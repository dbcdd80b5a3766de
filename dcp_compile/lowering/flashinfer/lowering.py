"""FlashInfer's batch MLA kernel (fa3, Hopper) as the back end of attention over the pool, the
Triton kernels for the rest; on a CPU pool, the torch stand-in of FlashInfer's wrapper."""

from __future__ import annotations

import torch.fx as fx

from dcp_compile.lowering import flashinfer
from dcp_compile.lowering.base import Lowering
from dcp_compile.lowering.flashinfer.lower_attention import LowerFlashInferAttention, flashinfer_block_size
from dcp_compile.lowering.flashinfer.plans import PLAN_SPECS, FlashInferFeed
from dcp_compile.ops.targets import WINDOW_QUERIES
from dcp_compile.lowering.triton.lower_kernels import LowerKernels
from dcp_compile.lowering.triton.lower_projections import LowerProjections, tuned_for
from dcp_compile.runtime import layout


class FlashInferLowering(Lowering):
    name = "flashinfer"
    description = "FlashInfer's MLA kernel over the pool (CUDA, Hopper; a torch stand-in on CPU), Triton for the rest"
    window = WINDOW_QUERIES
    plans_on_host = True

    def unsupported_reason(self, pool, config) -> str | None:
        if pool.device.type != "cpu":
            reason = flashinfer.unsupported_reason(pool.device, pool.kv_lora_rank, pool.rope_dim, pool.dtype)
            if reason is not None:
                return reason
        if layout.local_block_size(pool.page_size, config.dcp_size, config.interleave) is None:
            return (f"page size {pool.page_size} with interleave {config.interleave} over dcp_size {config.dcp_size} "
                    "does not map onto whole local blocks (FlashInfer's pages)")
        return None

    def check(self, model, pool, config) -> None:
        if pool.device.type != "cpu":
            reason = flashinfer.unsupported_reason(pool.device, pool.kv_lora_rank, pool.rope_dim, pool.dtype)
            if reason is not None:
                raise RuntimeError(f"kernels='flashinfer': {reason}")
        self.check_layout(pool.page_size, config.dcp_size, config.interleave)

    def check_layout(self, page_size: int, dcp_size: int, interleave: int) -> None:
        flashinfer_block_size(page_size, dcp_size, interleave)

    def prepare(self, pool, config) -> None:
        if pool.device.type == "cuda":  # the nvcc build of its kernel here, not in the first step
            block_size = flashinfer_block_size(pool.page_size, config.dcp_size, config.interleave)
            flashinfer.warm_up(pool.device, pool.kv_lora_rank, pool.rope_dim, pool.dtype, block_size)

    def skinny_matmuls(self, pool) -> bool:
        return tuned_for(pool.device)

    def inner_compile(self, pool) -> str:
        # On CUDA inductor compiles the model around the attention kernels: a 61-layer Kimi-K2
        # decode step at batch 4, 128k ran 18.1 ms against 25.4 ms eager (bench/results/step_h200.json).
        return "inductor" if pool.device.type == "cuda" else "eager"

    def windowed(self, dcp_size: int) -> bool:
        return dcp_size > 1  # at dcp_size 1 FlashInfer's own causal mask serves any chunk

    def static_shapes(self, strategy: str) -> bool:
        return strategy == "gather-q"

    def passes(self) -> list:
        return [LowerFlashInferAttention(), LowerKernels(devices=("cuda",)), LowerProjections(devices=("cuda",))]

    def host_feed(self, gm: fx.GraphModule, dcp_rank: int):
        return FlashInferFeed(gm, dcp_rank) if gm.meta.get(PLAN_SPECS) else None
