"""Property tests for both ways attention reaches a sharded KV cache, over random lengths
(including empty shards and padded rows), query counts (decode, verify k, extend chunks) and
interleave sizes, against a naive dense softmax."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_compile.ops import reference
from tests.ops.reference_inputs import gather_q_attention, naive_attention, random_batch, shard_inputs

SCALE = 0.25


def gather_kv_attention(inputs, dcp_size, interleave):
    """Every rank compacts its rows for the batch; all-gather (stack); attend over all of them."""
    gathered = []
    for rank in range(dcp_size):
        shard = shard_inputs(inputs, dcp_size, interleave, rank)
        page, lens, _ = reference.local_metadata(inputs["req_to_token"], inputs["seq_lens"], rank, dcp_size, interleave)
        gathered.append(reference.gather_local_rows(shard, page, lens))
    rows = torch.stack(gathered).reshape(-1, inputs["kv_cache"].shape[1])
    page, lens, positions = reference.gathered_kv_metadata(inputs["req_to_token"], inputs["seq_lens"], dcp_size, interleave)
    assert torch.equal(lens, inputs["seq_lens"])  # every key of every request, exactly once
    return reference.partial_attention(inputs["q_latent"], inputs["q_rope"], rows, page, lens, positions,
                                       inputs["q_seq_ids"], inputs["q_positions"], SCALE)


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 24), min_size=1, max_size=4),
    dcp_size=st.sampled_from([1, 2, 4]),
    interleave=st.sampled_from([1, 4, 8]),
    queries=st.integers(1, 16),
    seed=st.integers(0, 10_000),
)
def test_gather_kv_equals_full_attention(lengths, dcp_size, interleave, queries, seed):
    inputs = random_batch(lengths, [min(queries, max(n, 1)) for n in lengths], seed=seed)
    expected_out, expected_lse = naive_attention(inputs, SCALE)
    out, lse = gather_kv_attention(inputs, dcp_size, interleave)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), expected_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), expected_lse, atol=1e-5, rtol=1e-5)


def test_shared_prefix_rows_under_both_strategies():
    """Two requests whose page-table rows share the locations of a common prefix."""
    inputs = random_batch([20, 12, 0], [4, 3, 1], seed=9)
    inputs["req_to_token"][1, :8] = inputs["req_to_token"][0, :8]
    expected, _ = naive_attention(inputs, SCALE)
    for dcp_size in (2, 4):
        out, _ = gather_kv_attention(inputs, dcp_size, 1)
        torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
        merged, _ = gather_q_attention(inputs, dcp_size, 1, SCALE)
        torch.testing.assert_close(merged.double(), expected, atol=1e-5, rtol=1e-5)


def test_padded_rows_stay_zero_and_finite():
    inputs = random_batch([0, 5, 0], [1, 2, 1], seed=2)
    out, lse = gather_kv_attention(inputs, 4, 1)
    padded = inputs["seq_lens"][inputs["q_seq_ids"]] == 0
    assert torch.isfinite(out).all()
    assert torch.all(out[padded] == 0) and torch.all(torch.isneginf(lse[padded]))


def test_causal_mask_uses_global_positions_not_local_indices():
    """Verify: a draft at position p must not see the later drafts, whichever rank holds them."""
    inputs = random_batch([10], [7], seed=5)
    expected, _ = naive_attention(inputs, SCALE)
    out, _ = gather_kv_attention(inputs, 4, 1)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    leaky = dict(inputs, q_positions=torch.full_like(inputs["q_positions"], 9))
    leaked, _ = naive_attention(leaky, SCALE)
    assert (leaked - expected).abs().max() > 1e-3  # the mask matters for these inputs
