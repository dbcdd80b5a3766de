"""Ascend as a back end: FIA over the pool and npu_attention_update for the merge (torch_npu's
ops, or their CPU stand-ins where torch_npu is absent); the shared Triton kernels under
triton-ascend for the rest on an NPU."""

from __future__ import annotations

import copy

import torch
import torch.fx as fx

from dcp_compile.lowering.base import Lowering
from dcp_compile.lowering.kv_layout import SplitKVCache
from dcp_compile.lowering.npu.feed import FIAFeed
from dcp_compile.lowering.npu.lower_attention import (MAX_UPDATE_SHARDS, LowerNPUAttention, NPUOptions, fia_block_size,
                                                      has_fia_v2, padded_heads)
from dcp_compile.ops import nz
from dcp_compile.ops.targets import WINDOW_QUERIES
from dcp_compile.lowering.triton.lower_kernels import LowerKernels
from dcp_compile.runtime.devices import require_torch_npu
from dcp_compile.runtime.host_inputs import host_placeholders


class NPULowering(Lowering):
    name = "npu"
    description = "Ascend FIA + npu_attention_update (torch_npu; CPU stand-ins without it), Triton for the rest"
    window = WINDOW_QUERIES
    plans_on_host = True
    kv_layout = "split"  # FIA copies strided key views whole (docs/ascend.md §11.1)
    model_dims = (512, 64)  # FIA's MLA path (docs/ascend.md §4.1)
    dtypes = (torch.bfloat16, torch.float16)  # docs/ascend.md §4.6
    baseline = "npu"  # the stand-in's bf16 FIA rounds unlike the reference: compare FIA with FIA
    options = ("fia_block_sizes", "npu_kv_format", "fia_version", "npu_verify")
    npu_options = NPUOptions()

    def configured(self, config) -> "NPULowering":
        chosen = NPUOptions(config.npu_kv_format, config.fia_version, config.npu_verify)
        if chosen == self.npu_options:
            return self
        lowering = copy.copy(self)
        lowering.npu_options = chosen
        lowering.kv_layout = "nz" if chosen.kv_format == "nz" else "split"
        return lowering

    def unsupported_reason(self, pool, config) -> str | None:
        if pool.device.type not in ("npu", "meta"):
            return (f"its kernels run on an npu device (torch_npu, or the emulated one: DCP_COMPILE_NPU_EMULATOR=1), "
                    f"and the KV pool is on {pool.device}")
        return super().unsupported_reason(pool, config)

    def check(self, model, pool, config) -> None:
        if pool.device.type == "npu":
            require_torch_npu("a KV pool on an NPU")
            self._check_triton_runs(pool)
        elif pool.device.type != "meta":
            raise RuntimeError(f"kernels='npu': {self.unsupported_reason(pool, config)}")
        if pool.dtype not in self.dtypes:
            raise TypeError(f"kernels='npu' needs a bf16 or fp16 KV cache (FIA's query and KV dtypes, docs/ascend.md "
                            f"§4.6), got {pool.dtype}")
        if (pool.kv_lora_rank, pool.rope_dim) != self.model_dims:
            raise ValueError(f"FIA's MLA path needs kv_lora_rank 512 and a rope dim of 64 (docs/ascend.md §4.1), got "
                             f"{pool.kv_lora_rank} and {pool.rope_dim}")
        if config.dcp_size > MAX_UPDATE_SHARDS:
            raise ValueError(f"npu_attention_update merges at most {MAX_UPDATE_SHARDS} shards, dcp_size is {config.dcp_size}")
        block = fia_block_size(pool.page_size, config.dcp_size, config.interleave, config.fia_block_sizes)
        self._check_options(config, block)
        heads = getattr(model, "num_local_heads", None)
        if heads is not None:
            padded_heads(heads * config.dcp_size)

    @staticmethod
    def _check_triton_runs(pool) -> None:
        """On the emulated device (the host) the Triton kernels of the lowering run only in Triton's interpreter."""
        from dcp_compile.lowering import triton as triton_kernels
        from dcp_compile.runtime.devices import emulated_npu

        if emulated_npu() and triton_kernels.available() and not triton_kernels.interpreted():
            raise RuntimeError("kernels='npu' on the emulated npu device runs its Triton kernels (KV writes, window "
                               "attention, pack and merge) in Triton's interpreter: set TRITON_INTERPRET=1 too")

    @staticmethod
    def _check_options(config, block: int) -> None:
        """The combinations of apply's npu options the docs forbid, or that this install cannot run."""
        if config.npu_kv_format == "nz" and block != nz.BLOCK:
            raise ValueError(f"npu_kv_format='nz' needs FIA blocks of {nz.BLOCK} rows (docs/ascend.md §11.4); the pages "
                             f"give {block} (block_size {block}): use --block-size {nz.BLOCK}")
        if config.fia_version == 2 and not has_fia_v2():
            raise RuntimeError("fia_version=2 needs torch_npu's npu_fused_infer_attention_score_v2, which this torch_npu "
                               "lacks (it came with torch_npu 2.6.0.post3 / 2.7.1, docs/ascend.md §15.2): use "
                               "fia_version=1 or a newer torch_npu")

    def static_shapes(self, strategy: str) -> bool:
        return strategy == "gather-q"

    def page_size(self, dcp_size: int, interleave: int, block_size: int) -> int:
        """One FIA block per rank per page (interleave 1), or one rank per page (interleave = block)."""
        if interleave not in (1, block_size):
            raise ValueError(f"kernels='npu' reads pages as FIA blocks: interleave must be 1 or the block size "
                             f"{block_size}, got {interleave}")
        return block_size * dcp_size if interleave == 1 else block_size

    def check_layout(self, page_size: int, dcp_size: int, interleave: int) -> None:
        fia_block_size(page_size, dcp_size, interleave)

    def passes(self) -> list:
        # meta: what the dump captures; its graphs show the kernels an NPU runs.
        return [LowerNPUAttention(self.npu_options), LowerKernels(devices=("npu", "meta")), SplitKVCache()]

    def host_feed(self, gm: fx.GraphModule, dcp_rank: int):
        return FIAFeed(gm, dcp_rank) if host_placeholders(gm.graph) else None
