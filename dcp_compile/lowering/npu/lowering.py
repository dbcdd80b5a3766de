"""Ascend as a back end: FIA over the pool and npu_attention_update for the merge (torch_npu's
ops, or their stand-ins on the emulated device where torch_npu is absent); the shared Triton
kernels under triton-ascend for the rest on an NPU. It owns its options (options.NPUOptions), its
KV layouts (split, or NZ: kv_layout.py), its ops (`dcp_npu::`, ops.py) and its inner compiler
(torchair, inner_compile.py)."""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch.fx as fx

from dcp_compile.lowering.base import POOL_STRATEGIES, Lowering
from dcp_compile.lowering.kv_layout import SplitKVCache
from dcp_compile.lowering.npu.feed import FIAFeed
from dcp_compile.lowering.npu import inner_compile
from dcp_compile.lowering.npu import native_ops, versions
from dcp_compile.lowering.npu.kv_layout import PART_VIEWS, NPUSplitLayout, NZLayout
from dcp_compile.lowering.npu.native import LowerNativeKernels
from dcp_compile.lowering.npu.lower_attention import (DEFAULT_BLOCK_SIZE, MAX_UPDATE_SHARDS, LowerNPUAttention,
                                                      fia_block_size, has_fia_v2, has_scatter_pa_kv_cache, padded_heads)
from dcp_compile.lowering.npu.options import NPUOptions
from dcp_compile.lowering.triton.lower_kernels import LowerKernels
from dcp_compile.ops import nz
from dcp_compile.ops.targets import WINDOW_QUERIES
from dcp_compile.runtime.host_inputs import host_placeholders

log = logging.getLogger("dcp_compile.lowering")


class NPULowering(Lowering):
    name = "npu"
    description = ("Ascend FIA + npu_attention_update (torch_npu; stand-ins on the emulated device); native ops for the "
                   "rest, or the Triton kernels (npu_kernels)")
    Options = NPUOptions
    options = NPUOptions()
    window = WINDOW_QUERIES
    plans_on_host = True
    default_block_size = DEFAULT_BLOCK_SIZE
    model_dims = (512, 64)  # FIA's MLA path (docs/ascend.md §4.1)
    dtypes = (torch.bfloat16, torch.float16)  # docs/ascend.md §4.6
    inner_compilers = ("eager", "torchair")  # inductor does not lower the torch_npu ops
    baseline = "npu"  # the stand-in's bf16 FIA rounds unlike the reference: compare FIA with FIA

    @property
    def kv_layout(self):
        """Split, as FIA copies strided key views whole (docs/ascend.md §11.1); NZ where its options
        say; with the native KV write's reserved block (kv_layout.py) under npu_kernels='native'."""
        native = self.options.npu_kernels == "native"
        return NZLayout(native) if self.options.npu_kv_format == "nz" else NPUSplitLayout(native)

    def unsupported_reasons(self, pool, config, model=None) -> list[str]:
        if pool.device.type not in ("npu", "meta"):
            return [f"its kernels run on an npu device (torch_npu, or the emulated one: DCP_COMPILE_NPU_EMULATOR=1), "
                    f"and the KV pool is on {pool.device}"]
        reasons = []
        if pool.dtype not in self.dtypes:
            reasons.append(f"it needs a bf16 or fp16 KV cache (FIA's query and KV dtypes, docs/ascend.md §4.6), got "
                           f"{pool.dtype}")
        if (pool.kv_lora_rank, pool.rope_dim) != self.model_dims:
            reasons.append(f"FIA's MLA path needs kv_lora_rank 512 and a rope dim of 64 (docs/ascend.md §4.1), got "
                           f"{pool.kv_lora_rank} and {pool.rope_dim}")
        if config.dcp_size > MAX_UPDATE_SHARDS:
            reasons.append(f"npu_attention_update merges at most {MAX_UPDATE_SHARDS} shards, dcp_size is {config.dcp_size}")
        if pool.device.type == "npu":  # the SoC, CANN, torch_npu and triton-ascend this runs on (docs/ascend.md §18)
            reasons.extend(versions.unsupported_reasons(self.options, versions.deployment()))
            if config.inner_compile == "torchair":
                missing = inner_compile.torchair_missing(self.options.torchair_mode)
                if missing is not None:
                    reasons.append(missing)
        if self.options.npu_kernels == "native" and not has_scatter_pa_kv_cache():
            reasons.append("npu_kernels='native' writes the KV through torch_npu.npu_scatter_pa_kv_cache, which this "
                           "torch_npu lacks: use a newer torch_npu (docs/ascend.md §18), or npu_kernels='triton'")
        if self.options.npu_kernels == "triton" and pool.device.type == "npu" and self._interpreter_off():
            reasons.append("on the emulated npu device its Triton kernels (KV writes, window attention, pack and merge) "
                           "run in Triton's interpreter: set TRITON_INTERPRET=1 too")
        try:
            block = fia_block_size(pool.page_size, config.dcp_size, config.interleave, self.options.fia_block_sizes)
        except ValueError as exc:
            return reasons + [str(exc)]
        if self.options.npu_kv_format == "nz" and block != nz.BLOCK:
            reasons.append(f"npu_kv_format='nz' needs FIA blocks of {nz.BLOCK} rows (docs/ascend.md §11.4); the pages "
                           f"give {block} (block_size {block}): use --block-size {nz.BLOCK}")
        if self.options.fia_version == 2 and not has_fia_v2():
            reasons.append("fia_version=2 needs torch_npu's npu_fused_infer_attention_score_v2, which this torch_npu "
                           "lacks (it came with torch_npu 2.6.0.post3 / 2.7.1, docs/ascend.md §15.2): use fia_version=1 "
                           "or a newer torch_npu")
        heads = getattr(model, "num_local_heads", None)
        if heads is not None:
            try:
                padded_heads(heads * config.dcp_size)
            except ValueError as exc:
                reasons.append(str(exc))
        return reasons

    @staticmethod
    def _interpreter_off() -> bool:
        """On the emulated device (the host) the Triton kernels of the lowering run only in Triton's interpreter."""
        from dcp_compile.lowering import triton as triton_kernels
        from dcp_compile.runtime.devices import emulated_npu

        return emulated_npu() and triton_kernels.available() and not triton_kernels.interpreted()

    def device_counters(self) -> dict | None:
        """The emulated npu's counts (dcp_compile.testing.npu_emulator); nothing counts them on hardware."""
        from dcp_compile.runtime.devices import emulated_npu

        if not emulated_npu():
            return None
        from dcp_compile.testing import npu_emulator

        return {"host_syncs": npu_emulator.host_syncs(), "ops_off_device": npu_emulator.ops_off_device()}

    def windowed(self, dcp_size: int) -> bool:
        """Native: FIA runs a chunk of any length as pieces of 16 queries (LowerNPUAttention)."""
        return self.options.npu_kernels != "native"

    def prefers_gather_q(self) -> bool:
        """Native: its gather-kv attention (dcp_npu.partial_attention) is dense over the gathered rows,
        where gather-q runs FIA over the pool."""
        return self.options.npu_kernels == "native"

    def prepare(self, pool, config) -> None:
        if pool.device.type == "npu":
            for advice in versions.advisories(self.options, versions.deployment()):
                log.warning("kernels='npu': %s", advice)

    def inner_compiler(self, name: str):
        if name != "torchair":
            return super().inner_compiler(name)
        return inner_compile.outside_device_graphs(inner_compile.torchair_compiler(self.options.torchair_mode))

    def step_options(self, host) -> NPUOptions | None:
        """npu_verify='mask' lowers a graph's rows to the masked FIA by its shape (T = B x S), which
        only a batch of rows of S queries each fits: a step whose rows' query counts differ (a
        prefill or extend whose tokens happen to divide evenly over its rows) runs the graph
        lowered under npu_verify='split', which serves every batch. Read from the host metadata
        (the same on every rank), so every rank runs the same lowering."""
        if self.options.npu_verify != "mask":
            return None
        if host is not None and len(set(host.query_lens)) > 1:
            return dataclasses.replace(self.options, npu_verify="split")
        return self.options

    def static_shapes(self, strategy: str, config) -> bool:
        return strategy in POOL_STRATEGIES or config.inner_compile == "torchair"

    def page_size(self, dcp_size: int, interleave: int, block_size: int) -> int:
        """One FIA block per rank per page (interleave 1), or one rank per page (interleave = block)."""
        if interleave not in (1, block_size):
            raise ValueError(f"kernels='npu' reads pages as FIA blocks: interleave must be 1 or the block size "
                             f"{block_size}, got {interleave}")
        return block_size * dcp_size if interleave == 1 else block_size

    def check_layout(self, page_size: int, dcp_size: int, interleave: int) -> None:
        fia_block_size(page_size, dcp_size, interleave, self.options.fia_block_sizes)

    def passes(self) -> list:
        if self.options.npu_kernels == "native":
            return [LowerNPUAttention(self.options), LowerNativeKernels(self.options),
                    SplitKVCache(PART_VIEWS, readers={native_ops.PARTIAL_ATTENTION: 2,
                                                   native_ops.SCATTER_KV_CACHE: 0})]
        # meta: what the dump captures; its graphs show the kernels an NPU runs.
        return [LowerNPUAttention(self.options), LowerKernels(devices=("npu", "meta")), SplitKVCache(PART_VIEWS)]

    def host_feed(self, gm: fx.GraphModule, dcp_rank: int):
        return FIAFeed(gm, dcp_rank) if host_placeholders(gm.graph) else None
