"""The Triton kernels against the torch reference, on CPU under TRITON_INTERPRET=1.

Every output buffer is poisoned before a launch, so a test fails if a kernel leaves any element
unwritten. Shapes are tiny because the interpreter runs each program in numpy.
"""

from __future__ import annotations

import os

# Before any kernel module is imported: triton.jit decides at definition time whether a kernel
# is interpreted.
os.environ["TRITON_INTERPRET"] = "1"

import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from dcp_compile.lowering import triton as triton_kernels  # noqa: E402
from dcp_compile.ops import reference  # noqa: E402
from dcp_compile.lowering.triton import attention, kv_writer, merge, metadata_builder, pack  # noqa: E402
from dcp_compile.lowering.triton.attention_tiling import AttentionTiling, choose_num_splits  # noqa: E402
from dcp_compile.lowering.triton.launching import MAX_PROGRAMS, is_interpreted  # noqa: E402
from dcp_compile.runtime import layout  # noqa: E402
from tests.ops.reference_inputs import random_batch, shard_inputs  # noqa: E402

if not is_interpreted(attention._attend_splits_kernel):
    pytest.skip("the kernels were imported without TRITON_INTERPRET=1 in this process; run this file on its own",
                allow_module_level=True)

SCALE = 0.25
# Mixed lengths: padded rows (0), one-token requests (an empty shard on every other rank),
# and requests long enough for several key blocks per split.
LENGTHS = [0, 1, 37, 5, 0, 64, 2]
POISON_INDEX = -7777
FP32 = dict(atol=1e-5, rtol=1e-5)
# One bf16 ulp at the outputs' magnitude; the LSE is computed in fp32 on both sides.
BF16 = dict(atol=2e-2, rtol=2e-2)


def _generator(seed):
    return torch.Generator().manual_seed(seed)


def _nan_like(tensor):
    return torch.full_like(tensor, float("nan"))


def _assert_bitwise_equal(actual, expected):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    integer = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[actual.element_size()]
    assert torch.equal(actual.view(integer), expected.view(integer))


def _distinct_locations(count, capacity, gen):
    return torch.randperm(capacity - 1, generator=gen)[:count] + 1


# ---------------------------------------------------------------------------------------------
# KV writer


@pytest.mark.parametrize("dcp_size,interleave", [(1, 1), (2, 1), (4, 4)])
@pytest.mark.parametrize("cache_dtype,source_dtype",
                         [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                          (torch.float16, torch.float32), (torch.bfloat16, torch.float32)])
def test_kv_write_matches_reference(dcp_size, interleave, cache_dtype, source_dtype):
    gen = _generator(dcp_size * 10 + interleave)
    rank_dim, rope_dim, capacity, tokens = 48, 8, 96, 24
    rows = layout.rows_per_rank(capacity, dcp_size, interleave)
    loc = _distinct_locations(tokens, capacity, gen)
    loc[::5] = layout.PADDING_LOC
    latent = torch.randn(tokens, rank_dim, generator=gen).to(source_dtype)
    # A slice of a wider tensor: the writer must follow the rope's strides.
    rope = torch.randn(tokens, 2 * rope_dim, generator=gen).to(source_dtype)[:, rope_dim:]
    for rank in range(dcp_size):
        cache = torch.randn(rows, rank_dim + rope_dim, generator=gen).to(cache_dtype)
        expected = cache.clone()
        reference.kv_write(expected, latent, rope, loc, rank, dcp_size, interleave)
        triton_kernels.kv_write(cache, latent, rope, loc.to(torch.int32), rank, dcp_size, interleave)
        if cache_dtype == torch.bfloat16 and source_dtype != torch.bfloat16:
            # The interpreter truncates fp32 -> bf16 where the device rounds to nearest even
            # (the GPU tests compare bit for bit): allow one bf16 ulp.
            torch.testing.assert_close(cache.float(), expected.float(), rtol=2 ** -7, atol=0)
        else:
            _assert_bitwise_equal(cache, expected)


@pytest.mark.parametrize("dcp_size", [1, 2])
def test_kv_write_never_writes_a_location_outside_the_pool(dcp_size):
    """-1 used to wrap to the last row; a location past the pool must not land anywhere either.
    The reference raises on every rank; the kernel writes nothing for those tokens."""
    capacity, rows = 16, 16 // dcp_size
    loc = torch.tensor([3, -1, capacity, capacity + 5, 2])
    latent, rope = torch.randn(5, 8), torch.randn(5, 4)
    flag = kv_writer.location_error_flag(torch.device("cpu"))
    for rank in range(dcp_size):
        cache = torch.zeros(rows, 12)
        flag.zero_()
        triton_kernels.kv_write(cache, latent, rope, loc, rank, dcp_size, 1)
        assert int(flag) == 1  # the device-side error flag is raised
        flag.zero_()
        triton_kernels.kv_write(cache.clone(), latent[[0, 4]], rope[[0, 4]], loc[[0, 4]], rank, dcp_size, 1)
        assert int(flag) == 0
        expected = torch.zeros(rows, 12)
        reference.kv_write(expected, latent[[0, 4]], rope[[0, 4]], loc[[0, 4]], rank, dcp_size, 1)
        assert torch.equal(cache, expected)
        with pytest.raises(IndexError, match="location -1 is outside the pool"):
            reference.kv_write(torch.zeros(rows, 12), latent, rope, loc, rank, dcp_size, 1)


def test_kv_write_without_tokens_leaves_the_cache_alone():
    cache = torch.randn(8, 12)
    before = cache.clone()
    triton_kernels.kv_write(cache, torch.empty(0, 8), torch.empty(0, 4), torch.empty(0, dtype=torch.int64), 0, 2, 1)
    assert torch.equal(cache, before)


# ---------------------------------------------------------------------------------------------
# Local metadata


def _page_table(lengths, width, capacity, dtype, gen):
    table = torch.randint(-50, 50, (len(lengths), width), generator=gen)  # garbage past each length
    locations = _distinct_locations(sum(lengths), capacity, gen)
    offset = 0
    for b, n in enumerate(lengths):
        table[b, :n] = locations[offset:offset + n]
        offset += n
    return table.to(dtype)


def _check_metadata_into(table, seq_lens, rank, dcp_size, interleave):
    """local_metadata_into over poisoned outputs equals the reference bit for bit; returns it."""
    expected = reference.local_metadata(table, seq_lens, rank, dcp_size, interleave)
    outputs = (torch.full_like(table, POISON_INDEX), torch.full_like(seq_lens, POISON_INDEX),
               torch.full_like(table, POISON_INDEX))
    metadata_builder.local_metadata_into(table, seq_lens, rank, dcp_size, interleave, *outputs)
    for actual, wanted in zip(outputs, expected):
        _assert_bitwise_equal(actual, wanted)
    return expected


# Every dtype pair at DCP 2 with interleave 4, and every (dcp_size, interleave) once: the dtypes
# reach only the loads and stores, the ownership arithmetic only the sizes (the whole cross product
# took 26 s under the interpreter).
@pytest.mark.parametrize("table_dtype,lens_dtype,dcp_size,interleave", [
    (torch.int32, torch.int32, 2, 4), (torch.int64, torch.int64, 2, 4), (torch.int32, torch.int64, 2, 4),
    (torch.int64, torch.int64, 1, 1), (torch.int32, torch.int64, 2, 1), (torch.int32, torch.int32, 4, 1),
    (torch.int64, torch.int64, 4, 4)])
def test_local_metadata_matches_reference(table_dtype, lens_dtype, dcp_size, interleave, monkeypatch):
    # Narrow column blocks, so a row takes several blocks and the running count is exercised.
    monkeypatch.setattr(metadata_builder, "_MAX_BLOCK_COLUMNS", 16)
    gen = _generator(dcp_size * 100 + interleave)
    width = 70
    lengths = [0, 1, 70, 33, 0, 16, 5]
    table = _page_table(lengths, width, 512, table_dtype, gen)
    seq_lens = torch.tensor(lengths, dtype=lens_dtype)
    for rank in range(dcp_size):
        expected = _check_metadata_into(table, seq_lens, rank, dcp_size, interleave)
        for actual, wanted in zip(triton_kernels.local_metadata(table, seq_lens, rank, dcp_size, interleave), expected):
            _assert_bitwise_equal(actual, wanted)


def test_local_metadata_of_a_non_contiguous_table():
    gen = _generator(7)
    wide = _page_table([9, 0, 30], 64, 256, torch.int64, gen)
    table = wide[:, :32]
    seq_lens = torch.tensor([9, 0, 30], dtype=torch.int64)
    expected = reference.local_metadata(table, seq_lens, 1, 2, 1)
    for actual, wanted in zip(triton_kernels.local_metadata(table, seq_lens, 1, 2, 1), expected):
        _assert_bitwise_equal(actual, wanted)


WIDE_LENGTHS = [0, 3000, 1, 1500, 0, 129]


@pytest.mark.parametrize("table_dtype,lens_dtype,dcp_size,interleave", [
    (torch.int32, torch.int32, 1, 1), (torch.int64, torch.int64, 2, 1),
    (torch.int32, torch.int64, 2, 4), (torch.int64, torch.int32, 4, 4)])
def test_local_metadata_over_many_column_blocks(table_dtype, lens_dtype, dcp_size, interleave, monkeypatch):
    # 128-column blocks: a 3000-wide row spans 24 blocks, and the prefix over their counts takes
    # three 8-count steps. Row 1 holds consecutive locations from an odd start, so runs of owned
    # entries cross block boundaries; the other rows are random, short, empty or block-sized.
    monkeypatch.setattr(metadata_builder, "_MAX_BLOCK_COLUMNS", 128)
    monkeypatch.setattr(metadata_builder, "_MAX_COUNT_BLOCK", 8)
    gen = _generator(dcp_size * 10 + interleave)
    width = 3000
    table = _page_table(WIDE_LENGTHS, width, 1 << 16, torch.int64, gen)
    table[1] = torch.arange(width) + (1 << 16) + 3
    table = table.to(table_dtype)
    seq_lens = torch.tensor(WIDE_LENGTHS, dtype=lens_dtype)
    for rank in range(dcp_size) if dcp_size <= 2 else (0, dcp_size - 1):
        _check_metadata_into(table, seq_lens, rank, dcp_size, interleave)


def test_local_metadata_with_a_workspace_and_a_capped_grid(monkeypatch):
    # Three programs for 3 x 5 (request, block) items: each program loops over several items.
    monkeypatch.setattr(metadata_builder, "_MAX_BLOCK_COLUMNS", 16)
    monkeypatch.setattr(metadata_builder, "grid_for", lambda items: (min(items, 3),))
    gen = _generator(5)
    lengths = [70, 0, 41]
    table = _page_table(lengths, 70, 512, torch.int64, gen)
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    expected = reference.local_metadata(table, seq_lens, 1, 2, 4)
    assert metadata_builder.workspace_numel(3, 70) == 15
    workspace = torch.full((20,), POISON_INDEX, dtype=torch.int32)
    outputs = tuple(torch.full_like(t, POISON_INDEX) for t in expected)
    metadata_builder.local_metadata_into(table, seq_lens, 1, 2, 4, *outputs, workspace=workspace)
    for actual, wanted in zip(outputs, expected):
        _assert_bitwise_equal(actual, wanted)
    with pytest.raises(ValueError, match="workspace"):
        metadata_builder.local_metadata_into(table, seq_lens, 1, 2, 4, *outputs, workspace=workspace[:14])


def test_local_metadata_of_empty_shapes():
    table = torch.zeros(3, 0, dtype=torch.int64)
    lens = torch.zeros(3, dtype=torch.int64)
    local_table, local_lens, local_positions = triton_kernels.local_metadata(table, lens, 0, 2, 1)
    assert local_table.shape == (3, 0) and local_positions.shape == (3, 0) and torch.equal(local_lens, lens)
    outputs = triton_kernels.local_metadata(torch.zeros(0, 5, dtype=torch.int32), torch.zeros(0, dtype=torch.int32), 1, 2, 1)
    assert [tuple(t.shape) for t in outputs] == [(0, 5), (0,), (0, 5)]


# ---------------------------------------------------------------------------------------------
# Partial attention


def _local_attention_inputs(lengths, queries_per_request, dcp_size, interleave, rank, heads, rank_dim, rope_dim,
                            dtype, table_dtype, seed):
    """Rank `rank`'s inputs to partial attention: its shard, local page table, lengths, positions."""
    inputs = random_batch(lengths, queries_per_request, heads=heads, rank_dim=rank_dim, rope_dim=rope_dim,
                          seed=seed, dtype=dtype)
    shard = shard_inputs(inputs, dcp_size, interleave, rank)
    page_table, seq_lens, key_positions = reference.local_metadata(
        inputs["req_to_token"].to(table_dtype), inputs["seq_lens"], rank, dcp_size, interleave)
    # Queries in a scrambled order, so nothing depends on tokens of a request being adjacent.
    order = torch.randperm(inputs["q_seq_ids"].numel(), generator=_generator(seed + 1))
    # Slices of one gathered tensor, as the Q all-gather leaves them: not contiguous.
    gathered = torch.cat([inputs["q_latent"], inputs["q_rope"]], dim=-1)[order]
    return (gathered[..., :rank_dim], gathered[..., rank_dim:], shard, page_table, seq_lens, key_positions,
            inputs["q_seq_ids"][order], inputs["q_positions"][order])


def _run_partial_attention(args, tiling=None):
    q_latent = args[0]
    out = _nan_like(torch.empty(q_latent.shape, dtype=q_latent.dtype))
    lse = _nan_like(torch.empty(q_latent.shape[:2], dtype=torch.float32))
    workspace = None
    if tiling is not None:
        tokens, heads, rank_dim = q_latent.shape
        workspace = tuple(_nan_like(t) for t in attention.split_workspace(tokens, tiling.num_splits, heads, rank_dim, "cpu"))
    attention.partial_attention_into(*args, SCALE, out, lse, tiling=tiling, workspace=workspace)
    return out, lse


def _assert_attention_close(actual, expected, tolerance):
    (out, lse), (want_out, want_lse) = actual, expected
    assert out.dtype == want_out.dtype and lse.dtype == torch.float32
    assert not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(out.float(), want_out.float(), **tolerance)
    torch.testing.assert_close(lse, want_lse, **FP32)
    empty = torch.isneginf(want_lse)
    assert torch.equal(torch.isneginf(lse), empty)
    assert not out[empty].any()


@pytest.mark.parametrize("dcp_size,interleave,rank", [(1, 1, 0), (2, 1, 1), (2, 4, 0), (4, 1, 3)])
@pytest.mark.parametrize("queries", [1, 3], ids=["decode", "verify"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_partial_attention_matches_reference(dcp_size, interleave, rank, queries, num_splits):
    seed = dcp_size * 1000 + interleave * 100 + rank * 10 + queries
    table_dtype = torch.int32 if seed % 2 else torch.int64
    args = _local_attention_inputs(LENGTHS, [min(queries, max(n, 1)) for n in LENGTHS], dcp_size, interleave, rank,
                                   heads=5, rank_dim=32, rope_dim=16, dtype=torch.float32, table_dtype=table_dtype,
                                   seed=seed)
    expected = reference.partial_attention(*args, SCALE)
    tiling = AttentionTiling(num_splits=num_splits, block_h=16, block_n=16)
    _assert_attention_close(_run_partial_attention(args, tiling), expected, FP32)


def test_partial_attention_default_tiling_and_launcher():
    args = _local_attention_inputs(LENGTHS, [2] * len(LENGTHS), 2, 1, 0, heads=4, rank_dim=32, rope_dim=16,
                                   dtype=torch.float32, table_dtype=torch.int64, seed=11)
    expected = reference.partial_attention(*args, SCALE)
    _assert_attention_close(_run_partial_attention(args), expected, FP32)
    _assert_attention_close(triton_kernels.partial_attention(*args, SCALE), expected, FP32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_partial_attention_half_precision(dtype):
    args = _local_attention_inputs(LENGTHS, [2] * len(LENGTHS), 2, 1, 1, heads=3, rank_dim=32, rope_dim=16,
                                   dtype=dtype, table_dtype=torch.int32, seed=21)
    expected = reference.partial_attention(*args, SCALE)
    _assert_attention_close(_run_partial_attention(args, AttentionTiling(2, 16, 16)), expected, BF16)


def test_partial_attention_masks_uneven_dims_and_several_head_tiles():
    """R and P that are not powers of two, and more heads than one tile holds."""
    args = _local_attention_inputs([0, 23, 6], [1, 3, 2], 2, 1, 0, heads=20, rank_dim=48, rope_dim=8,
                                   dtype=torch.float32, table_dtype=torch.int64, seed=31)
    expected = reference.partial_attention(*args, SCALE)
    _assert_attention_close(_run_partial_attention(args, AttentionTiling(2, 16, 16)), expected, FP32)


def _head_major(tensor: torch.Tensor, head_stride: int) -> torch.Tensor:
    """`tensor` [T, H, C] as a view with heads `head_stride` elements apart in one storage that is
    mostly never touched (allocated lazily), tokens C apart: the layout inductor gives the
    absorbed query of a long prefill, where a head's offset passes 2^31 elements."""
    tokens, heads, cols = tensor.shape
    storage = torch.empty((heads - 1) * head_stride + tokens * cols, dtype=tensor.dtype)
    view = storage.as_strided(tensor.shape, (cols, head_stride, 1))
    view.copy_(tensor)
    return view


def test_partial_attention_offsets_past_2_to_the_31_elements():
    """A query and an output whose last head starts past 2^31 elements (a head-major query of a
    16k x 8 prefill at 64 heads): 32-bit offsets read and write outside them (an illegal memory
    access on an H100)."""
    args = _local_attention_inputs([3, 9], [1, 2], 1, 1, 0, heads=3, rank_dim=16, rope_dim=16, dtype=torch.bfloat16,
                                   table_dtype=torch.int32, seed=51)
    expected = reference.partial_attention(*args, SCALE)
    head_stride = 2**30 + 16  # head 2 at 2^31 + 32 elements
    q_latent = _head_major(args[0].contiguous(), head_stride)
    out = _head_major(_nan_like(args[0].contiguous()), head_stride)
    lse = _nan_like(torch.empty(args[0].shape[:2], dtype=torch.float32))
    attention.partial_attention_into(q_latent, *args[1:], SCALE, out, lse, tiling=AttentionTiling(2, 16, 16))
    _assert_attention_close((out.contiguous(), lse), expected, BF16)


def test_partial_attention_of_an_empty_shard_is_zero_with_lse_minus_inf():
    # One token per request: on rank 1 of 2, requests whose only location is even see nothing.
    args = _local_attention_inputs([1, 1, 1, 1], [1] * 4, 2, 1, 1, heads=2, rank_dim=16, rope_dim=16,
                                   dtype=torch.float32, table_dtype=torch.int64, seed=41)
    assert (args[4] == 0).any(), "the batch should hold an empty shard"
    out, lse = _run_partial_attention(args, AttentionTiling(2, 16, 16))
    for t, request in enumerate(args[6].tolist()):
        if int(args[4][request]) == 0:
            assert torch.isneginf(lse[t]).all() and not out[t].any()
    _assert_attention_close((out, lse), reference.partial_attention(*args, SCALE), FP32)


def test_partial_attention_without_queries():
    args = _local_attention_inputs([3], [1], 1, 1, 0, heads=2, rank_dim=16, rope_dim=16, dtype=torch.float32,
                                   table_dtype=torch.int64, seed=5)
    empty = [a[:0] if i in (0, 1, 6, 7) else a for i, a in enumerate(args)]
    out, lse = triton_kernels.partial_attention(*empty, SCALE)
    assert out.shape == (0, 2, 16) and lse.shape == (0, 2)


def test_sharded_attention_merges_to_the_unsharded_result():
    """Each rank's Triton metadata + partial attention, packed, exchanged by stacking and merged,
    equals the reference attention over the whole cache."""
    dcp_size, heads, rank_dim, rope_dim = 2, 4, 32, 16
    inputs = random_batch(LENGTHS, [min(2, max(n, 1)) for n in LENGTHS], heads=dcp_size * heads, rank_dim=rank_dim,
                          rope_dim=rope_dim, seed=51)
    query = (inputs["q_latent"], inputs["q_rope"])
    packed = []
    for rank in range(dcp_size):
        shard = shard_inputs(inputs, dcp_size, 1, rank)
        local = triton_kernels.local_metadata(inputs["req_to_token"], inputs["seq_lens"], rank, dcp_size, 1)
        out, lse = triton_kernels.partial_attention(*query, shard, *local, inputs["q_seq_ids"], inputs["q_positions"], SCALE)
        packed.append(triton_kernels.pack_partials(out, lse, dcp_size))
    expected, _ = reference.partial_attention(
        *query, inputs["kv_cache"], inputs["req_to_token"], inputs["seq_lens"],
        reference.global_positions(inputs["req_to_token"]), inputs["q_seq_ids"], inputs["q_positions"], SCALE)
    for rank in range(dcp_size):
        received = torch.stack([packed[peer][rank] for peer in range(dcp_size)])
        merged = triton_kernels.merge_partials(received, rank_dim)
        torch.testing.assert_close(merged, expected[:, rank * heads:(rank + 1) * heads], **FP32)


# ---------------------------------------------------------------------------------------------
# Window attention (the masked part of verify next to an unmasked paged kernel)


def _prefix_partials(args):
    """Attention over each row's keys before its first query: what an unmasked paged call returns."""
    q_latent, q_rope, cache, page_table, seq_lens, key_positions, q_seq_ids, q_positions = args
    first = reference.first_query_positions(q_seq_ids, q_positions, page_table.shape[0])
    return reference.partial_attention(q_latent, q_rope, cache, page_table, seq_lens, key_positions, q_seq_ids,
                                       first[q_seq_ids] - 1, SCALE)


@pytest.mark.parametrize("dcp_size,interleave,rank", [(1, 1, 0), (2, 1, 1), (4, 2, 2)])
@pytest.mark.parametrize("queries,window", [(1, 1), (3, 16), (7, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_window_attention_completes_the_prefix_to_causal_attention(dcp_size, interleave, rank, queries, window, dtype):
    seed = 7000 + dcp_size * 100 + rank * 10 + queries
    args = _local_attention_inputs(LENGTHS, [min(queries, max(n, 1)) for n in LENGTHS], dcp_size, interleave, rank,
                                   heads=20, rank_dim=48, rope_dim=8, dtype=dtype, table_dtype=torch.int32, seed=seed)
    prefix_out, prefix_lse = _prefix_partials(args)
    got = triton_kernels.window_attention(prefix_out, prefix_lse, *args, SCALE, window)
    tolerance = FP32 if dtype == torch.float32 else BF16
    _assert_attention_close(got, reference.window_attention(prefix_out, prefix_lse, *args, SCALE, window), tolerance)
    _assert_attention_close(got, reference.partial_attention(*args, SCALE), tolerance)


def test_window_attention_offsets_past_2_to_the_31_elements():
    """The window kernel's query and prefix partials head-major, the last head past 2^31 elements."""
    args = _local_attention_inputs([3, 9], [1, 3], 1, 1, 0, heads=3, rank_dim=16, rope_dim=16, dtype=torch.bfloat16,
                                   table_dtype=torch.int32, seed=53)
    prefix_out, prefix_lse = _prefix_partials(args)
    want = reference.window_attention(prefix_out, prefix_lse, *args, SCALE, 4)
    head_stride = 2**30 + 16
    got = triton_kernels.window_attention(_head_major(prefix_out.contiguous(), head_stride), prefix_lse,
                                          _head_major(args[0].contiguous(), head_stride), *args[1:], SCALE, 4)
    _assert_attention_close(got, want, BF16)


def _split(cache, rank_dim):
    """The split layout of a packed cache: contiguous latent [rows, R] and rope [rows, P]."""
    return cache[:, :rank_dim].contiguous(), cache[:, rank_dim:].contiguous()


@pytest.mark.parametrize("dcp_size,interleave,rank", [(1, 1, 0), (2, 1, 1), (4, 2, 2)])
def test_split_cache_kernels_equal_the_packed_ones_bit_for_bit(dcp_size, interleave, rank):
    """The writer, partial attention and window attention read and write a split cache (latent
    and rope in two tensors) exactly as they do the packed rows (docs/ascend.md §11.1)."""
    rank_dim, rope_dim = 48, 16
    args = _local_attention_inputs(LENGTHS, [min(3, max(n, 1)) for n in LENGTHS], dcp_size, interleave, rank,
                                   heads=6, rank_dim=rank_dim, rope_dim=rope_dim, dtype=torch.bfloat16,
                                   table_dtype=torch.int32, seed=8100 + rank)
    packed = args[2]
    latent, rope = _split(packed, rank_dim)
    split_args = (*args[:2], latent, *args[3:])
    _assert_bitwise_equal(attention.partial_attention(*split_args, SCALE, rope_cache=rope)[0],
                          attention.partial_attention(*args, SCALE)[0])
    _assert_bitwise_equal(attention.partial_attention(*split_args, SCALE, rope_cache=rope)[1],
                          attention.partial_attention(*args, SCALE)[1])
    prefix_out, prefix_lse = _prefix_partials(args)
    got = triton_kernels.window_attention(prefix_out, prefix_lse, *split_args, SCALE, 8, rope_cache=rope)
    want = triton_kernels.window_attention(prefix_out, prefix_lse, *args, SCALE, 8)
    for a, b in zip(got, want):
        _assert_bitwise_equal(a, b)
    for a, b in zip(reference.window_attention(prefix_out, prefix_lse, *split_args, SCALE, 8, rope_cache=rope),
                    reference.window_attention(prefix_out, prefix_lse, *args, SCALE, 8)):
        _assert_bitwise_equal(a, b)
    gen = _generator(8200 + rank)
    capacity = layout.logical_capacity(packed.shape[0], dcp_size, interleave)
    tokens = 20
    loc = _distinct_locations(tokens, capacity, gen)
    loc[::4] = layout.PADDING_LOC
    new_latent = torch.randn(tokens, rank_dim, generator=gen).bfloat16()
    new_rope = torch.randn(tokens, rope_dim, generator=gen).bfloat16()
    expected = packed.clone()
    triton_kernels.kv_write(expected, new_latent, new_rope, loc, rank, dcp_size, interleave)
    triton_kernels.kv_write(latent, new_latent, new_rope, loc, rank, dcp_size, interleave, rope_cache=rope)
    _assert_bitwise_equal(torch.cat([latent, rope], dim=-1), expected)
    ref_latent, ref_rope = _split(packed, rank_dim)
    reference.kv_write(ref_latent, new_latent, new_rope, loc, rank, dcp_size, interleave, rope_cache=ref_rope)
    _assert_bitwise_equal(torch.cat([ref_latent, ref_rope], dim=-1), expected)
    gathered = reference.gather_local_rows(latent, args[3], args[4], rope_cache=rope)
    _assert_bitwise_equal(gathered, reference.gather_local_rows(expected, args[3], args[4]))


def test_a_split_cache_of_the_wrong_shape_is_an_error():
    args = _local_attention_inputs([3, 5], [1, 1], 1, 1, 0, heads=2, rank_dim=16, rope_dim=16, dtype=torch.float32,
                                   table_dtype=torch.int32, seed=8300)
    latent, rope = _split(args[2], 16)
    with pytest.raises(ValueError, match="a split KV cache is kv_cache \\[rows, R\\]"):
        attention.partial_attention(*args[:2], latent, *args[3:], SCALE, rope_cache=rope[:-1])
    with pytest.raises(ValueError, match="a split KV cache"):
        triton_kernels.kv_write(args[2], args[0][:, 0], args[1][:, 0], torch.tensor([1]), rope_cache=rope)


def test_window_attention_without_queries():
    args = _local_attention_inputs([3], [1], 1, 1, 0, heads=2, rank_dim=16, rope_dim=16, dtype=torch.float32,
                                   table_dtype=torch.int64, seed=5)
    empty = [a[:0] if i in (0, 1, 6, 7) else a for i, a in enumerate(args)]
    out, lse = triton_kernels.window_attention(empty[0], empty[0][..., 0].float(), *empty, SCALE, 4)
    assert out.shape == (0, 2, 16) and lse.shape == (0, 2)


# ---------------------------------------------------------------------------------------------
# Pack and merge


def _random_partials(tokens, all_heads, rank_dim, dtype, gen):
    """Partials with empty-shard rows (lse -inf, out NaN, as an unmasked kernel might leave)."""
    out = torch.randn(tokens, all_heads, rank_dim, generator=gen).to(dtype)
    lse = torch.randn(tokens, all_heads, generator=gen) * 3
    empty = torch.rand(tokens, all_heads, generator=gen) < 0.3
    empty[0] = True
    lse[empty] = float("-inf")
    out[empty] = float("nan")
    return out, lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dcp_size", [1, 2, 4])
def test_pack_partials_matches_reference_bit_for_bit(dtype, dcp_size):
    gen = _generator(dcp_size)
    tokens, heads, rank_dim = 5, 3, 33
    out, lse = _random_partials(tokens, dcp_size * heads, rank_dim, dtype, gen)
    expected = reference.pack_partials(out, lse, dcp_size)
    packed = _nan_like(expected)
    pack.pack_partials_into(out, lse, dcp_size, packed)
    _assert_bitwise_equal(packed, expected)
    _assert_bitwise_equal(triton_kernels.pack_partials(out, lse, dcp_size), expected)


def test_pack_partials_follows_strides():
    gen = _generator(3)
    out, lse = _random_partials(4, 8, 64, torch.bfloat16, gen)
    out, lse = out[:, :, ::2], lse.t().contiguous().t()
    _assert_bitwise_equal(triton_kernels.pack_partials(out, lse, 2), reference.pack_partials(out, lse, 2))


def _packed_with_nan_in_empty_shards(dcp_size, tokens, heads, rank_dim, dtype, gen):
    out, lse = _random_partials(tokens, dcp_size * heads, rank_dim, dtype, gen)
    lse[1, :] = float("-inf")  # every shard of every head of token 1 is empty
    packed = reference.pack_partials(out, lse, dcp_size)
    empty = torch.isneginf(reference.unpack_partials(packed, rank_dim)[1])
    packed[..., :rank_dim][empty] = float("nan")
    return packed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dcp_size", [1, 2, 4])
def test_merge_partials_matches_reference(dtype, dcp_size):
    gen = _generator(10 + dcp_size)
    rank_dim = 33
    packed = _packed_with_nan_in_empty_shards(dcp_size, 6, 3, rank_dim, dtype, gen)
    expected = reference.merge_partials(packed, rank_dim)
    assert not expected.isnan().any()
    merged = _nan_like(expected)
    merge.merge_partials_into(packed, rank_dim, merged)
    tolerance = FP32 if dtype == torch.float32 else BF16
    torch.testing.assert_close(merged, expected, **tolerance)
    assert not merged[1].any(), "a row whose every shard is empty merges to 0"
    torch.testing.assert_close(triton_kernels.merge_partials(packed, rank_dim), expected, **tolerance)


def test_pack_then_merge_is_the_reference_round_trip():
    gen = _generator(99)
    dcp_size, rank_dim = 2, 64
    outs = [_random_partials(3, dcp_size * 4, rank_dim, torch.bfloat16, gen) for _ in range(dcp_size)]
    sent = [triton_kernels.pack_partials(out, lse, dcp_size) for out, lse in outs]
    expected_sent = [reference.pack_partials(out, lse, dcp_size) for out, lse in outs]
    for rank in range(dcp_size):
        received = torch.stack([sent[peer][rank] for peer in range(dcp_size)])
        expected = reference.merge_partials(torch.stack([expected_sent[peer][rank] for peer in range(dcp_size)]), rank_dim)
        torch.testing.assert_close(triton_kernels.merge_partials(received, rank_dim), expected, **BF16)


# ---------------------------------------------------------------------------------------------
# Bad input, launch limits, packaging


def test_unsupported_dtypes_raise_type_errors():
    double = torch.randn(4, 3, 8, dtype=torch.float64)
    index = torch.zeros(4, dtype=torch.int64)
    with pytest.raises(TypeError, match="float64"):
        triton_kernels.kv_write(torch.zeros(4, 8, dtype=torch.float64), double[:, 0, :4], double[:, 0, 4:], index)
    with pytest.raises(TypeError, match="int16"):
        triton_kernels.local_metadata(torch.zeros(2, 3, dtype=torch.int16), torch.zeros(2, dtype=torch.int16), 0, 1, 1)
    with pytest.raises(TypeError, match="float64"):
        triton_kernels.partial_attention(double[..., :4], double[..., 4:], torch.zeros(4, 8), torch.zeros(1, 2, dtype=torch.int64),
                                         torch.zeros(1, dtype=torch.int64), torch.zeros(1, 2, dtype=torch.int64), index, index, 1.0)
    with pytest.raises(TypeError, match="float64"):
        triton_kernels.pack_partials(double, torch.zeros(4, 3), 1)
    with pytest.raises(TypeError, match="float64"):
        triton_kernels.merge_partials(torch.zeros(1, 4, 3, 9, dtype=torch.float64), 8)


def test_bad_shapes_raise_value_errors():
    with pytest.raises(ValueError, match="do not split"):
        triton_kernels.pack_partials(torch.zeros(2, 3, 8), torch.zeros(2, 3), 2)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        triton_kernels.merge_partials(torch.zeros(2, 1, 1, 10), 8)
    with pytest.raises(ValueError, match="dcp_rank"):
        triton_kernels.local_metadata(torch.zeros(1, 2, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), 2, 2, 1)


def test_grid_loops_past_the_program_limit(monkeypatch):
    """Kernels stride over their work when it exceeds the grid cap (65535 programs on Ascend)."""
    assert MAX_PROGRAMS == 65535
    import dcp_compile.lowering.triton.launching as launching

    monkeypatch.setattr(launching, "MAX_PROGRAMS", 2)
    args = _local_attention_inputs([9, 4, 0], [2, 1, 1], 2, 1, 0, heads=3, rank_dim=16, rope_dim=16,
                                   dtype=torch.float32, table_dtype=torch.int64, seed=61)
    _assert_attention_close(_run_partial_attention(args, AttentionTiling(2, 16, 16)),
                            reference.partial_attention(*args, SCALE), FP32)
    out, lse = _random_partials(4, 4, 16, torch.float32, _generator(1))
    packed = triton_kernels.pack_partials(out, lse, 2)
    _assert_bitwise_equal(packed, reference.pack_partials(out, lse, 2))
    torch.testing.assert_close(triton_kernels.merge_partials(packed, 16), reference.merge_partials(packed, 16), **FP32)


@pytest.mark.parametrize("programs_per_split,width,units,expected", [
    (64, 131072, 132, 2),      # batch 64: one wave of 128 programs
    (4, 131072, 132, 30),      # batch 4: 120 programs
    (1, 8192, 132, 32),        # short context: capped by MIN_KEYS_PER_SPLIT
    (256, 131072, 132, 1),     # already several full waves
])
def test_split_heuristic_fills_the_machine(programs_per_split, width, units, expected):
    assert choose_num_splits(programs_per_split, width, units) == expected


def test_import_does_not_need_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import dcp_compile\n"
        "from dcp_compile.lowering import triton as kernels\n"
        "assert kernels.available() is False\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "TRITON_INTERPRET": "0"})
    assert triton_kernels.available()
