"""The NPU back end's KV layouts: split (a layer's latent and rope rows, two contiguous tensors,
lowering/kv_layout.py) or NZ (npu_kv_format='nz': each part in the NZ layout over the local
blocks of the pages, [blocks, 1, D/16, block, 16], ops/nz.py; FIA with an NZ cache, the Ascend A5
layout, docs/ascend.md §11.4, §15). FIA reads NZ parts through `dcp_npu.nz_kv_blocks`, which the
split_kv_cache pass replaces by the pool's tensors.

Under npu_kernels='native' each part holds one local block more than the locations' rows: the
reserved block, which no location maps to and no block table names. npu_scatter_pa_kv_cache
writes every token it is handed at a slot in [0, blocks x block) (its contract: docs/ascend.md
§17); the tokens a rank does not keep (another rank's, padding) go to the reserved block's first
row (native_ops.slot_mapping), as SGLang's NPU pool writes padding to a dummy slot."""

from __future__ import annotations

import torch
import torch.fx as fx

from dcp_compile.lowering.kv_layout import SplitLayout
from dcp_compile.lowering.npu.ops import NZ_KV_BLOCKS
from dcp_compile.ops import nz
from dcp_compile.runtime import layout


class NPUSplitLayout(SplitLayout):
    """The split layout, with the reserved block of the native KV write where `reserved_block`."""

    def __init__(self, reserved_block: bool = False):
        self.reserved_block = reserved_block

    def reserved_rows(self, pool) -> int:
        if not self.reserved_block:
            return 0
        return layout.require_local_block_size(pool.page_size, pool.dcp_size, pool.interleave,
                                               "the native KV write's reserved block")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(reserved_block={self.reserved_block})"


class NZLayout(NPUSplitLayout):
    name = "nz"
    row_major = False

    def part_shapes(self, rows: int, kv_lora_rank: int, rope_dim: int, pool) -> tuple[tuple[int, ...], ...]:
        block = layout.require_local_block_size(pool.page_size, pool.dcp_size, pool.interleave, "the NZ KV layout")
        return nz.shape(rows, kv_lora_rank, block), nz.shape(rows, rope_dim, block)

    def part_rows(self, part: torch.Tensor) -> torch.Tensor:
        return nz.to_rows(part)


def check_nz_view(call: fx.Node, pool) -> None:
    """`dcp_npu.nz_kv_blocks(cache, R, block)` must read the pool's NZ parts as they are."""
    block = nz.block_of(pool.parts(0)[0]) if isinstance(pool.layout, NZLayout) else None
    if block is None or call.args[1] != pool.kv_lora_rank or call.args[2] != block:
        held = pool.layout.name + (f" with blocks of {block}" if block is not None else "")
        raise ValueError(f"dcp_npu.nz_kv_blocks{tuple(call.args[1:])} reads NZ blocks, but the pool's layout is {held}")


PART_VIEWS = {NZ_KV_BLOCKS: check_nz_view}
"""The NPU back end's ops that view a cache's parts (SplitKVCache's part_views)."""
