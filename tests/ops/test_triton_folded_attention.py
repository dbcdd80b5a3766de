"""The folded partial-attention kernel (lowering/triton/folded_attention.py) against the torch
reference, on CPU under TRITON_INTERPRET=1: every query count 1..16 a request is on the GPU
(tests/gpu/test_folded_attention.py); here the shapes are tiny and the counts a few."""

from __future__ import annotations

import os

# Before any kernel module is imported: triton.jit decides at definition time whether a kernel
# is interpreted.
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from dcp_compile.lowering.triton import attention, folded_attention  # noqa: E402
from dcp_compile.lowering.triton.attention_tiling import AttentionTiling  # noqa: E402
from dcp_compile.lowering.triton.launching import is_interpreted  # noqa: E402
from dcp_compile.ops import reference  # noqa: E402
from tests.ops.reference_inputs import random_batch, shard_inputs  # noqa: E402

if not is_interpreted(folded_attention._attend_folded_kernel):
    pytest.skip("the kernels were imported without TRITON_INTERPRET=1 in this process; run this file on its own",
                allow_module_level=True)

SCALE = 0.25
# Padded rows (0: one query that sees nothing), one-token requests (an empty shard on every other
# rank), and requests long enough for several key blocks a split.
LENGTHS = [0, 1, 37, 5, 0, 64, 2]
FP32 = dict(atol=1e-5, rtol=1e-5)
BF16 = dict(atol=2e-2, rtol=2e-2)


def _inputs(lengths, queries, dcp_size, interleave, rank, heads=5, rank_dim=32, rope_dim=16, dtype=torch.float32,
            seed=0):
    """Rank `rank`'s partial-attention inputs, queries grouped by request in request order
    (RequestTable's batches; `_permuted` reorders them), q slices of one gathered tensor (not
    contiguous, as the Q all-gather leaves them)."""
    per_request = [min(queries, max(n, 1)) for n in lengths]
    inputs = random_batch(lengths, per_request, heads=heads, rank_dim=rank_dim, rope_dim=rope_dim, seed=seed, dtype=dtype)
    shard = shard_inputs(inputs, dcp_size, interleave, rank)
    page_table, seq_lens, key_positions = reference.local_metadata(inputs["req_to_token"], inputs["seq_lens"], rank,
                                                                   dcp_size, interleave)
    gathered = torch.cat([inputs["q_latent"], inputs["q_rope"]], dim=-1)
    return (gathered[..., :rank_dim], gathered[..., rank_dim:], shard, page_table, seq_lens, key_positions,
            inputs["q_seq_ids"], inputs["q_positions"])


def _run(args, tiling=None, tiles=None, fold=True):
    """The kernel into NaN-poisoned outputs and workspace, so an element left unwritten fails."""
    q_latent = args[0]
    tokens, heads, rank_dim = q_latent.shape
    out = torch.full(q_latent.shape, float("nan"), dtype=q_latent.dtype)
    lse = torch.full((tokens, heads), float("nan"), dtype=torch.float32)
    workspace = None
    if tiling is not None:
        workspace = tuple(t.fill_(float("nan"))
                          for t in attention.split_workspace(tokens, tiling.num_splits, heads, rank_dim, "cpu"))
    folded_attention.folded_partial_attention_into(*args, SCALE, out, lse, tiling=tiling, tiles=tiles,
                                                   workspace=workspace, fold=fold)
    return out, lse


def _assert_close(actual, expected, tolerance):
    (out, lse), (want_out, want_lse) = actual, expected
    assert out.dtype == want_out.dtype and lse.dtype == torch.float32
    assert not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(out.float(), want_out.float(), **tolerance)
    torch.testing.assert_close(lse, want_lse, **FP32)
    empty = torch.isneginf(want_lse)
    assert torch.equal(torch.isneginf(lse), empty)
    assert not out[empty].any()


@pytest.mark.parametrize("dcp_size,interleave,rank", [(1, 1, 0), (2, 1, 1), (4, 2, 2)])
@pytest.mark.parametrize("queries", [1, 2, 7, 16])
def test_folded_attention_matches_reference(dcp_size, interleave, rank, queries):
    args = _inputs(LENGTHS, queries, dcp_size, interleave, rank, seed=dcp_size * 100 + rank * 10 + queries)
    expected = reference.partial_attention(*args, SCALE)
    assert (args[4] == 0).any(), "the batch should hold empty shards"
    _assert_close(_run(args), expected, FP32)


@pytest.mark.parametrize("num_splits,tiles", [(1, 1), (3, 1), (2, 2)])
def test_folded_attention_loops_over_more_rows_than_its_tiles(num_splits, tiles):
    """A request with more (query, head) rows than its work item's tiles (16 queries x 5 heads =
    80 rows in 16-row tiles, against 1 or 2 tiles a work item) takes them in turn, for any split."""
    args = _inputs(LENGTHS, 16, 2, 1, 0, seed=7)
    expected = reference.partial_attention(*args, SCALE)
    _assert_close(_run(args, AttentionTiling(num_splits=num_splits, block_h=16, block_n=16), tiles), expected, FP32)


def test_folded_attention_equals_the_per_query_kernel_split_by_split():
    """Both kernels cut a request's keys into the same splits and merge them alike."""
    args = _inputs(LENGTHS, 7, 2, 1, 1, seed=9)
    tiling = AttentionTiling(num_splits=3, block_h=16, block_n=16)
    out, lse = _run(args, tiling)
    want_out, want_lse = torch.empty_like(out), torch.empty_like(lse)
    attention.partial_attention_into(*args, SCALE, want_out, want_lse, tiling=tiling)
    torch.testing.assert_close(out, want_out, **FP32)
    torch.testing.assert_close(lse, want_lse, **FP32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_folded_attention_half_precision(dtype):
    args = _inputs(LENGTHS, 4, 2, 1, 1, heads=3, dtype=dtype, seed=21)
    _assert_close(_run(args), reference.partial_attention(*args, SCALE), BF16)


def test_folded_attention_of_empty_shards_is_zero_with_lse_minus_inf():
    """One token a request: on rank 1 of 2 the requests whose location is even see nothing."""
    args = _inputs([1, 1, 1, 1], 1, 2, 1, 1, heads=2, seed=41)
    assert (args[4] == 0).any() and (args[4] > 0).any()
    out, lse = _run(args)
    for token, request in enumerate(args[6].tolist()):
        if int(args[4][request]) == 0:
            assert torch.isneginf(lse[token]).all() and not out[token].any()
    _assert_close((out, lse), reference.partial_attention(*args, SCALE), FP32)


def test_folded_attention_uneven_dims_and_tiles_across_queries():
    """R and P that are not powers of two, and heads (20) that do not divide the tile (32 rows in
    fp32): a tile holds the end of one query's heads and the start of the next's."""
    args = _inputs([0, 23, 6, 40], 3, 2, 1, 0, heads=20, rank_dim=48, rope_dim=8, seed=31)
    _assert_close(_run(args), reference.partial_attention(*args, SCALE), FP32)


def test_folded_attention_without_queries():
    args = _inputs([3], 1, 1, 1, 0, heads=2, seed=5)
    empty = [a[:0] if i in (0, 1, 6, 7) else a for i, a in enumerate(args)]
    out, lse = folded_attention.folded_partial_attention(*empty, SCALE)
    assert out.shape == (0, 2, 32) and lse.shape == (0, 2)


def _permuted(args, order, seed=0):
    """The inputs with their tokens (q, row ids, positions) in another order."""
    tokens = args[0].shape[0]
    permutation = {"swapped": torch.cat([torch.arange(4, tokens), torch.arange(4)]),
                   "interleaved": torch.cat([torch.arange(0, tokens, 2), torch.arange(1, tokens, 2)]),
                   "reversed": torch.arange(tokens - 1, -1, -1),
                   "shuffled": torch.randperm(tokens, generator=torch.Generator().manual_seed(seed))}[order]
    return [a[permutation] if i in (0, 1, 6, 7) else a for i, a in enumerate(args)]


@pytest.mark.parametrize("order", ["swapped", "interleaved", "reversed", "shuffled"])
@pytest.mark.parametrize("dcp_size,rank", [(1, 0), (2, 1)])
def test_tokens_in_any_order_match_the_reference(order, dcp_size, rank):
    """The model contract does not group a row's tokens: verify's k = 5 at 16 heads (two tiles a
    request), the tokens of padded rows, empty shards and long requests in any order, folded."""
    args = _permuted(_inputs(LENGTHS, 5, dcp_size, 1, rank, heads=16, seed=6 + rank), order, seed=dcp_size)
    assert not torch.equal(args[6], args[6].sort().values)
    _assert_close(_run(args), reference.partial_attention(*args, SCALE), FP32)


def test_tokens_out_of_order_over_loops_and_splits_match_the_reference():
    """Shuffled tokens with a request's rows over more tiles than its work item takes, in 3 splits."""
    args = _permuted(_inputs(LENGTHS, 16, 2, 1, 0, seed=8), "shuffled", seed=3)
    expected = reference.partial_attention(*args, SCALE)
    _assert_close(_run(args, AttentionTiling(num_splits=3, block_h=16, block_n=16), 2), expected, FP32)


def test_request_order_of_grouped_and_shuffled_ids():
    ids = torch.tensor([0, 0, 0, 2, 2, 3], dtype=torch.int32)
    token_order, starts = folded_attention.request_order(ids, 5)
    assert token_order.tolist() == list(range(6)) and starts.tolist() == [0, 3, 3, 5, 6, 6]
    token_order, starts = folded_attention.request_order(torch.tensor([3, 0, 2, 0, 2, 0], dtype=torch.int32), 5)
    assert token_order.tolist() == [1, 3, 5, 2, 4, 0] and starts.tolist() == [0, 3, 3, 5, 6, 6]


def test_the_launcher_folds_only_where_it_measured_faster(monkeypatch):
    """Verify's measured range (4..16 queries a request on average), at 16 heads from 4 tiles, at
    32 from 16; a query's 64 heads fill a tile themselves, and a few tiles leave the folded
    kernel's splits too short: there, and at decode and long chunks, the per-query kernel."""
    assert folded_attention.folds(4 * 7, 4, 16) and folded_attention.folds(16, 1, 16)
    assert folded_attention.folds(4 * 7, 4, 32) and folded_attention.folds(16 * 4, 16, 32)
    assert not folded_attention.folds(4 * 4, 4, 32) and not folded_attention.folds(16, 1, 32)
    assert not folded_attention.folds(4 * 7, 4, 64) and not folded_attention.folds(7, 1, 16)
    assert not folded_attention.folds(64, 64, 16) and not folded_attention.folds(64 * 17, 64, 16)
    per_query = []
    launch = attention.partial_attention_into
    monkeypatch.setattr(attention, "partial_attention_into",
                        lambda *a, **k: per_query.append(a[0].shape) or launch(*a, **k))
    args = _inputs([9, 30], 3, 1, 1, 0, heads=64, rank_dim=16, rope_dim=16, seed=3)
    _assert_close(_run(args, fold=None), reference.partial_attention(*args, SCALE), FP32)
    assert per_query == [(6, 64, 16)]
    args = _inputs(LENGTHS, 16, 1, 1, 0, seed=4)  # 42 tokens over 7 rows, 5 heads: folded
    _assert_close(_run(args, fold=None), reference.partial_attention(*args, SCALE), FP32)
    assert len(per_query) == 1


def test_folded_tiling_fills_a_tile_with_a_requests_queries():
    tiling, tiles = folded_attention.choose_folded_tiling(4 * 7, 4, 16, 4096, torch.device("cpu"))
    assert (tiling.block_h, tiles) == (64, 2)  # 7 x 16 = 112 rows: two tiles of 64
    tiling, tiles = folded_attention.choose_folded_tiling(4 * 4, 4, 16, 4096, torch.device("cpu"))
    assert (tiling.block_h, tiles) == (64, 1)  # k = 4 at 16 heads: one tile, one read of each block
    tiling, tiles = folded_attention.choose_folded_tiling(4, 4, 8, 4096, torch.device("cpu"))
    assert (tiling.block_h, tiles) == (16, 1)  # decode at 8 heads: the smallest tile
