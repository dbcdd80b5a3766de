"""torch.library.opcheck for every dcp:: op: schema, fake impl and dispatch agree."""

from __future__ import annotations

import pytest
import torch

from tests.ops.reference_inputs import random_batch, shard_inputs


def _cases():
    inputs = random_batch([6, 1, 0, 9], [1, 1, 1, 3], seed=11)
    shard = shard_inputs(inputs, 2, 1, 0)
    page, lens, pos = torch.ops.dcp.local_metadata(inputs["req_to_token"], inputs["seq_lens"], 0, 2, 1)
    out, lse = torch.ops.dcp.mla_partial_attention(inputs["q_latent"], inputs["q_rope"], shard, page, lens, pos,
                                                   inputs["q_seq_ids"], inputs["q_positions"], 0.2)
    tokens = inputs["q_latent"].shape[0]
    loc = inputs["req_to_token"][inputs["q_seq_ids"], inputs["q_positions"]]
    latent, rope = torch.randn(tokens, 16), torch.randn(tokens, 8)
    yield "mla_kv_write", (inputs["kv_cache"].clone(), latent, rope, loc)
    yield "mla_attention", (inputs["q_latent"], inputs["q_rope"], inputs["kv_cache"], inputs["req_to_token"],
                            inputs["seq_lens"], inputs["q_seq_ids"], inputs["q_positions"], 0.2)
    yield "sharded_kv_write", (shard.clone(), latent, rope, loc, 0, 2, 1, None)
    yield "local_metadata", (inputs["req_to_token"], inputs["seq_lens"], 1, 2, 1)
    yield "mla_partial_attention", (inputs["q_latent"], inputs["q_rope"], shard, page, lens, pos,
                                    inputs["q_seq_ids"], inputs["q_positions"], 0.2)
    yield "pack_partials", (out, lse, 2)
    yield "merge_partials", (torch.ops.dcp.pack_partials(out, lse, 2), 16)
    yield "check_locations", (loc, 64, 1, 1)


@pytest.mark.parametrize("name,args", list(_cases()), ids=[c[0] for c in _cases()])
def test_opcheck(name, args):
    torch.library.opcheck(getattr(torch.ops.dcp, name).default, args)
