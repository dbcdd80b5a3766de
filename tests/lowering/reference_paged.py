"""A kernel back end of the tests' own, registered from outside the package: attention over the
pool reads each rank's shard through a host-fed block table and host-fed lengths, as a paged
kernel does, computed with the torch reference. It owns its parts as a built-in back end does:
its Options (`reference_paged_layout`: the pool's rows packed, or in its own split layout), its
KV layout (ReferenceSplitLayout, the pool allocating what it declares), its op
(`tests_reference_paged::attention`, which reads either layout). Everything else is the
package's interface: the Lowering object, the shared paged split, the host placeholders, the
generic HostFeed and the split_kv_cache pass. The CLI finds it through DCP_COMPILE_BACKENDS."""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from dcp_compile.lowering import paged, registry
from dcp_compile.lowering.base import Lowering, Options
from dcp_compile.lowering.kv_layout import SplitKVCache, SplitLayout
from dcp_compile.ops import reference
from dcp_compile.ops.targets import WINDOW_QUERIES
from dcp_compile.passes import sites
from dcp_compile.passes.base import GraphPass, PassConfig
from dcp_compile.passes.graph_utils import call, fake_value
from dcp_compile.runtime import layout
from dcp_compile.runtime.host_inputs import HostFeed, host_placeholders
from dcp_compile.runtime.host_metadata import block_table_width

NAME = "reference-paged"


LAYOUTS = ("packed", "split")


@dataclass(frozen=True)
class ReferencePagedOptions(Options):
    reference_paged_layout: str = field(default="packed", metadata={
        "choices": LAYOUTS, "help": "the pool's rows packed, or split in the tests' own layout"})
    """'packed': one [rows, R + P] tensor per layer; 'split': ReferenceSplitLayout."""


class ReferenceSplitLayout(SplitLayout):
    """The tests' own layout: latent and rope as two [rows, D] tensors under a name of its own,
    read only through the ops that take a rope_cache (row_major False: no slice of the packed
    cache stands for a part, so any other reader is an error at compile)."""

    name = "reference-split"
    row_major = False

    def part_shapes(self, rows, kv_lora_rank, rope_dim, pool):
        return (rows, kv_lora_rank), (rows, rope_dim)


@torch.library.custom_op("tests_reference_paged::attention", mutates_args=())
def attention(q_latent: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
              q_seq_ids: torch.Tensor, kv_lens: list[int], block_size: int, sm_scale: float,
              rope_cache: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Every query of row b sees the first kv_lens[b] keys of its row's blocks (of the packed
    cache, or of the split one's latent `kv_cache` and `rope_cache`)."""
    rows, blocks = block_table.shape
    columns = torch.arange(blocks * block_size)
    page_table = block_table.long()[:, columns // block_size] * block_size + columns % block_size
    positions = columns.expand(rows, -1)
    sees_all = torch.full(q_seq_ids.shape, blocks * block_size, dtype=torch.int64)
    return reference.partial_attention(q_latent, q_rope, kv_cache, page_table, torch.tensor(kv_lens), positions,
                                       q_seq_ids, sees_all, sm_scale, rope_cache)


@attention.register_fake
def _(q_latent, q_rope, kv_cache, block_table, q_seq_ids, kv_lens, block_size, sm_scale, rope_cache=None):
    tokens, heads, _ = q_latent.shape
    return q_latent.new_empty(q_latent.shape), q_latent.new_empty((tokens, heads), dtype=torch.float32)


class LowerReferencePaged(GraphPass):
    name = "lower_reference_paged"

    def applies(self, config: PassConfig) -> bool:
        return config.attention_strategy == "gather-q"

    def run(self, gm: fx.GraphModule, config: PassConfig) -> int:
        found = sites.find_pool_attention(gm.graph, config.dcp_size)
        block_size = layout.require_local_block_size(config.page_size, config.dcp_size, config.interleave, NAME)
        host = None
        for site in found:
            tokens = fake_value(site.q_latent).shape[0]
            rows, width = fake_value(site.req_to_token).shape
            host = host or paged.HostPlaceholders(gm.graph, rows, tokens, block_table_width(width, config.page_size),
                                                  fake_value(site.cache).device)

            def kernel(graph, site, q_latent, q_rope, decode):
                lens = host.local_lens() if decode else host.prefix_lens()
                out = call(graph, torch.ops.tests_reference_paged.attention.default, q_latent, q_rope, site.cache,
                           host.block_table(), site.q_seq_ids, lens, block_size, site.sm_scale)
                return tuple(call(graph, operator.getitem, out, i) for i in range(2))

            paged.lower_pool_attention(gm.graph, site, kernel, split=True, reader=NAME)
        return len(found)


class ReferencePaged(Lowering):
    name = NAME
    description = "paged decode on the torch reference (the tests' own back end)"
    Options = ReferencePagedOptions
    options = ReferencePagedOptions()

    window = WINDOW_QUERIES
    plans_on_host = True

    @property
    def kv_layout(self):
        """Its own layout where its option asks for it, else the pool's packed rows."""
        return ReferenceSplitLayout() if self.options.reference_paged_layout == "split" else Lowering.kv_layout

    def static_shapes(self, strategy: str, config) -> bool:
        return strategy == "gather-q"

    def page_size(self, dcp_size: int, interleave: int, block_size: int) -> int:
        return block_size * dcp_size

    def check_layout(self, page_size: int, dcp_size: int, interleave: int) -> None:
        layout.require_local_block_size(page_size, dcp_size, interleave, NAME)

    def passes(self) -> list:
        if self.options.reference_paged_layout == "split":
            readers = {torch.ops.tests_reference_paged.attention.default: 2}
            return [LowerReferencePaged(), SplitKVCache(readers=readers)]
        return [LowerReferencePaged()]

    def host_feed(self, gm: fx.GraphModule, dcp_rank: int):
        return HostFeed(gm.graph, dcp_rank) if host_placeholders(gm.graph) else None


registry.register(ReferencePaged())
