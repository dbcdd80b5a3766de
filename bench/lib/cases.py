"""What the benches time: one attention layer, page tables, decode and verify batches over them,
host metadata in closed form, and attention cases over one shared pool of random pages.

Shapes are Kimi-K2's latent cache unless a bench says otherwise: R = 512, P = 64, bf16.
"""

from __future__ import annotations

import torch
from torch import nn

from dcp_compile import ops
from dcp_compile.runtime.batch import ForwardBatch
from dcp_compile.runtime.host_metadata import HostMetadata, RankHostMetadata, block_table_width
from dcp_compile.runtime.kv_pool import MLAKVPool

RANK_DIM, ROPE_DIM = 512, 64
ROW_BYTES = (RANK_DIM + ROPE_DIM) * 2
"""One bf16 latent cache row."""
BLOCK = 64
"""Rows of one local block: a rank's share of a page, and FlashInfer's page."""


def fill_random(tensor: torch.Tensor) -> None:
    for chunk in tensor.view(-1).split(1 << 28):
        chunk.normal_()


class AttentionLayer(nn.Module):
    """One MLA decode attention layer written against the canonical ops."""

    def __init__(self, heads: int, rank_dim: int, rope_dim: int, capacity: int, dtype, device, par, page_size: int = 1):
        super().__init__()
        self.kv_pool = MLAKVPool(1, capacity, rank_dim, rope_dim, dtype, device, page_size)
        self.parallel, self.sm_scale = par, (128 + rope_dim) ** -0.5

    def forward(self, q_latent, q_rope, latent, rope, out_loc, req_to_token, seq_lens, q_seq_ids, q_positions):
        cache = self.kv_pool.cache(0)
        ops.mla_kv_write(cache, latent, rope, out_loc)
        return ops.mla_attention(q_latent, q_rope, cache, req_to_token, seq_lens, q_seq_ids, q_positions, self.sm_scale)


def decode_page_table(batch: int, context: int, width: int, device) -> torch.Tensor:
    """Request b holds locations 1 + b*context ... : contiguous, so balanced across ranks."""
    table = torch.zeros(batch, width, dtype=torch.int64, device=device)
    table[:, :context] = 1 + torch.arange(batch, device=device)[:, None] * context + torch.arange(context, device=device)
    return table


def page_size(dcp_size: int) -> int:
    return BLOCK * dcp_size


def request_table(batch: int, context: int, dcp_size: int, device, width: int) -> torch.Tensor:
    """Request b on whole pages: locations page + b*width ... (page-aligned, past location 0);
    one table width for every context, so a context changes no graph shape."""
    page = page_size(dcp_size)
    columns = torch.arange(width, device=device)
    table = page + torch.arange(batch, device=device)[:, None] * width + columns
    return torch.where(columns < context, table, 0).to(torch.int32)


def host_metadata(batch: int, context: int, k: int, dcp_size: int, width: int) -> HostMetadata:
    """RequestTable's host metadata for request_table's layout (interleave 1), in closed form:
    location page + b*width + p lives on rank p % N; its local block is its page's id."""
    page = page_size(dcp_size)
    blocks = block_table_width(width, page)
    first_page = (page + torch.arange(batch)[:, None] * width) // page
    used = torch.arange(blocks)[None, :] < -(-context // page)
    tables = torch.where(used, first_page + torch.arange(blocks)[None, :], 0).to(torch.int32)
    tables = tables.expand(dcp_size, batch, blocks).contiguous()
    local = tuple((sum(1 for _ in range(rank, context, dcp_size)),) * batch for rank in range(dcp_size))
    prefix = tuple((len(range(rank, context - k, dcp_size)),) * batch for rank in range(dcp_size))
    return HostMetadata(dcp_size, 1, page, (k,) * batch, local, prefix, tables)


def verify_inputs(batch: int, context: int, k: int, table: torch.Tensor):
    """(positions, q_seq_ids, out_loc) of k queries a request, the last k of its context."""
    device = table.device
    positions = (context - k + torch.arange(k, device=device)).repeat(batch)
    q_seq_ids = torch.arange(batch, device=device).repeat_interleave(k)
    return positions, q_seq_ids, table[q_seq_ids, positions].clone()


def stack_batch(batch: int, context: int, k: int, dcp_size: int, device, width: int) -> ForwardBatch:
    """A model step over request_table's layout: k queries a request (k = 1: decode), every
    request `context` long including them; logits for every query of a verify step."""
    table = request_table(batch, context, dcp_size, device, width)
    positions, q_seq_ids, out_loc = verify_inputs(batch, context, k, table)
    rows = torch.arange(batch, device=device)
    return ForwardBatch(input_ids=(q_seq_ids * 31 + positions) % 4096, positions=positions, q_seq_ids=q_seq_ids,
                        out_loc=out_loc, req_to_token=table, seq_lens=torch.full((batch,), context, device=device),
                        state_slots=torch.zeros(batch, dtype=torch.int64, device=device),
                        logits_index=torch.arange(batch * k, device=device) if k > 1 else rows)


def shared_kv_allocate(pool: MLAKVPool, rows: int) -> None:
    """One KV buffer for every layer of the pool: a stack of many layers still reads the whole
    context from HBM in each (bench only; patched over MLAKVPool._allocate)."""
    pool.rows_per_rank = rows
    shared = torch.zeros(rows, pool.row_dim, dtype=pool.dtype, device=pool.device)
    for i in range(pool.num_layers):
        pool.register_buffer(f"layer_{i}", shared, persistent=False)


class PagedCase:
    """One attention case over `pool` ([rows, R + P], shared by every case): heads x context x
    batch x k queries a request (the last k positions of its context), each request on random
    pages of BLOCK rows."""

    def __init__(self, pool: torch.Tensor, heads: int, context: int, batch: int, k: int, seed: int):
        self.pool, self.heads, self.context, self.batch, self.k = pool, heads, context, batch, k
        device = pool.device
        gen = torch.Generator(device=device).manual_seed(seed)
        pages = context // BLOCK
        self.block_table = (torch.randperm(pool.shape[0] // BLOCK - 1, generator=gen, device=device)[: batch * pages]
                            .view(batch, pages) + 1)
        cols = torch.arange(context, device=device)
        self.page_table = (self.block_table[:, cols // BLOCK] * BLOCK + cols % BLOCK).to(torch.int32)
        q = torch.randn(batch * k, heads, RANK_DIM + ROPE_DIM, generator=gen, device=device).to(torch.bfloat16)
        self.q_latent, self.q_rope = q[..., :RANK_DIM].contiguous(), q[..., RANK_DIM:].contiguous()
        self.q_seq_ids = torch.arange(batch, device=device).repeat_interleave(k)
        self.q_positions = (context - k + torch.arange(k, device=device)).repeat(batch)
        self.seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        self.positions = torch.arange(context, dtype=torch.int32, device=device).expand(batch, context)

    @property
    def kv_bytes(self) -> int:
        return self.batch * self.context * ROW_BYTES

    @property
    def visible_keys(self) -> float:
        """Keys seen, summed over the queries: causal, so query j of k sees context - k + j + 1."""
        return self.batch * (self.context * self.k - self.k * (self.k - 1) / 2)

    def host(self) -> RankHostMetadata:
        return RankHostMetadata((self.k,) * self.batch, (self.context,) * self.batch,
                                (self.context - self.k,) * self.batch, self.block_table.int().cpu())
