"""A small MLA model of the tests' own, written from the README's model contract and unlike the
reference model: no q-LoRA, queries projected straight into latent space, interleaved rope with
an offset, its own forward signature, and switches for what a user plausibly gets wrong.

Weights come from one seed for the full model and are sliced per TP rank, so every TP/DCP layout
computes the same function.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dcp_compile import ops
from dcp_compile.runtime import MLAKVPool, parallel

HEADS, RANK_DIM, ROPE_DIM, HIDDEN, VOCAB = 8, 16, 8, 32, 64


def interleaved_rope(x: torch.Tensor, positions: torch.Tensor, offset: int = 3) -> torch.Tensor:
    """Rope on (even, odd) pairs at positions + offset, computed in fp32 and returned in fp32."""
    pairs = x.float().unflatten(-1, (-1, 2))
    freq = 10000.0 ** (-torch.arange(pairs.shape[-2], device=x.device, dtype=torch.float32) / pairs.shape[-2])
    angle = (positions.float() + offset)[:, None] * freq[None, :]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (pairs.shape[-2],)
    cos, sin = angle.cos().view(shape), angle.sin().view(shape)
    even, odd = pairs[..., 0], pairs[..., 1]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)


class ContractModel(nn.Module):
    """forward(tokens, positions, seq_ids, out_loc, page_table, lens) -> logits [T, vocab] (fp32).

    rope_in_fp32: keep q_rope (and k_rope) in fp32 while q_latent is in the model dtype.
    misuse: None, 'read' (layer 1 reads its cache with its own attention) or 'write' (layer 1
    writes its cache itself).
    heads: attention heads of the full model (fewer make long prefills cheap to test).
    keep_caches: hold the pool's cache tensors from __init__ (stale after apply reshards).
    """

    def __init__(self, layers=2, capacity=512, dtype=torch.float32, tp_size=1, seed=0, rope_in_fp32=False,
                 misuse=None, keep_caches=False, heads=HEADS):
        super().__init__()
        self.parallel = parallel.build(tp_size)
        self.kv_pool = MLAKVPool(layers, capacity, RANK_DIM, ROPE_DIM, dtype)
        self.layers, self.rope_in_fp32, self.misuse = layers, rope_in_fp32, misuse
        self.caches = [self.kv_pool.cache(i) for i in range(layers)] if keep_caches else None
        gen = torch.Generator().manual_seed(seed)
        tp, rank = self.parallel.tp_size, self.parallel.tp_rank
        full_heads, heads = heads, heads // tp

        def weight(*shape, shard_dim=None):
            full = torch.randn(*shape, generator=gen) / shape[-1] ** 0.5
            if shard_dim is not None:
                full = full.chunk(tp, dim=shard_dim)[rank]
            return nn.Parameter(full.to(dtype).contiguous(), requires_grad=False)

        self.embed = weight(VOCAB, HIDDEN)
        self.q = nn.ParameterList(weight(full_heads * (RANK_DIM + ROPE_DIM), HIDDEN, shard_dim=0) for _ in range(layers))
        self.kv = nn.ParameterList(weight(RANK_DIM + ROPE_DIM, HIDDEN) for _ in range(layers))
        self.o = nn.ParameterList(weight(HIDDEN, full_heads * RANK_DIM, shard_dim=1) for _ in range(layers))
        self.head = weight(VOCAB, HIDDEN)
        self.heads = heads

    def cache(self, layer: int) -> torch.Tensor:
        return self.caches[layer] if self.caches is not None else self.kv_pool.cache(layer)

    def forward(self, tokens, positions, seq_ids, out_loc, page_table, lens):
        h = F.embedding(tokens, self.embed)
        for layer in range(self.layers):
            q = F.linear(h, self.q[layer]).view(h.shape[0], self.heads, RANK_DIM + ROPE_DIM)
            q_latent, q_rope = q.split([RANK_DIM, ROPE_DIM], dim=-1)
            kv = F.linear(h, self.kv[layer])
            latent, k_rope = kv[:, :RANK_DIM], interleaved_rope(kv[:, RANK_DIM:], positions)
            q_rope = interleaved_rope(q_rope, positions)
            if not self.rope_in_fp32:
                q_rope, k_rope = q_rope.to(h.dtype), k_rope.to(h.dtype)
            cache = self.cache(layer)
            if self.misuse == "write" and layer == 1:
                cache[out_loc] = torch.cat([latent, k_rope.to(h.dtype)], dim=-1)
            else:
                ops.mla_kv_write(cache, latent, k_rope, out_loc)
            if self.misuse == "read" and layer == 1:
                rows = cache[page_table[seq_ids]]  # [T, L, R + P]: its own attention, no causal mask
                scores = torch.einsum("thr,tlr->thl", q_latent.float(), rows[..., :RANK_DIM].float())
                o = torch.einsum("thl,tlr->thr", scores.softmax(-1), rows[..., :RANK_DIM].float()).to(h.dtype)
            else:
                o = ops.mla_attention(q_latent.contiguous(), q_rope.contiguous(), cache, page_table, lens, seq_ids,
                                      positions, 0.25)
            out = F.linear(o.reshape(h.shape[0], -1), self.o[layer])
            if self.parallel.tp_group_name is not None:
                out = torch.ops._c10d_functional.wait_tensor(
                    torch.ops._c10d_functional.all_reduce(out, "sum", self.parallel.tp_group_name))
            h = h + 0.5 * out
        return F.linear(h, self.head).float()


def step_args(batch) -> tuple:
    """This model's arguments from a dcp_compile ForwardBatch."""
    return (batch.input_ids, batch.positions, batch.q_seq_ids, batch.out_loc, batch.req_to_token, batch.seq_lens)
