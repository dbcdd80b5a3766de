"""The scheme both paged lowerings (FIA, FlashInfer) share, written once: their kernels read a
rank's KV shard through a block table planned on the host, with one causal rule they cannot
express on a shard.

For each attention over the pool (sites.find_pool_attention):
- decode (one query per row, T == B): the kernel attends over every local key of the row;
- verify and short extend (T != B, at most WINDOW_QUERIES queries a row): on a shard a query's causal
  mask is by global position, which a paged kernel's own mask (aligned by local index) cannot
  express. The keys before a row's first query are visible to all its queries: the kernel
  attends over those, unmasked, and `dcp.window_attention` adds the <= WINDOW_QUERIES keys at or after
  it, merged by LSE. Longer chunks take the gather-kv strategy (the compiled model decides).

A lowering's pass is a `PagedAttentionPass` that gives its prefix kernel (`kernel`); the walk
over the sites, the split, the dtype of q_rope, the window and the error for long chunks are
here. `HostPlaceholders` adds the host-fed graph inputs such kernels read (runtime.host_inputs),
and `checked_block_table` the one debug check of them against the batch tensors.
"""

from __future__ import annotations

import operator
from typing import Callable

import torch
import torch.fx as fx
from torch._dynamo.source import ConstantSource
from torch.fx.experimental.symbolic_shapes import DimDynamic

from dcp_compile.lowering.base import POOL_STRATEGIES
from dcp_compile.ops import targets
from dcp_compile.passes.base import GraphPass, PassConfig
from dcp_compile.passes.replicated_q_attention import STRATEGY as REPLICATED_Q
from dcp_compile.passes.graph_utils import call, fake_mode_of, fake_value, replace_attention, size_of
from dcp_compile.passes.sites import PoolAttention, find_pool_attention
from dcp_compile.runtime.host_inputs import HOST_INPUT, HostInput
from dcp_compile.runtime.host_metadata import block_table_width

aten = torch.ops.aten


class HostPlaceholders:
    """The host-fed placeholders of one graph, created on first use, tagged for its HostFeed."""

    def __init__(self, graph: fx.Graph, rows: int, tokens: int, blocks: int, device: torch.device):
        self.graph, self.rows, self.tokens, self.blocks, self.device = graph, rows, tokens, blocks, device
        self._made: dict[tuple, object] = {}

    def placeholder(self, name: str, host_input: HostInput, example) -> fx.Node:
        last = [n for n in self.graph.nodes if n.op == "placeholder"][-1]
        with self.graph.inserting_after(last):
            node = self.graph.placeholder(name)
        node.meta["val"] = example
        node.meta[HOST_INPUT] = host_input
        return node

    def _ints(self, kind: str, examples: list[int]) -> list[fx.Node]:
        if kind not in self._made:
            self._made[kind] = [self.placeholder(f"dcp_{kind}_{b}", HostInput(kind, b), self._symbolic(f"dcp_{kind}_{b}", e))
                                for b, e in enumerate(examples)]
        return self._made[kind]

    def _symbolic(self, name: str, example: int):
        """A SymInt (hint: example) where the graph has a shape environment: an inner compiler
        that captures NPU graphs (torchair) then sees a symbolic input it refreshes before each
        replay, not a constant it bakes in (docs/ascend.md §9.4)."""
        shape_env = getattr(fake_mode_of(self.graph), "shape_env", None)
        if shape_env is None:
            return example
        return shape_env.create_unspecified_symint_and_symbol(example, ConstantSource(name), DimDynamic.DYNAMIC)

    def tensor(self, kind: str, index: int | None, shape, dtype) -> fx.Node:
        key = (kind, index)
        if key not in self._made:
            with fake_mode_of(self.graph):
                example = torch.empty(shape, dtype=dtype, device=self.device)
            name = f"dcp_{kind}" if index is None else f"dcp_{kind}_{index}"
            self._made[key] = self.placeholder(name, HostInput(kind, index), example)
        return self._made[key]

    def block_table(self) -> fx.Node:
        return self.tensor("block_table", None, (self.rows, self.blocks), torch.int32)

    def local_lens(self) -> list[fx.Node]:
        return self._ints("local_len", [1] * self.rows)

    def prefix_lens(self) -> list[fx.Node]:
        return self._ints("local_prefix_len", [0] * self.rows)

    def prefix_lens_tensor(self) -> fx.Node:
        """The rows' local prefix lengths as one device tensor [B] int64, fed each step."""
        return self.tensor("local_prefix_len", None, (self.rows,), torch.int64)

    def pieces(self, count: int) -> dict[str, object]:
        """The host inputs of a kernel that runs the batch as `count` pieces of at most
        WINDOW_QUERIES queries of one row (lowering/npu/pieces.py; a feed pads a batch's pieces to
        `count`): per piece its cumulative query count and local prefix length (host ints), and
        as device tensors its row [P], the prefix lengths [P] and each token's piece [T]."""
        return {"cumulative": self._ints("piece_cumulative_query_len",
                                         [(p + 1) * self.tokens // count for p in range(count)]),
                "prefix": self._ints("piece_prefix_len", [0] * count),
                "rows": self.tensor("piece_row", None, (count,), torch.int64),
                "prefix_tensor": self.tensor("piece_prefix_len", None, (count,), torch.int64),
                "token_piece": self.tensor("token_piece", None, (self.tokens,), torch.int64)}

    def query_lens(self) -> list[fx.Node]:
        return self._ints("query_len", [self.tokens // self.rows] * self.rows)

    def cumulative_query_lens(self) -> list[fx.Node]:
        # Example values: the tokens spread evenly over the rows (a kernel's fake checks them).
        return self._ints("cumulative_query_len", [(b + 1) * self.tokens // self.rows for b in range(self.rows)])


def checked_block_table(graph: fx.Graph, host: HostPlaceholders, site: PoolAttention, config: PassConfig,
                        block_size: int, decode: bool) -> fx.Node:
    """The block table a paged kernel reads; in debug mode, a copy made by the one check of the
    host-fed inputs against the batch tensors (dcp.check_host_metadata), so the check runs first."""
    table = host.block_table()
    if not config.debug_checks:
        return table
    lens = host.local_lens() if decode else None
    prefix = None if decode else host.prefix_lens()
    cumulative = None if decode else host.cumulative_query_lens()
    return call(graph, targets.CHECK_HOST_METADATA, table, site.req_to_token, site.seq_lens, site.q_seq_ids,
                site.q_positions, config.dcp_rank, config.dcp_size, config.interleave, block_size, lens, prefix,
                cumulative)


def is_decode(site: PoolAttention) -> bool:
    tokens = fake_value(site.q_latent).shape[0]
    rows = fake_value(site.req_to_token).shape[0]
    return tokens == rows


PrefixKernel = Callable[[fx.Graph, PoolAttention, fx.Node, fx.Node, bool], tuple[fx.Node, fx.Node]]
"""(graph, site, q_latent, q_rope, decode) -> (out, lse) over the row's keys before its first
query (every local key in decode; where the lowering does not split, each query's keys at or
before its position): out in q's dtype, fp32 natural-log lse, -inf where a row sees no key.
q_rope has q_latent's dtype."""


def site_key_positions(graph: fx.Graph, site: PoolAttention) -> fx.Node:
    """The global position of each page-table entry the site reads (its columns at dcp_size 1,
    where the page table is global)."""
    if site.key_positions is not None:
        return site.key_positions
    width = fake_value(site.req_to_token).shape[1]
    columns = call(graph, aten.arange.default, width, dtype=fake_value(site.req_to_token).dtype,
                   device=fake_value(site.req_to_token).device)
    return call(graph, aten.expand.default, columns, [size_of(graph, site.req_to_token, 0), width])


def window_attention(graph: fx.Graph, site: PoolAttention, out: fx.Node, lse: fx.Node, q_latent: fx.Node,
                     q_rope: fx.Node, window: int) -> tuple[fx.Node, fx.Node]:
    """dcp.window_attention: the keys at or after each row's first query, read through the page table."""
    completed = call(graph, targets.WINDOW_ATTENTION, out, lse, q_latent, q_rope, site.cache, site.page_table,
                     site.local_lens, site_key_positions(graph, site), site.q_seq_ids, site.q_positions, site.sm_scale,
                     window)
    return call(graph, operator.getitem, completed, 0), call(graph, operator.getitem, completed, 1)


WindowKernel = Callable[[fx.Graph, PoolAttention, fx.Node, fx.Node, fx.Node, fx.Node, int], tuple[fx.Node, fx.Node]]
"""(graph, site, out, lse, q_latent, q_rope, window) -> (out, lse) completed with the window's keys."""


def serves_chunk(site: PoolAttention, split: bool, any_chunk: bool) -> bool:
    """Whether a paged kernel serves this site's rows: decode, no split, a split that cuts any
    chunk into pieces, or at most WINDOW_QUERIES queries a row on average."""
    tokens, rows = fake_value(site.q_latent).shape[0], fake_value(site.req_to_token).shape[0]
    return tokens == rows or not split or any_chunk or tokens <= targets.WINDOW_QUERIES * rows


def lower_pool_attention(graph: fx.Graph, site: PoolAttention, kernel: PrefixKernel, split: bool, reader: str,
                         window: WindowKernel = window_attention, any_chunk: bool = False) -> None:
    """Replace one attention over the pool by `kernel`, plus `window` attention where `split`
    (verify and short extend rows; any chunk where `any_chunk`: a kernel that cuts rows into
    pieces of WINDOW_QUERIES queries itself); `reader` names the kernel in errors."""
    tokens = fake_value(site.q_latent).shape[0]
    rows, width = fake_value(site.req_to_token).shape
    decode = tokens == rows
    if not serves_chunk(site, split, any_chunk):
        raise ValueError(f"{reader} serves at most {targets.WINDOW_QUERIES} query tokens per request; this graph has {tokens} tokens "
                         f"over {rows} rows: longer chunks go through the gather-kv strategy")
    with graph.inserting_before(site.node):
        q_latent, q_rope = site.q_latent, site.q_rope
        if fake_value(q_rope).dtype != fake_value(q_latent).dtype:  # one query dtype (docs/ascend.md §4.6)
            q_rope = call(graph, aten._to_copy.default, q_rope, dtype=fake_value(q_latent).dtype)
        out, lse = kernel(graph, site, q_latent, q_rope, decode)
        if split and not decode:
            out, lse = window(graph, site, out, lse, q_latent, q_rope, min(targets.WINDOW_QUERIES, width))
    replace_attention(graph, site.node, site.returns_lse, out, lse, reader)


class PagedAttentionPass(GraphPass):
    """Lowers every attention over the pool of a gather-q or replicated-q graph to a paged kernel
    (`kernel`), on the host-fed block table and lengths, with the split where `split(config)`."""

    reader = ""
    """The kernel, as errors name it."""
    any_chunk = False
    """Whether its split serves rows of any query count (its kernel cuts them into pieces)."""
    reads_block_table = True
    """Whether its kernel reads the host-fed block table in the graph (else only a debug check
    does, and the graph has no such input without debug checks)."""

    def applies(self, config: PassConfig) -> bool:
        return config.attention_strategy in POOL_STRATEGIES

    def serves(self, config: PassConfig, site: PoolAttention) -> bool:
        """Whether the kernel takes this site's shape at all (a plan's capacity); one it does not
        stays for the back end's general kernels."""
        return True

    def _lowers(self, config: PassConfig, site: PoolAttention) -> bool:
        """Whether this site takes the paged kernel: where it `serves` the shape, and under
        replicated-q (which has no gather-kv graph to send longer chunks to) not for a chunk longer
        than the split serves, which stays for the back end's general kernels (under gather-q
        lower_pool_attention refuses it)."""
        if not self.serves(config, site):
            return False
        return config.attention_strategy != REPLICATED_Q or serves_chunk(site, self.split(config, site), self.any_chunk)

    def prepare(self, gm: fx.GraphModule) -> None:
        """Before the sites (register ops, reset per-graph state)."""

    def block_size(self, config: PassConfig) -> int:
        raise NotImplementedError

    def split(self, config: PassConfig, site: PoolAttention) -> bool:
        """Whether verify rows of this site take the split (prefix kernel + window attention); where
        not, `kernel` attends over every key of a row, causally, itself."""
        return True

    def kernel(self, graph: fx.Graph, site: PoolAttention, q_latent: fx.Node, q_rope: fx.Node, decode: bool,
               host: HostPlaceholders, block_table: fx.Node, block_size: int) -> tuple[fx.Node, fx.Node]:
        """The prefix kernel of one site (see PrefixKernel); block_table: the checked table (None
        where the kernel does not read it and debug checks are off)."""
        raise NotImplementedError

    def window(self, graph: fx.Graph, site: PoolAttention, out: fx.Node, lse: fx.Node, q_latent: fx.Node,
               q_rope: fx.Node, window: int) -> tuple[fx.Node, fx.Node]:
        """The window attention of split rows (see WindowKernel)."""
        return window_attention(graph, site, out, lse, q_latent, q_rope, window)

    def finish(self, gm: fx.GraphModule, config: PassConfig) -> int:
        """After the sites: the lowering's other rewrites; returns how many."""
        return 0

    def run(self, gm: fx.GraphModule, config: PassConfig) -> int:
        self.prepare(gm)
        graph = gm.graph
        found = [site for site in find_pool_attention(graph, config.dcp_size) if self._lowers(config, site)]
        if found:
            block_size = self.block_size(config)
            first = found[0]
            rows, width = fake_value(first.req_to_token).shape
            host = HostPlaceholders(graph, rows, fake_value(first.q_latent).shape[0],
                                    block_table_width(width, config.page_size), fake_value(first.cache).device)
            table = None
            if self.reads_block_table or config.debug_checks:
                with graph.inserting_before(first.node):
                    table = checked_block_table(graph, host, first, config, block_size, is_decode(first))

            def kernel(graph, site, q_latent, q_rope, decode):
                return self.kernel(graph, site, q_latent, q_rope, decode, host, table, block_size)

            self.host = host
            for site in found:
                lower_pool_attention(graph, site, kernel, self.split(config, site), self.reader, self.window,
                                     self.any_chunk)
        return len(found) + self.finish(gm, config)
