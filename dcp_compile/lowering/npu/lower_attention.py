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
    and     dcp.merge_partials(buf, R) -> npu.npu_attention_update(lses, outs, 0) over dcp_npu.split_partials(buf, R)

Options (lowering/npu/options.NPUOptions: npu_kv_format, fia_version, npu_verify; docs/ascend.md §15):
- kv_format 'nz': key and key_rope are the NZ parts [blocks, 1, D/16, 128, 16] (dcp_npu.nz_kv_blocks,
  which the split layout's pass points at the pool's NZ tensors) instead of [blocks, block, D];
- fia_version 2: npu_fused_infer_attention_score_v2 under v2's argument names, layouts BSND_NBSD
  (decode, masked verify; out [Hp, B, S, R]) and TND_NTD (split verify; out [Hp, T, R]), the
  output permuted back to [T, Hp, R] as a view;
- verify 'mask': verify rows of S = T / B queries take one FIA call over every local key, in
  BSND (v1) or BSND_NBSD (v2), with actual_seq_lengths the rows' query counts and a rank-local
  causal mask [B, 1, S, blocks x block] from dcp_npu.rank_causal_mask, as vllm-ascend and SGLang
  verify under DCP; no window kernel. A graph whose tokens do not split evenly over its rows keeps
  the split, and a step whose rows' query counts differ runs its graph lowered with the split
  (NPULowering.step_options: the backend lowers a graph per the step's host metadata).

The lengths and the block table are host-fed graph inputs (lowering/paged.HostPlaceholders) that
the graph's FIAFeed fills each step. Why this scheme (layouts, the split for verify, heads padded
to a power of two, empty shards masked by their lengths): docs/paged-lowerings.md; the FIA facts it
rests on: docs/ascend.md.

Assumes: gather_q_attention ran (dcp_size > 1) or the graph is the canonical one (dcp_size 1);
pages map onto whole local blocks; the queries of a row are the last query_lens[b] positions of
its sequence, grouped by row (RequestTable's batches), which debug mode checks.
Guarantees: every attention over the pool runs FIA; out and lse keep mla_partial_attention's
contract (out in q's dtype, fp32 lse, -inf where a row sees no key: masked by the batch's device
lengths, not read from FIA's output on an empty shard); a padded row (all shards empty) merges
to 0, never NaN.
Why a pass: the kernel and its layout depend on the deployment (Ascend), not on the model.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from dcp_compile.lowering import paged
from dcp_compile.lowering.npu import ensure_ops
from dcp_compile.lowering.npu import native, native_ops
from dcp_compile.lowering.npu import ops as npu_ops
from dcp_compile.lowering.npu.options import FIA_VERSIONS, NPUOptions
from dcp_compile.ops import targets
from dcp_compile.passes import sites
from dcp_compile.passes.base import PassConfig
from dcp_compile.passes.graph_utils import call, fake_value
from dcp_compile.runtime import layout

aten = torch.ops.aten
FIA_HEAD_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128)  # docs/ascend.md §4.2
FIA_BLOCK_SIZES = {  # docs/ascend.md §4.5: CANN's tiling checks for ND MLA paged KV, by date
    "cann-2025": (16, 128),
    "cann-2026": tuple(range(16, 1025, 16)),
}
DEFAULT_BLOCK_SIZE = 128  # both engines' (docs/ascend.md §4.5)
MAX_UPDATE_SHARDS = 16  # npu_attention_update: at most 16 inputs (docs/ascend.md §8.3)
MAX_TND_REQUESTS = 4096  # FIA's TND lengths: at most 4096 requests (docs/ascend.md §5.3)


# FIA v1 argument -> its v2 name (docs/ascend.md §1.3).
V2_NAMES = {"actual_seq_lengths": "actual_seq_qlen", "actual_seq_lengths_kv": "actual_seq_kvlen",
            "num_heads": "num_query_heads", "scale": "softmax_scale", "softmax_lse_flag": "return_softmax_lse"}


def fia_op(version: int = 1):
    if version == 2:
        return torch.ops.npu.npu_fused_infer_attention_score_v2.default
    return torch.ops.npu.npu_fused_infer_attention_score.default


def fia_ops() -> tuple:
    """Both FIA versions' overloads (the feed finds the calls of either)."""
    return tuple(fia_op(version) for version in FIA_VERSIONS)


def has_fia_v2() -> bool:
    """Whether the npu ops (torch_npu's, or the stand-ins) include FIA v2."""
    ensure_ops()
    return hasattr(torch.ops.npu, "npu_fused_infer_attention_score_v2")


def has_scatter_pa_kv_cache() -> bool:
    """Whether the npu ops include npu_scatter_pa_kv_cache (the native KV write)."""
    ensure_ops()
    return hasattr(torch.ops.npu, "npu_scatter_pa_kv_cache")


def attention_update_op():
    return torch.ops.npu.npu_attention_update.default


def fia_block_size(page_size: int, dcp_size: int, interleave: int, rule: str = "cann-2025") -> int:
    """The FIA block size of pages of `page_size`; an error unless `rule` (NPUOptions.fia_block_sizes) allows it."""
    block_size = layout.require_local_block_size(page_size, dcp_size, interleave, "the NPU lowering (FIA's block table)")
    if block_size not in FIA_BLOCK_SIZES[rule]:
        allowed = "16 or 128" if rule == "cann-2025" else "a multiple of 16 up to 1024"
        message = (f"FIA's block size must be {allowed} (docs/ascend.md §4.5); page size {page_size} over dcp_size "
                   f"{dcp_size} with interleave {interleave} gives {block_size}")
        if rule == "cann-2025" and block_size in FIA_BLOCK_SIZES["cann-2026"]:
            message += ("; a CANN built from ops-transformer of 2026 or later takes any multiple of 16 up to 1024: "
                        "apply(..., fia_block_sizes='cann-2026') on such a CANN only")
        raise ValueError(message)
    return block_size


def padded_heads(heads: int) -> int:
    for count in FIA_HEAD_COUNTS:
        if count >= heads:
            return count
    raise ValueError(
        f"FIA serves at most {FIA_HEAD_COUNTS[-1]} query heads (docs/ascend.md §4.2), but attention here has {heads} "
        "(TP-local heads x dcp_size): use a larger TP size or a smaller dcp_size"
    )


def max_pieces(tokens: int, rows: int) -> int:
    """The most pieces of at most WINDOW_QUERIES queries (pieces.py) that `tokens`
    query tokens over `rows` rows (each with one at least) cut into."""
    return min(tokens, (tokens + (targets.WINDOW_QUERIES - 1) * rows) // targets.WINDOW_QUERIES)


def masked_rows(tokens: int, rows: int) -> int | None:
    """Queries per row of a verify graph the masked scheme serves (T = B x S, 1 < S <= 16), else None."""
    if rows == 0 or tokens == rows or tokens % rows or tokens // rows > targets.WINDOW_QUERIES:
        return None
    return tokens // rows


class LowerNPUAttention(paged.PagedAttentionPass):
    name = "lower_npu_attention"
    reader = "FIA (docs/ascend.md §4.3)"

    def __init__(self, options: NPUOptions = NPUOptions()):
        self.options = options

    @property
    def any_chunk(self) -> bool:
        """Native: the split runs FIA over pieces of at most 16 queries of a row, so a chunk of any
        length takes it (the Triton option sends chunks over 16 queries to gather-kv)."""
        return self.options.npu_kernels == "native"

    def run(self, gm: fx.GraphModule, config: PassConfig) -> int:
        self.config = config
        return super().run(gm, config)

    def _pieces(self, site) -> dict:
        tokens, rows = fake_value(site.q_latent).shape[0], fake_value(site.req_to_token).shape[0]
        count = max_pieces(tokens, rows)
        if count > MAX_TND_REQUESTS:
            raise ValueError(f"a step of {tokens} query tokens over {rows} rows cuts into up to {count} pieces of "
                             f"{targets.WINDOW_QUERIES} queries, and FIA's TND layout takes at most {MAX_TND_REQUESTS} "
                             "(docs/ascend.md §5.3): prefill in chunks of fewer tokens a step")
        return self.host.pieces(count)

    def prepare(self, gm: fx.GraphModule) -> None:
        ensure_ops()
        self._views: dict[fx.Node, tuple[fx.Node, fx.Node]] = {}
        self._masks: dict[int, tuple[fx.Node, fx.Node]] = {}
        self._native = self.options.npu_kernels == "native"

    def window(self, graph, site, out, lse, q_latent, q_rope, window):
        if not self._native:
            return super().window(graph, site, out, lse, q_latent, q_rope, window)
        tokens = native.step_tokens(graph, site.cache, self.config)
        completed = call(graph, native_ops.STEP_WINDOW, out, lse, q_latent, q_rope, tokens.latent, tokens.rope,
                         tokens.slots, tokens.num_rows, self._pieces(site)["token_piece"], site.q_positions,
                         site.sm_scale, window)
        return call(graph, operator.getitem, completed, 0), call(graph, operator.getitem, completed, 1)

    def split(self, config: PassConfig, site: sites.PoolAttention) -> bool:
        return self.options.npu_verify != "mask" or self._unmaskable(site)

    def block_size(self, config: PassConfig) -> int:
        # apply() checked the deployment's rule (NPUOptions.fia_block_sizes); here only FIA's outer bound.
        return fia_block_size(config.page_size, config.dcp_size, config.interleave, "cann-2026")

    def kernel(self, graph, site, q_latent, q_rope, decode, host, block_table, block_size):
        if site.cache not in self._views:
            self._views[site.cache] = (self._nz_views(graph, site, block_size) if self.options.npu_kv_format == "nz"
                                       else self._paged_views(graph, site, block_size))
        mask = None
        if not decode and self.options.npu_verify == "mask" and not self._unmaskable(site):
            mask = self._mask(graph, site, host, block_size)
        counts = None if mask is not None else self._key_counts(graph, site, host, decode)
        pieces = self._pieces(site) if self._native and not decode and mask is None else None
        return self._fia(graph, site, q_latent, q_rope, host, block_table, self._views[site.cache], block_size, decode,
                         self.options.fia_version, mask, counts, pieces)

    def _key_counts(self, graph, site, host: paged.HostPlaceholders, decode: bool) -> fx.Node:
        """Per query token, the keys its FIA call attends over (every local key of its row in decode,
        else those before the row's first query), to mask the rows FIA saw empty whatever FIA
        returned for them, as SGLang masks them (CANN >= 8.5 was read to give lse +inf there,
        docs/ascend.md §7.2). Native: from the host-fed prefix lengths and this step's own tokens."""
        if not self._native:
            positions = None if decode else paged.site_key_positions(graph, site)
            return call(graph, npu_ops.PREFIX_KEY_COUNTS, site.local_lens, positions, site.q_seq_ids, site.q_positions,
                        decode)
        if not decode:  # its piece's keys before the piece
            pieces = self._pieces(site)
            return call(graph, aten.index_select.default, pieces["prefix_tensor"], 0, pieces["token_piece"])
        prefix = host.prefix_lens_tensor()
        tokens = native.step_tokens(graph, site.cache, self.config)
        return call(graph, native_ops.STEP_KEY_COUNTS, prefix, tokens.slots, tokens.num_rows, site.q_seq_ids,
                    site.q_positions, 1)

    @staticmethod
    def _unmaskable(site) -> bool:
        """Whether the masked verify cannot serve this site's rows (unequal, or more than 16 queries)."""
        return masked_rows(fake_value(site.q_latent).shape[0], fake_value(site.req_to_token).shape[0]) is None

    def _mask(self, graph, site, host: paged.HostPlaceholders, block_size: int) -> tuple[fx.Node, fx.Node]:
        """The rank-local causal mask of the graph's rows and each query's visible key count; one
        per graph (every layer's site reads the same positions)."""
        width = host.blocks * block_size  # FIA checks the mask's width against the paged capacity
        if width not in self._masks:
            if self._native:
                tokens = native.step_tokens(graph, site.cache, self.config)
                counts = call(graph, native_ops.STEP_KEY_COUNTS, host.prefix_lens_tensor(), tokens.slots,
                              tokens.num_rows, site.q_seq_ids, site.q_positions, targets.WINDOW_QUERIES)
                rows = fake_value(site.req_to_token).shape[0]
                self._masks[width] = (call(graph, native_ops.STEP_CAUSAL_MASK, counts, rows, width), counts)
            else:
                positions = paged.site_key_positions(graph, site)
                made = call(graph, npu_ops.RANK_CAUSAL_MASK, positions, site.local_lens, site.q_positions, width)
                self._masks[width] = (call(graph, operator.getitem, made, 0), call(graph, operator.getitem, made, 1))
        return self._masks[width]

    def finish(self, gm: fx.GraphModule, config: PassConfig) -> int:
        merges = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is targets.MERGE_PARTIALS]
        for node in merges:
            self._lower_merge(gm.graph, node)
        return len(merges)

    @staticmethod
    def _paged_views(graph, site: sites.PoolAttention, block_size: int) -> tuple[fx.Node, fx.Node]:
        """FIA's [blocks, block, D] views of the locations' rows of the cache's two parts: the
        split layout's parts may hold a reserved block past them (kv_layout.py), which FIA is not
        handed (a leading slice of a contiguous part: no copy)."""
        rows, row_dim = fake_value(site.cache).shape
        rank_dim = fake_value(site.q_latent).shape[-1]
        if rows % block_size:
            raise ValueError(f"the KV shard's {rows} rows are not whole blocks of {block_size}")
        blocks = rows // block_size
        latent = call(graph, aten.slice.Tensor, site.cache, 1, 0, rank_dim)
        rope = call(graph, aten.slice.Tensor, site.cache, 1, rank_dim, row_dim)
        return tuple(call(graph, aten.view.default, call(graph, aten.slice.Tensor, part, 0, 0, rows),
                          [blocks, block_size, width])
                     for part, width in ((latent, rank_dim), (rope, row_dim - rank_dim)))

    @staticmethod
    def _nz_views(graph, site: sites.PoolAttention, block_size: int) -> tuple[fx.Node, fx.Node]:
        """The NZ parts' blocks of the locations' rows, without a reserved block past them."""
        rank_dim = fake_value(site.q_latent).shape[-1]
        parts = call(graph, npu_ops.NZ_KV_BLOCKS, site.cache, rank_dim, block_size)
        blocks = fake_value(site.cache).shape[0] // block_size
        return tuple(call(graph, aten.slice.Tensor, call(graph, operator.getitem, parts, i), 0, 0, blocks)
                     for i in range(2))

    @staticmethod
    def _fia(graph, site, q_latent, q_rope, host: paged.HostPlaceholders, block_table, views, block_size: int,
             decode: bool, version: int = 1, mask: tuple[fx.Node, fx.Node] | None = None, counts: fx.Node | None = None,
             pieces: dict | None = None):
        tokens, heads, rank_dim = fake_value(q_latent).shape
        rope_dim = fake_value(q_rope).shape[-1]
        rows = fake_value(site.req_to_token).shape[0]
        all_heads = padded_heads(heads)
        if all_heads != heads:
            q_latent = call(graph, aten.constant_pad_nd.default, q_latent, [0, 0, 0, all_heads - heads])
            q_rope = call(graph, aten.constant_pad_nd.default, q_rope, [0, 0, 0, all_heads - heads])
        # The framework would copy a non-contiguous query anyway (docs/ascend.md §11.1); the
        # gathered q's latent and rope are slices of one row.
        q_latent, q_rope = (x if fake_value(x).is_contiguous() else
                            call(graph, aten.clone.default, x, memory_format=torch.contiguous_format)
                            for x in (q_latent, q_rope))
        key, key_rope = views
        common = dict(num_heads=all_heads, scale=site.sm_scale, num_key_value_heads=1, block_table=block_table,
                      block_size=block_size, sparse_mode=0, softmax_lse_flag=True)
        per_row = 1 if decode else (None if mask is None else tokens // rows)
        if per_row is not None:  # BSND: decode (S = 1) and masked verify (S = T / B)
            query = call(graph, aten.view.default, q_latent, [rows, per_row, all_heads, rank_dim])
            query_rope = call(graph, aten.view.default, q_rope, [rows, per_row, all_heads, rope_dim])
            lengths = dict(actual_seq_lengths_kv=host.local_lens())
            if mask is not None:
                lengths.update(actual_seq_lengths=host.query_lens(), atten_mask=mask[0])
            layout = "BSND"
        elif pieces is not None:  # TND over pieces of <= 16 queries of a row, each over its keys before it
            query, query_rope, layout = q_latent, q_rope, "TND"
            lengths = dict(actual_seq_lengths=pieces["cumulative"], actual_seq_lengths_kv=pieces["prefix"])
            common["block_table"] = call(graph, aten.index_select.default, block_table, 0, pieces["rows"])
        else:  # TND: split verify, over the keys before each row's first query
            query, query_rope, layout = q_latent, q_rope, "TND"
            lengths = dict(actual_seq_lengths=host.cumulative_query_lens(), actual_seq_lengths_kv=host.prefix_lens())
        arguments = {**common, **lengths}
        if version == 2:  # the same call under v2's names; outputs head-major (docs/ascend.md §15.2)
            arguments = {V2_NAMES.get(name, name): value for name, value in arguments.items()}
            layout += "_NBSD" if layout == "BSND" else "_NTD"
        fia = call(graph, fia_op(version), query, key, key, query_rope=query_rope, key_rope=key_rope,
                   input_layout=layout, **arguments)
        out = call(graph, operator.getitem, fia, 0)
        if version == 2:  # [Hp, B, S, R] or [Hp, T, R] -> a [T, Hp, R] view
            out = call(graph, aten.permute.default, call(graph, aten.view.default, out, [all_heads, tokens, rank_dim]),
                       [1, 0, 2])
        else:
            out = call(graph, aten.view.default, out, [tokens, all_heads, rank_dim])
        lse = call(graph, operator.getitem, fia, 1)
        if per_row is not None and per_row > 1:  # [B, Hp, S, 1] -> [T, Hp]
            lse = call(graph, aten.reshape.default, call(graph, aten.permute.default, lse, [0, 2, 1, 3]),
                       [tokens, all_heads])
        else:
            lse = call(graph, aten.view.default, lse, [tokens, all_heads])
        if mask is not None:  # the tokens whose mask admits no key
            out, lse = LowerNPUAttention._zero_unseen(graph, mask[1], out, lse)
        else:
            out, lse = LowerNPUAttention._zero_unseen(graph, counts, out, lse)
        if all_heads != heads:
            out = call(graph, aten.slice.Tensor, out, 1, 0, heads)
            lse = call(graph, aten.slice.Tensor, lse, 1, 0, heads)
        return out, lse

    @staticmethod
    def _zero_unseen(graph, counts, out, lse):
        """Out 0 and lse -inf for the tokens whose key count is 0; NaN for an lse of +inf on a
        token that saw keys. npu_attention_update gives a +inf lse no weight (an empty shard, as
        CANN >= 8.5 reports one, docs/ascend.md §7.3): from a shard with keys that would drop its
        keys without a sign, where NaN shows in the merged output."""
        lse = call(graph, aten.masked_fill.Scalar, lse, call(graph, aten.eq.Scalar, lse, float("inf")), float("nan"))
        empty = call(graph, aten.unsqueeze.default, call(graph, aten.eq.Scalar, counts, 0), 1)
        lse = call(graph, aten.masked_fill.Scalar, lse, empty, float("-inf"))
        out = call(graph, aten.masked_fill.Scalar, out, call(graph, aten.unsqueeze.default, empty, 2), 0.0)
        return out, lse

    @staticmethod
    def _equal_all_to_all(graph, exchanged: fx.Node) -> fx.Node:
        """wait(all_to_all_single(x, [1]*n, [1]*n, group)) as dcp_npu.all_to_all(x, group): HCCL's
        AlltoAll, not AlltoAllV (npu_ops.all_to_all)."""
        c10d = torch.ops._c10d_functional
        if exchanged.target is not c10d.wait_tensor.default:
            return exchanged
        sent = exchanged.args[0]
        if sent.target is not c10d.all_to_all_single.default or len(sent.users) != 1:
            return exchanged
        packed, output_splits, input_splits, group = sent.args
        shards = fake_value(packed).shape[0]
        if list(output_splits) != [1] * shards or list(input_splits) != [1] * shards:
            return exchanged
        with graph.inserting_before(exchanged):
            equal = call(graph, npu_ops.ALL_TO_ALL, packed, group)
        exchanged.replace_all_uses_with(equal)
        graph.erase_node(exchanged)
        graph.erase_node(sent)
        return equal

    @staticmethod
    def _lower_merge(graph, node: fx.Node) -> None:
        exchanged, rank_dim = node.args
        exchanged = LowerNPUAttention._equal_all_to_all(graph, exchanged)
        shards, tokens, heads, _ = fake_value(exchanged).shape
        if shards > MAX_UPDATE_SHARDS:
            raise ValueError(f"npu_attention_update merges at most {MAX_UPDATE_SHARDS} shards (docs/ascend.md §8.3), "
                             f"dcp_size is {shards}")
        if rank_dim % 8 or not 8 <= rank_dim <= 512:
            raise ValueError(f"npu_attention_update needs a head dim that is a multiple of 8 in [8, 512] "
                             f"(docs/ascend.md §8.3), got {rank_dim}")
        with graph.inserting_before(node):
            split = call(graph, npu_ops.SPLIT_PARTIALS, exchanged, rank_dim)
            outs, lses = (call(graph, operator.getitem, split, i) for i in range(2))
            out_list = [call(graph, aten.select.int, outs, 0, i) for i in range(shards)]
            lse_list = [call(graph, aten.select.int, lses, 0, i) for i in range(shards)]
            update = call(graph, attention_update_op(), lse_list, out_list, 0)
            merged = call(graph, aten.view.default, call(graph, operator.getitem, update, 0), [tokens, heads, rank_dim])
        node.replace_all_uses_with(merged)
        graph.erase_node(node)
