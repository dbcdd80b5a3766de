"""Lower attention over the KV pool to Ascend FIA, and the LSE merge to npu_attention_update.

    before: o, lse = dcp.mla_partial_attention(q_lat [T,NH,R], q_rope, cache, *local_meta, ids, pos, s)
            (at dcp_size 1: o = dcp.mla_attention(q_lat, q_rope, cache, req_to_token, seq_lens, ids, pos, s))
    after (decode, T == B):
            o, lse = npu.npu_fused_infer_attention_score(q [B,1,Hp,R], key, key, query_rope, key_rope,
                         input_layout="BSND", block_table, block_size, actual_seq_lengths_kv=local_lens,
                         num_heads=Hp, num_key_value_heads=1, sparse_mode=0, softmax_lse_flag=True)
    after (verify, short extend: T != B, at most 16 queries a row):
            o, lse = npu.npu_fused_infer_attention_score(q [T,Hp,R], ..., input_layout="TND",
                         actual_seq_lengths=cumulative query lens, actual_seq_lengths_kv=local_prefix_lens)
            o, lse = dcp.window_attention(o, lse, q, q_rope, cache, *local_meta, ids, pos, s, 16)
    and     dcp.merge_partials(buf, R) -> npu.npu_attention_update(lses, outs, 0) over dcp.split_partials(buf, R)

key = cache[:, :R].view(blocks, block_size, R) and key_rope = cache[:, R:] likewise: a rank's
shard of the pool read as FIA's paged latent cache (value is the same latent, ASCEND.md §1.4).
Hp is the gathered head count padded to a power of two (FIA serves {1, 2, 4, ..., 128} query
heads, §1.4; padded heads have zero queries and are sliced off). FIA's empty shard gives
lse = +inf (§1.8); it is turned into the project's -inf at once, so pack and merge see one
convention.

Layouts. Decode uses BSND with S = 1: the gathered q [T, H, R] is that tensor as a view, FIA
ignores `actual_seq_lengths` at S = 1, and it is the layout SGLang's graph-mode MLA decode uses
(§6). Verify uses TND: rows carry different query counts (padded rows carry one), which BSND's
uniform S cannot express, and TND with D = 512 under PageAttention takes per-request kv lengths
(§1.6).

Verify's causal mask is by global position, which FIA's sparse_mode 3 cannot express on a shard
(it aligns by local index, §1.7). Of the two exact schemes, this pass splits: the keys before a
row's first query are visible to all its queries (one FIA call with no mask), and the <= k keys
at or after it go through `dcp.window_attention`, merged by LSE. At 128k context, batch 64,
k = 16, 64 gathered heads and N = 2, an explicit [B, 1, k, KV_S] mask would be 64 MiB per step,
rebuilt every step and read by every layer (61 x 64 MiB), while the split adds
B*k*H*k*1088 MACs = 1.1 GMAC per layer (0.01% of the 9.3 TMAC of the FIA call) and reads
B*k*16 rows; so the split.

Both calls run sparse_mode 0 without a mask, also verify's at up to 16 queries a row: every query
of a row sees every key it is given, so no mask is needed. The CANN tiling source accepts mode 0
for MLA (ASCEND.md §1.4, CheckFeatureMask), while the op documentation describes Q_S > 1 with
mode 3; the stand-in follows the source. Not yet run on Ascend hardware.

The lengths FIA takes are host lists (SymInt[], §1.6): they become graph inputs (placeholders
`dcp_local_len_<b>` etc., tagged meta['dcp_host_input']) that the backend feeds from the
runtime's host metadata on every call, so changing lengths never recompiles and the FIA node
shows which input feeds each argument. So does the block table (`dcp_block_table`).
gm.meta['dcp_fia_host_args'] lists, per FIA call in order, which host input feeds each of its
host-list arguments: what an NPU graph runner refreshes before each replay.

Assumes: rewrite_attention ran (dcp_size > 1) or the graph is the canonical one (dcp_size 1);
pages map onto whole local blocks (runtime/layout.local_block_size); the queries of a row are
the last query_lens[b] positions of its sequence, grouped by row (RequestTable's batches), which
debug mode checks (dcp.check_host_metadata).
Guarantees: every attention over the pool runs FIA; out and lse keep mla_partial_attention's
contract (out in q's dtype, fp32 lse, -inf where a row sees no key); a padded row (all shards
empty) merges to 0, never NaN.
Why a pass: the kernel and its layout depend on the deployment (Ascend), not on the model.
"""

from __future__ import annotations

import operator
import torch
import torch.fx as fx
from torch._dynamo.source import ConstantSource
from torch.fx.experimental.symbolic_shapes import DimDynamic

from dcp_compile.lowering.npu import ensure_ops
from dcp_compile.passes import sites
from dcp_compile.passes.base import GraphPass, PassConfig
from dcp_compile.passes.graph_utils import call, fake_mode_of, fake_value, replace_attention
from dcp_compile.runtime import layout
from dcp_compile.runtime.host_metadata import MAX_FIA_QUERY_TOKENS, block_table_width

aten = torch.ops.aten
FIA_HEAD_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128)  # ASCEND.md §1.4
FIA_MAX_BLOCK_SIZE = 1024  # §1.4: a multiple of 16, at most 1024
MAX_UPDATE_SHARDS = 16  # npu_attention_update: at most 16 inputs (§2)
WINDOW_ATTENTION = torch.ops.dcp.window_attention.default
SPLIT_PARTIALS = torch.ops.dcp.split_partials.default
CHECK_HOST_METADATA = torch.ops.dcp.check_host_metadata.default


def fia_op():
    return torch.ops.npu.npu_fused_infer_attention_score.default


def attention_update_op():
    return torch.ops.npu.npu_attention_update.default


def fia_block_size(config: PassConfig) -> int:
    block_size = layout.require_local_block_size(config.page_size, config.dcp_size, config.interleave,
                                                 "the NPU lowering (FIA's block table)")
    if block_size % 16 or not 0 < block_size <= FIA_MAX_BLOCK_SIZE:
        raise ValueError(
            f"FIA's block_size must be a multiple of 16 and at most {FIA_MAX_BLOCK_SIZE} (ASCEND.md §1.4); page size "
            f"{config.page_size} over dcp_size {config.dcp_size} with interleave {config.interleave} gives {block_size}"
        )
    return block_size


def padded_heads(heads: int) -> int:
    for count in FIA_HEAD_COUNTS:
        if count >= heads:
            return count
    raise ValueError(
        f"FIA serves at most {FIA_HEAD_COUNTS[-1]} query heads (ASCEND.md §1.4), but attention here has {heads} "
        "(TP-local heads x dcp_size): use a larger TP size or a smaller dcp_size"
    )


class _HostInputs:
    """Graph inputs fed from the runtime's host metadata, created once per graph on first use."""

    def __init__(self, graph: fx.Graph, rows: int, tokens: int, blocks: int, device: torch.device):
        self.graph, self.rows, self.tokens, self.blocks, self.device = graph, rows, tokens, blocks, device
        self._made: dict[str, object] = {}

    def _placeholder(self, name: str, kind: str, index: int | None, example):
        last = [n for n in self.graph.nodes if n.op == "placeholder"][-1]
        with self.graph.inserting_after(last):
            node = self.graph.placeholder(name)
        node.meta["val"] = example
        node.meta["dcp_host_input"] = (kind, index)
        return node

    def _ints(self, kind: str, examples: list[int]) -> list[fx.Node]:
        if kind not in self._made:
            self._made[kind] = [self._placeholder(f"dcp_{kind}_{b}", kind, b, self._symbolic(f"dcp_{kind}_{b}", examples[b]))
                                for b in range(self.rows)]
        return self._made[kind]

    def _symbolic(self, name: str, example: int):
        """A SymInt (hint: example) where the graph has a shape environment: an inner compiler
        that captures NPU graphs (torchair) then sees a symbolic input it refreshes before each
        replay, not a constant it bakes in (ASCEND.md §3.2)."""
        shape_env = getattr(fake_mode_of(self.graph), "shape_env", None)
        if shape_env is None:
            return example
        return shape_env.create_unspecified_symint_and_symbol(example, ConstantSource(name), DimDynamic.DYNAMIC)

    def block_table(self) -> fx.Node:
        if "block_table" not in self._made:
            with fake_mode_of(self.graph):
                example = torch.empty(self.rows, self.blocks, dtype=torch.int32, device=self.device)
            self._made["block_table"] = self._placeholder("dcp_block_table", "block_table", None, example)
        return self._made["block_table"]

    def local_lens(self) -> list[fx.Node]:
        return self._ints("local_len", [1] * self.rows)

    def prefix_lens(self) -> list[fx.Node]:
        return self._ints("local_prefix_len", [0] * self.rows)

    def cumulative_query_lens(self) -> list[fx.Node]:
        # Example values: the tokens spread evenly over the rows (FIA's fake checks them).
        return self._ints("cumulative_query_len", [(b + 1) * self.tokens // self.rows for b in range(self.rows)])


class LowerNPUAttention(GraphPass):
    name = "lower_npu_attention"

    def applies(self, config: PassConfig) -> bool:
        return config.kernels == "npu" and config.attention_strategy == "gather-q"

    def run(self, gm: fx.GraphModule, config: PassConfig) -> int:
        ensure_ops()
        graph = gm.graph
        attention = sites.find_pool_attention(graph, config.dcp_size)
        merges = [n for n in graph.nodes if n.op == "call_function" and n.target is torch.ops.dcp.merge_partials.default]
        if not attention and not merges:
            return 0
        block_size = fia_block_size(config)
        host: _HostInputs | None = None
        checked_table: fx.Node | None = None
        views: dict[fx.Node, tuple[fx.Node, fx.Node]] = {}
        for site in attention:
            tokens, heads, rank_dim = fake_value(site.q_latent).shape
            rows, width = fake_value(site.req_to_token).shape
            decode = tokens == rows
            if not decode and tokens > MAX_FIA_QUERY_TOKENS * rows:
                raise ValueError(
                    f"FIA serves at most {MAX_FIA_QUERY_TOKENS} query tokens per request (ASCEND.md §1.4); this graph has "
                    f"{tokens} tokens over {rows} rows: longer chunks go through the gather-kv strategy"
                )
            if host is None:
                host = _HostInputs(graph, rows, tokens, block_table_width(width, config.page_size), fake_value(site.cache).device)
            with graph.inserting_before(site.node):
                if checked_table is None:
                    checked_table = self._block_table(graph, host, site, config, block_size, decode)
                if site.cache not in views:
                    views[site.cache] = self._paged_views(graph, site, block_size)
                out, lse = self._attention(graph, site, host, checked_table, views[site.cache], block_size, decode)
            replace_attention(graph, site.node, site.returns_lse, out, lse, self.name)
        for node in merges:
            self._lower_merge(graph, node)
        gm.meta["dcp_fia_host_args"] = [
            {name: value[0].meta["dcp_host_input"][0] for name, value in node.kwargs.items()
             if isinstance(value, (list, tuple)) and value and isinstance(value[0], fx.Node)}
            for node in graph.nodes if node.op == "call_function" and node.target is fia_op()
        ]
        return len(attention) + len(merges)

    @staticmethod
    def _block_table(graph, host: _HostInputs, site: sites.PoolAttention, config: PassConfig, block_size: int, decode: bool) -> fx.Node:
        table = host.block_table()
        if not config.debug_checks:
            return table
        lens = host.local_lens() if decode else None
        prefix = None if decode else host.prefix_lens()
        cumulative = None if decode else host.cumulative_query_lens()
        return call(graph, CHECK_HOST_METADATA, table, site.req_to_token, site.seq_lens, site.q_seq_ids, site.q_positions,
                    config.dcp_rank, config.dcp_size, config.interleave, block_size, lens, prefix, cumulative)

    @staticmethod
    def _paged_views(graph, site: sites.PoolAttention, block_size: int) -> tuple[fx.Node, fx.Node]:
        rows, row_dim = fake_value(site.cache).shape
        rank_dim = fake_value(site.q_latent).shape[-1]
        if rows % block_size:
            raise ValueError(f"the KV shard's {rows} rows are not whole blocks of {block_size}")
        blocks = rows // block_size
        latent = call(graph, aten.slice.Tensor, site.cache, 1, 0, rank_dim)
        rope = call(graph, aten.slice.Tensor, site.cache, 1, rank_dim, row_dim)
        return (call(graph, aten.view.default, latent, [blocks, block_size, rank_dim]),
                call(graph, aten.view.default, rope, [blocks, block_size, row_dim - rank_dim]))

    @staticmethod
    def _attention(graph, site: sites.PoolAttention, host: _HostInputs, block_table, views, block_size: int, decode: bool):
        tokens, heads, rank_dim = fake_value(site.q_latent).shape
        rope_dim = fake_value(site.q_rope).shape[-1]
        rows, width = fake_value(site.req_to_token).shape
        all_heads = padded_heads(heads)
        q_latent, q_rope = site.q_latent, site.q_rope
        if fake_value(q_rope).dtype != fake_value(q_latent).dtype:  # FIA takes one dtype (ASCEND.md §1.9)
            q_rope = call(graph, aten._to_copy.default, q_rope, dtype=fake_value(q_latent).dtype)
        if all_heads != heads:
            q_latent = call(graph, aten.constant_pad_nd.default, q_latent, [0, 0, 0, all_heads - heads])
            q_rope = call(graph, aten.constant_pad_nd.default, q_rope, [0, 0, 0, all_heads - heads])
        # FIA takes no non-contiguous query; the gathered q's latent and rope are slices of one row.
        q_latent, q_rope = (x if fake_value(x).is_contiguous() else
                            call(graph, aten.clone.default, x, memory_format=torch.contiguous_format)
                            for x in (q_latent, q_rope))
        key, key_rope = views
        common = dict(num_heads=all_heads, scale=site.sm_scale, num_key_value_heads=1, block_table=block_table,
                      block_size=block_size, sparse_mode=0, softmax_lse_flag=True)
        if decode:
            query = call(graph, aten.view.default, q_latent, [rows, 1, all_heads, rank_dim])
            query_rope = call(graph, aten.view.default, q_rope, [rows, 1, all_heads, rope_dim])
            fia = call(graph, fia_op(), query, key, key, query_rope=query_rope, key_rope=key_rope, input_layout="BSND",
                       actual_seq_lengths_kv=host.local_lens(), **common)
        else:
            fia = call(graph, fia_op(), q_latent, key, key, query_rope=q_rope, key_rope=key_rope, input_layout="TND",
                       actual_seq_lengths=host.cumulative_query_lens(), actual_seq_lengths_kv=host.prefix_lens(), **common)
        out = call(graph, aten.view.default, call(graph, operator.getitem, fia, 0), [tokens, all_heads, rank_dim])
        lse = call(graph, aten.view.default, call(graph, operator.getitem, fia, 1), [tokens, all_heads])
        lse = call(graph, aten.masked_fill.Scalar, lse, call(graph, aten.eq.Scalar, lse, float("inf")), float("-inf"))
        if not decode:
            key_positions = site.key_positions
            if key_positions is None:  # dcp_size 1: the page table is global, positions are columns
                columns = call(graph, aten.arange.default, width, dtype=fake_value(site.req_to_token).dtype,
                               device=fake_value(site.req_to_token).device)
                key_positions = call(graph, aten.expand.default, columns, [rows, width])
            completed = call(graph, WINDOW_ATTENTION, out, lse, q_latent, q_rope, site.cache, site.page_table,
                             site.local_lens, key_positions, site.q_seq_ids, site.q_positions, site.sm_scale,
                             min(MAX_FIA_QUERY_TOKENS, width))
            out, lse = (call(graph, operator.getitem, completed, i) for i in range(2))
        if all_heads != heads:
            out = call(graph, aten.slice.Tensor, out, 1, 0, heads)
            lse = call(graph, aten.slice.Tensor, lse, 1, 0, heads)
        return out, lse

    @staticmethod
    def _lower_merge(graph, node: fx.Node) -> None:
        exchanged, rank_dim = node.args
        shards, tokens, heads, _ = fake_value(exchanged).shape
        if shards > MAX_UPDATE_SHARDS:
            raise ValueError(f"npu_attention_update merges at most {MAX_UPDATE_SHARDS} shards (ASCEND.md §2), dcp_size is {shards}")
        if rank_dim % 8 or not 8 <= rank_dim <= 512:
            raise ValueError(f"npu_attention_update needs a head dim that is a multiple of 8 in [8, 512] (ASCEND.md §2), got {rank_dim}")
        with graph.inserting_before(node):
            split = call(graph, SPLIT_PARTIALS, exchanged, rank_dim)
            outs, lses = (call(graph, operator.getitem, split, i) for i in range(2))
            out_list = [call(graph, aten.select.int, outs, 0, i) for i in range(shards)]
            lse_list = [call(graph, aten.select.int, lses, 0, i) for i in range(shards)]
            update = call(graph, attention_update_op(), lse_list, out_list, 0)
            merged = call(graph, aten.view.default, call(graph, operator.getitem, update, 0), [tokens, heads, rank_dim])
        node.replace_all_uses_with(merged)
        graph.erase_node(node)
