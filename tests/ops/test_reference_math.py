"""The reference kernels against a naive dense softmax, and the DCP identity
merge(partial attention over each shard) == attention over the whole cache."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_compile.ops import reference
from tests.ops.reference_inputs import gather_q_attention, naive_attention, random_batch, shard_inputs

SCALE = 0.3


def _attention(inputs):
    return torch.ops.dcp.mla_attention(
        inputs["q_latent"], inputs["q_rope"], inputs["kv_cache"], inputs["req_to_token"], inputs["seq_lens"],
        inputs["q_seq_ids"], inputs["q_positions"], SCALE,
    )


@pytest.mark.parametrize("queries", [1, 3])
def test_mla_attention_matches_naive_softmax(queries):
    lengths = [5, 1, 0, 12, 3]
    inputs = random_batch(lengths, [min(queries, max(n, 1)) for n in lengths], seed=queries)
    expected, _ = naive_attention(inputs, SCALE)
    torch.testing.assert_close(_attention(inputs).double(), expected, atol=1e-5, rtol=1e-5)


def test_partial_attention_lse_is_natural_log():
    """A base-2 LSE stays finite and would silently degrade the merge: pin the base."""
    inputs = random_batch([7, 4], [1, 2], seed=3)
    _, expected_lse = naive_attention(inputs, SCALE)
    positions = reference.global_positions(inputs["req_to_token"])
    _, lse = reference.partial_attention(
        inputs["q_latent"], inputs["q_rope"], inputs["kv_cache"], inputs["req_to_token"], inputs["seq_lens"],
        positions, inputs["q_seq_ids"], inputs["q_positions"], SCALE,
    )
    torch.testing.assert_close(lse.double(), expected_lse, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(lse.double(), expected_lse / math.log(2), atol=1e-3)


def test_merge_with_base2_lse_is_caught():
    """Merging shards whose LSE was (wrongly) in base 2 gives a measurably different answer."""
    inputs = random_batch([9, 6], [1, 1], seed=4)
    out, lse = gather_q_attention(inputs, 2, 1, SCALE)
    outs, lses = [], []
    for rank in range(2):
        shard = shard_inputs(inputs, 2, 1, rank)
        page, lens, pos = reference.local_metadata(inputs["req_to_token"], inputs["seq_lens"], rank, 2, 1)
        o, l = reference.partial_attention(inputs["q_latent"], inputs["q_rope"], shard, page, lens, pos,
                                           inputs["q_seq_ids"], inputs["q_positions"], SCALE)
        outs.append(o)
        lses.append(l / math.log(2))
    wrong, _ = reference.merge_lse(torch.stack(outs), torch.stack(lses))
    assert (wrong - out).abs().max() > 1e-4


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 20), min_size=1, max_size=5),
    dcp_size=st.sampled_from([1, 2, 3, 4]),
    interleave=st.sampled_from([1, 2, 4]),
    queries=st.integers(1, 4),
    seed=st.integers(0, 1000),
)
def test_dcp_merge_equals_full_attention(lengths, dcp_size, interleave, queries, seed):
    inputs = random_batch(lengths, [min(queries, max(n, 1)) for n in lengths], seed=seed)
    expected_out, expected_lse = naive_attention(inputs, SCALE)
    out, lse = gather_q_attention(inputs, dcp_size, interleave, SCALE)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), expected_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), expected_lse, atol=1e-5, rtol=1e-5)


def test_empty_shard_gives_zero_out_and_minus_inf_lse():
    inputs = random_batch([1, 0], [1, 1], seed=5)
    # With N = 4, at most one rank owns the single key: the others see an empty shard.
    for rank in range(4):
        shard = shard_inputs(inputs, 4, 1, rank)
        page, lens, pos = reference.local_metadata(inputs["req_to_token"], inputs["seq_lens"], rank, 4, 1)
        out, lse = reference.partial_attention(inputs["q_latent"], inputs["q_rope"], shard, page, lens, pos,
                                               inputs["q_seq_ids"], inputs["q_positions"], SCALE)
        for t in range(out.shape[0]):
            if int(lens[inputs["q_seq_ids"][t]]) == 0:
                assert torch.all(out[t] == 0) and torch.all(torch.isneginf(lse[t]))


def test_merge_does_not_leak_nan_from_empty_shard():
    outs = torch.randn(3, 2, 4, 8)
    lses = torch.randn(3, 2, 4)
    outs[1] = float("nan")
    lses[1] = float("-inf")
    lses[:, 1, 0] = float("-inf")  # a row that is empty everywhere
    merged, lse = reference.merge_lse(outs, lses)
    assert torch.isfinite(merged).all()
    assert torch.all(merged[1, 0] == 0) and torch.isneginf(lse[1, 0])
    expected, _ = reference.merge_lse(outs[[0, 2]], lses[[0, 2]])
    torch.testing.assert_close(merged[0], expected[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_pack_roundtrip_keeps_lse_bits(dtype):
    out = torch.randn(3, 4 * 2, 16).to(dtype)
    lse = torch.randn(3, 8)
    lse[0, 1] = float("-inf")
    packed = torch.ops.dcp.pack_partials(out, lse, 4)
    assert packed.shape == (4, 3, 2, 16 + reference.lse_words(dtype))
    unpacked_out, unpacked_lse = reference.unpack_partials(packed, 16)
    assert torch.equal(unpacked_lse, lse.view(3, 4, 2).transpose(0, 1))
    expected = torch.where(torch.isinf(lse)[..., None], 0, out).view(3, 4, 2, 16).transpose(0, 1)
    assert torch.equal(unpacked_out, expected)


def test_kv_write_skips_padding_and_unowned():
    cache = torch.full((8, 6), -7.0)
    latent, rope = torch.randn(5, 4), torch.randn(5, 2)
    loc = torch.tensor([0, 1, 2, 3, 6])
    reference.kv_write(cache, latent, rope, loc, dcp_rank=1, dcp_size=2)
    # Rank 1 owns odd locations: 1 -> row 0, 3 -> row 1. Location 0, 2 and 6 are not written.
    assert torch.equal(cache[0], torch.cat([latent[1], rope[1]]))
    assert torch.equal(cache[1], torch.cat([latent[3], rope[3]]))
    assert torch.all(cache[2:] == -7.0)


def test_local_metadata_lists_owned_positions_in_order():
    req_to_token = torch.tensor([[5, 2, 8, 3, 0, 0], [1, 4, 0, 0, 0, 0]])
    seq_lens = torch.tensor([4, 0])
    page, lens, pos = reference.local_metadata(req_to_token, seq_lens, dcp_rank=0, dcp_size=2, interleave=1)
    assert lens.tolist() == [2, 0]  # request 1 is a padded row: its entries are never read
    assert pos[0, :2].tolist() == [1, 2]  # locations 2 and 8 at positions 1 and 2
    assert page[0, :2].tolist() == [1, 4]  # local rows 2 // 2 and 8 // 2
